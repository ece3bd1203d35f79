"""DeltaNet (Schlag et al., 2021, "Linear Transformers Are Secretly Fast Weight Programmers"; parallelised
by Yang et al., 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length").

Per head, q and k are SiLU-activated and L2-normalised, β_t = sigmoid(Linear(x)) ∈ (0, 1):

    S_t = S_{t-1} + β_t k_tᵀ (v_t - k_t S_{t-1})      S: [d_k, d_v]; the delta rule overwrites k's old value
    o_t = scale · q_t S_t;   out = Linear(H·d_v → d)(o)

What is unusual here: `impl="naive"` is the token loop above (the specification); `impl="fla"` calls
`fla.ops.delta_rule.chunk_delta_rule` (forward) and `fused_recurrent_delta_rule` (step), with q, k already
normalised (use_qk_l2norm_in_kernel=False); `impl="chunk"` is `chunk_delta_rule` below, the same recurrence in
chunks in PyTorch. State {"S": [B, H, d_k, d_v]} in fp32; state_size = H·d_k·d_v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from zoo.models.mixers._common import make_config
from zoo.models.mixers._matrix_state import ChunkedHeadsConfig, MatrixStateMixer, fla_ops


@dataclass
class DeltaNetConfig(ChunkedHeadsConfig):
    """Options of `deltanet` (d_model comes from the model)."""

    mixer: ClassVar[str] = "deltanet"


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    scale: float,
    S: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (gated) delta rule in chunks, in PyTorch: the same outputs and final state as the token loop
    S_t = α_t (I - β_t k_tᵀk_t) S_{t-1} + β_t k_tᵀv_t, o_t = scale·q_t S_t, with a loop over T/C chunks
    instead of T tokens (Yang et al., 2024, the WY/UT form).

    Within a chunk, with γ_t = Σ_{i≤t} log α_i (cumulative from the chunk's start) and S₀ the state entering it,
    S_t = e^{γ_t} S₀ + Σ_{j≤t} e^{γ_t-γ_j} k_jᵀ u_j, where the pseudo-values u solve the unit lower-triangular
    system (I + A) U = diag(β) V - diag(β e^γ) K S₀, A_tj = β_t e^{γ_t-γ_j} k_t·k_j for j < t. So per chunk
    U = U' - W S₀ with U' = (I + A)⁻¹ diag(β) V and W = (I + A)⁻¹ diag(β e^γ) K, both computed for every
    chunk at once; only S₀ → U → (O, next S₀) runs in the loop.

    q, k: [B, T, H, d_k], v: [B, T, H, d_v], beta, g (log α ≤ 0; None for plain DeltaNet): [B, T, H],
    S: [B, H, d_k, d_v]. Returns o [B, T, H, d_v] and the final S. Padded tokens (β = 0, g = 0) leave S as it is.
    """
    B, T, H, _ = k.shape
    C = chunk_size
    pad = -T % C
    if g is None:
        g = torch.zeros_like(beta)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        beta, g = (F.pad(t, (0, 0, 0, pad)) for t in (beta, g))
    N = (T + pad) // C
    q, k, v = (rearrange(t, "b (n c) h d -> b h n c d", c=C) for t in (q, k, v))  # [B, H, N, C, D]
    beta, g = (rearrange(t, "b (n c) h -> b h n c", c=C) for t in (beta, g))  # [B, H, N, C]
    gamma = g.cumsum(-1)  # [B, H, N, C]
    lower = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()  # j ≤ t
    # e^{γ_t - γ_j} for j ≤ t, 0 above the diagonal (masked before exp: above it γ_t - γ_j ≥ 0 may overflow)
    decay = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")))  # [.., C, C]
    kk = k @ k.transpose(-1, -2)  # [B, H, N, C, C]
    A = (beta[..., None] * decay * kk).tril(-1)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    rhs = torch.cat([beta[..., None] * v, (beta * gamma.exp())[..., None] * k], dim=-1)  # [.., C, d_v + d_k]
    sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    u_free, w = sol.split([v.shape[-1], k.shape[-1]], dim=-1)  # U' [.., C, d_v], W [.., C, d_k]
    qk = decay * (q @ k.transpose(-1, -2))  # [.., C, C]
    q_in = gamma.exp()[..., None] * q  # e^{γ_t} q_t
    k_out = (gamma[..., -1:] - gamma).exp()[..., None] * k  # e^{γ_C - γ_j} k_j
    alpha_chunk = gamma[..., -1].exp()  # [B, H, N]
    outs = []
    for n in range(N):
        u = u_free[:, :, n] - w[:, :, n] @ S  # [B, H, C, d_v]
        outs.append(scale * (q_in[:, :, n] @ S + qk[:, :, n] @ u))
        S = alpha_chunk[:, :, n, None, None] * S + k_out[:, :, n].transpose(-1, -2) @ u
    o = rearrange(torch.stack(outs, dim=2), "b h n c d -> b (n c) h d")[:, :T]
    return o, S


