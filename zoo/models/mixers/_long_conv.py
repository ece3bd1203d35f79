"""Causal convolutions shared by the long-convolution mixers (Hyena, H3): FFT for long filters."""

from __future__ import annotations

import torch


def fft_causal_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """y[:, t, c] = Σ_{s≤t} h[t-s, c] · u[:, s, c], through an FFT of length 2T (no wrap-around).

    u: [B, T, C]; h: [T', C] with T' >= T (only the first T lags can reach inside the sequence) -> [B, T, C].
    Computed in at least fp32 (fp64 stays fp64) and cast back to u's dtype.
    """
    T = u.shape[1]
    dtype = torch.promote_types(u.dtype, torch.float32)
    n = 2 * T
    with torch.autocast(device_type=u.device.type, enabled=False):
        u_f = torch.fft.rfft(u.to(dtype), n=n, dim=1)  # [B, T+1, C]
        h_f = torch.fft.rfft(h[:T].to(dtype), n=n, dim=0)  # [T+1, C]
        y = torch.fft.irfft(u_f * h_f[None], n=n, dim=1)[:, :T]  # [B, T, C]
    return y.to(u.dtype)


def depthwise_causal_conv(u: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """Short depthwise FIR: y[:, t] = Σ_j weight[:, j] · u_full[:, t + j] with u_full = [history; u].

    u: [B, T, C]; weight: [C, k]; history: [B, k-1, C], the inputs before u (zeros at the start) -> [B, T, C].
    """
    k = weight.shape[1]
    u_full = torch.cat([history.to(u.dtype), u], dim=1)  # [B, T + k - 1, C]
    windows = u_full.unfold(1, k, 1)  # [B, T, C, k]
    return torch.einsum("btck,ck->btc", windows, weight)
