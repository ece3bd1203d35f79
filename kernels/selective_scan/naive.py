"""Mamba's selective scan, the reference (and the specification of `scan.selective_scan`).

    h_t = exp(Δ_t ⊙ A) ⊙ h_{t-1} + (Δ_t ⊙ u_t) ⊗ B_t        h: [D, N] per sequence, A: [D, N] (negative)
    y_t = h_t · C_t                                        y_t: [D]

u, Δ (dt): [B, T, D]; B, C: [B, T, N] (shared by every channel); h0: [B, D, N]. The skip term D ⊙ u and the
gating live in the mixer (zoo/models/mixers/mamba.py), not here.
"""

from __future__ import annotations

import torch


def selective_scan_naive(u, dt, A, Bm, Cm, h0=None):
    """The loop over time in the inputs' dtype (use float64 for a reference). Returns (y [B, T, D], h_T [B, D, N])."""
    B, T, D = u.shape
    N = A.shape[1]
    h = torch.zeros(B, D, N, dtype=u.dtype, device=u.device) if h0 is None else h0.to(u.dtype)
    ys = []
    for t in range(T):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[:, :, None] * Bm[:, t, None, :]
        ys.append(torch.einsum("bdn,bn->bd", h, Cm[:, t]))
    return torch.stack(ys, dim=1), h