class DeltaNet(MatrixStateMixer):
    """Delta-rule linear attention: [B, T, d_model] -> [B, T, d_model]. State: {"S": [B, H, d_k, d_v]} (fp32)."""

    Config = DeltaNetConfig
    name = "deltanet"
    FLA_MODULE = "delta_rule"
    FLA_NAMES = ("chunk_delta_rule", "fused_recurrent_delta_rule")

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = c = make_config(self.name, self.Config, d_model, options)
        self.d_model, self.impl = d_model, c.impl
        self.num_heads = H = c.heads(d_model)
        self.head_dim_k = self.head_dim_v = d_model // H
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.beta_proj = nn.Linear(d_model, H)
        self._gate_parameters(d_model, H)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.scale = self.head_dim_k**-0.5
        self._check_impl()

    def _gate_parameters(self, d_model: int, num_heads: int) -> None:
        """The parameters of a decay and an output gate: none here (gated_deltanet.GatedDeltaNet adds them)."""

    def _gates(self, x):
        """x: [B, T, d] -> (g: [B, T, H] log-decays, or None; the output gate [B, T, d], or None)."""
        return None, None

    def _inputs(self, x, state):
        q, k, v = (self._split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))  # [B, T, H, D] each
        q, k = l2_normalize(F.silu(q)), l2_normalize(F.silu(k))
        g, gate = self._gates(x)
        inp = {"q": q, "k": k, "v": v, "beta": torch.sigmoid(self.beta_proj(x))}  # beta: [B, T, H]
        if g is not None:
            inp["g"] = g
        return inp, gate

    def _naive_token(self, S, inp):
        k, beta = inp["k"], inp["beta"]
        if "g" in inp:
            S = torch.exp(inp["g"])[..., None, None] * S  # α_t S_{t-1}
        old = torch.einsum("bhk,bhkv->bhv", k, S)  # [B, H, d_v]: what S returns for k now
        S = S + beta[..., None, None] * k[..., None] * (inp["v"] - old)[..., None, :]
        return self.scale * torch.einsum("bhk,bhkv->bhv", inp["q"], S), S

    def _chunk(self, inp, S):
        beta, chunk = inp["beta"], self.config.chunk_size
        return chunk_delta_rule(inp["q"], inp["k"], inp["v"], beta, inp.get("g"), self.scale, S, chunk)

    def _fla(self, inp, S, recurrent):
        chunk, fused_recurrent = fla_ops(self.name, self.FLA_MODULE, self.FLA_NAMES)
        op = fused_recurrent if recurrent else chunk
        # FLA's gated ops take the log-decays as g=; its plain delta-rule ops have no such argument
        gates = {"g": inp["g"]} if "g" in inp else {}
        return op(
            q=inp["q"],
            k=inp["k"],
            v=inp["v"],
            beta=inp["beta"],
            **gates,
            scale=self.scale,
            initial_state=S,
            output_final_state=S is not None,
            use_qk_l2norm_in_kernel=False,
        )

    def _output(self, o, gate):
        o = rearrange(o, "b t h d -> b t (h d)")
        return self.out(o if gate is None else o * gate)  # [B, T, d_model]
