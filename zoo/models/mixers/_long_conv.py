"""Causal convolutions shared by the convolution mixers (Hyena, H3, short_conv, long_conv): FFT for long filters."""

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


# Above this many taps an explicit filter runs through the FFT: the unfolded windows of depthwise_causal_conv
# hold B·T·C·k elements (k = 256 at d = 512, B = 256, T = 256: 8.6·10⁹).
FFT_TAPS = 32


def explicit_causal_conv(u: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """depthwise_causal_conv's result for any kernel length: unfolded windows up to FFT_TAPS taps, else an FFT.

    u: [B, T, C]; weight: [C, k] (weight[:, k-1] multiplies the current input); history: [B, k-1, C] -> [B, T, C].
    """
    k = weight.shape[1]
    if k <= FFT_TAPS:
        return depthwise_causal_conv(u, weight, history)
    u_full = torch.cat([history.to(u.dtype), u], dim=1)  # [B, T + k - 1, C]
    return fft_causal_conv(u_full, weight.flip(1).T)[:, k - 1 :]  # h[lag] = weight[:, k-1-lag]
