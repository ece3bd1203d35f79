"""Causal convolutions shared by the convolution mixers (Hyena, H3, short_conv, long_conv).

`causal_conv` is the one entry for long filters: a direct Toeplitz matmul up to DIRECT_MAX_T positions, an FFT
beyond. Short FIRs (a few taps) are a sum of shifted products (`depthwise_causal_conv`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from kernels.vmap import members_as_channels, members_first

# Longest sequence that causal_conv convolves directly. Per output element (one b, t, c) the direct forward +
# backward is 6·T fp32 FLOPs (three T×T products per channel, half of them on the zero upper triangle); the FFT's
# is ≈ 250 bytes moved (pad, rfft, the product, irfft's input copy and its 2T outputs, in 8-byte complex, forward
# and backward). At the ≈ 50 TFLOP/s an H200 reaches in fp32 matmuls and its ≈ 4 TB/s the two meet near
# T ≈ 250·50/(6·4) ≈ 500, so every Zoology Fig. 2 length (≤ 512) is direct; experiments/bench/long_conv.py
# measures both at the grid's shapes.
DIRECT_MAX_T = 512

# Elements of one channel block's Toeplitz matrices [c, T, T]: 2^26 fp32 is 256 MiB (256 channels at T = 512),
# so the backward's largest temporaries (the block's matrices and its [c, T, 2T-1] filter gradient) stay near 1 GiB
# at any channel count. A mixer's Toeplitz matrices are rebuilt in the backward, never saved.
TOEPLITZ_BLOCK_ELEMENTS = 2**26

# fp32_precision (torch ≥ 2.9) names each backend's fp32 matmul precision; older torch has only CUDA's allow_tf32.
_PRECISION_API = TorchVersion(torch.__version__) >= (2, 9)


def _check(u: torch.Tensor, h: torch.Tensor) -> None:
    if u.dim() != 3 or h.dim() != 2 or h.shape[1] != u.shape[2] or h.shape[0] < 1:
        raise ValueError(f"causal conv: u must be [B, T, C] and h [T', C] with T' ≥ 1, got {tuple(u.shape)} and "
                         f"{tuple(h.shape)}")


def causal_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """y[:, t, c] = Σ_{s≤t} h[t-s, c] · u[:, s, c]: direct_causal_conv for T ≤ DIRECT_MAX_T, fft_causal_conv above.

    u: [B, T, C]; h: [T', C] (lags at or past T' are zero; lags past T - 1 never reach inside the sequence) ->
    [B, T, C] in u's dtype. Computed in at least fp32 (fp64 stays fp64), but for the direct path under autocast,
    whose matmuls take the autocast dtype (see direct_causal_conv).
    """
    if u.shape[1] <= DIRECT_MAX_T:
        return direct_causal_conv(u, h)
    return fft_causal_conv(u, h)


def fft_causal_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """causal_conv through an FFT of length 2T (no wrap-around): u: [B, T, C]; h: [T', C] -> [B, T, C]."""
    _check(u, h)
    T = u.shape[1]
    dtype = torch.promote_types(u.dtype, torch.float32)
    n = 2 * T
    with torch.autocast(device_type=u.device.type, enabled=False):
        u_f = torch.fft.rfft(u.to(dtype), n=n, dim=1)  # [B, T+1, C]
        h_f = torch.fft.rfft(h[:T].to(dtype), n=n, dim=0)  # [T+1, C]
        y = torch.fft.irfft(u_f * h_f[None], n=n, dim=1)[:, :T]  # [B, T, C]
    return y.to(u.dtype)


def direct_causal_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """causal_conv as one matmul per channel with its lower-triangular Toeplitz matrix W[t, s] = h[t-s]:
    u: [B, T, C]; h: [T', C] -> [B, T, C].

    Outside autocast the matmuls run at IEEE fp32 (or fp64) whatever the process's TF32 setting: TF32 keeps 10
    mantissa bits (≈ 5e-4 relative per product), and an fp32 model must give the FFT path's fp32 result on either
    side of DIRECT_MAX_T. Under autocast the matmuls run as autocast runs a convolution: u and h in the autocast
    dtype, fp32 accumulation, the result rounded to that dtype (bf16: ≈ 2^-9 relative per operand and on the
    result, the rounding every other matmul of the autocast model has), on tensor cores where IEEE fp32 has none.
    fp64 inputs stay fp64. Channels go in blocks of TOEPLITZ_BLOCK_ELEMENTS, and the backward rebuilds each block's
    matrices.
    """
    _check(u, h)
    T = u.shape[1]
    device = u.device.type
    if torch.is_autocast_enabled(device) and u.dtype != torch.float64:
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(u.dtype, torch.float32)
    with torch.autocast(device_type=u.device.type, enabled=False):
        lags = h[:T] if h.shape[0] >= T else F.pad(h, (0, 0, 0, T - h.shape[0]))  # [T, C]
        # The op works channels first, [C, T, B], the layout of its matmuls; the transposes to and from it stay out
        # here, where torch.compile writes them within the neighbouring kernels instead of as copies of their own.
        y_c = torch.ops.zoo_conv.toeplitz_conv(u.to(dtype).permute(2, 1, 0).contiguous(), lags.to(dtype))
    return y_c.permute(2, 1, 0).to(u.dtype)  # [B, T, C] (a view of the channels-first result)


@contextlib.contextmanager
def _ieee_fp32_matmuls(device: torch.device):
    """fp32 matmuls on `device` at IEEE precision and autocast off inside the block; the previous settings come
    back after it.

    The precision setting is process-wide, so it is set and restored around each op's own matmuls and nothing
    else. Autocast is off because the backward op runs wherever the backward is called, which may be under it."""
    if _PRECISION_API:
        backend = torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul
        setting = backend, "fp32_precision", "ieee"
    elif device.type == "cuda":
        setting = torch.backends.cuda.matmul, "allow_tf32", False
    else:  # older torch runs CPU fp32 matmuls at IEEE precision only
        setting = None
    with contextlib.ExitStack() as stack:
        if setting is not None:
            backend, name, value = setting
            stack.callback(setattr, backend, name, getattr(backend, name))
            setattr(backend, name, value)
        stack.enter_context(torch.autocast(device_type=device.type, enabled=False))
        yield


def _blocks(C: int, T: int) -> list[tuple[int, int]]:
    """Channel ranges [c0, c1) whose Toeplitz matrices [c1 - c0, T, T] hold ≤ TOEPLITZ_BLOCK_ELEMENTS (≥ 1 channel)."""
    step = max(1, TOEPLITZ_BLOCK_ELEMENTS // (T * T))
    return [(c0, min(C, c0 + step)) for c0 in range(0, C, step)]


def _toeplitz(h: torch.Tensor) -> torch.Tensor:
    """h: [T, c] -> W: [c, T, T], W[c, t, s] = h[t-s, c] for s ≤ t, else 0."""
    T = h.shape[0]
    padded = F.pad(h.T, (T - 1, 0))  # [c, 2T-1]: padded[:, T-1+lag] = h[lag], zeros at negative lags
    # unfold: [c, i, k] = padded[:, i + k]; flipping k gives padded[:, T-1 + t - s]. The flip is a contiguous copy.
    return padded.unfold(1, T, 1).flip(-1).contiguous()  # [c, T, T]


@torch.library.custom_op("zoo_conv::toeplitz_conv", mutates_args=())
def _toeplitz_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """u: [C, T, B] (channels first), h: [T, C], one dtype -> y: [C, T, B], y[c] = W_c @ u[c] per channel block."""
    u = u.contiguous()
    y = torch.empty_like(u)
    with _ieee_fp32_matmuls(u.device):
        for c0, c1 in _blocks(u.shape[0], u.shape[1]):
            torch.bmm(_toeplitz(h[:, c0:c1]), u[c0:c1], out=y[c0:c1])
    return y


@_toeplitz_conv.register_fake
def _toeplitz_conv_fake(u, h):
    return torch.empty_like(u, memory_format=torch.contiguous_format)


@torch.library.custom_op("zoo_conv::toeplitz_conv_backward", mutates_args=())
def _toeplitz_conv_backward(
    grad_y: torch.Tensor, u: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_y, u: [C, T, B], h: [T, C] -> grad_u = Wᵀ grad_y per channel [C, T, B] and grad_h [T, C], grad_h[lag] =
    Σ_b Σ_t grad_y[t, b] · u[t - lag, b] (the sum of grad_y u ᵀ along its lag-th diagonal)."""
    C, T, B = u.shape
    g = grad_y.to(u.dtype).contiguous()  # [C, T, B]
    u_rev = u.flip(1)  # [C, T, B], contiguous: u_rev[:, T-1-s] = u[:, s]
    grad_u = torch.empty_like(g)
    grad_h = u.new_empty(C, T)  # [C, lag]
    with _ieee_fp32_matmuls(u.device):
        for c0, c1 in _blocks(C, T):
            c = c1 - c0
            torch.bmm(_toeplitz(h[:, c0:c1]).transpose(1, 2), g[c0:c1], out=grad_u[c0:c1])
            # pairs[t, j] = Σ_b g[t, b] u[T-1-j, b] = (g uᵀ)[t, T-1-j], in rows of 2T-1 whose last T-1 are zero. Read
            # with a row stride of 2T-2 from offset T-1, (t, lag) lands on pairs[t, T-1-t+lag] = (g uᵀ)[t, t-lag]
            # for lag ≤ t and on the zeros for lag > t; the sum over t then runs over rows of contiguous lags.
            pairs = u.new_empty(c, T, 2 * T - 1)  # [c, T, 2T-1]
            pairs[:, :, T:].zero_()
            torch.bmm(g[c0:c1], u_rev[c0:c1].transpose(1, 2), out=pairs[:, :, :T])  # [c, T, T]
            grad_h[c0:c1] = pairs.as_strided((c, T, T), (T * (2 * T - 1), 2 * T - 2, 1), T - 1).sum(1)  # [c, T]
    return grad_u, grad_h.T.contiguous()  # [C, T, B], [T, C]


@_toeplitz_conv_backward.register_fake
def _toeplitz_conv_backward_fake(grad_y, u, h):
    # Both gradients come out contiguous, as the real op returns them, whatever the strides of u and h.
    return (
        torch.empty_like(u, memory_format=torch.contiguous_format),
        torch.empty_like(h, memory_format=torch.contiguous_format),
    )


def _toeplitz_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _toeplitz_grad(ctx, grad_y):
    u, h = ctx.saved_tensors
    return torch.ops.zoo_conv.toeplitz_conv_backward(grad_y, u, h)


_toeplitz_conv.register_autograd(_toeplitz_grad, setup_context=_toeplitz_setup)


# torch.func.vmap (packed runs vmap the model's forward over N members, then take torch.autograd.grad outside it, so
# the backward op sees plain tensors): the members' channels go one after another, and one call convolves all of
# them; an input that is not batched is shared by every member. torch.func.grad does not reach through the op (a
# custom op's autograd formula serves torch.autograd only).
@_toeplitz_conv.register_vmap
def _toeplitz_conv_vmap(info, in_dims, u, h):
    n = info.batch_size
    u = members_first(n, u, in_dims[0]).flatten(0, 1)  # [N·C, T, B]: member m's channels at m·C … (m+1)·C - 1
    h = members_as_channels(members_first(n, h, in_dims[1]))  # [T, N·C], in the same order
    return torch.ops.zoo_conv.toeplitz_conv(u, h).unflatten(0, (n, -1)), 0  # [N, C, T, B]


def depthwise_causal_conv(u: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """Short depthwise FIR: y[:, t] = Σ_j weight[:, j] · u_full[:, t + j] with u_full = [history; u].

    u: [B, T, C]; weight: [C, k]; history: [B, k-1, C], the inputs before u (zeros at the start) -> [B, T, C] in
    u's dtype. A sum of k shifted products, elementwise, because a contraction over the k taps would run as a batch
    of C matrix-vector products of inner size k, far from any matmul unit, on a [B, T, C, k] copy of the windows.
    """
    k, T = weight.shape[1], u.shape[1]
    w = weight.to(u.dtype)
    y = u * w[:, k - 1]  # [B, T, C]: the current input's tap
    if k > 1:
        u_full = torch.cat([history.to(u.dtype), u], dim=1)  # [B, T + k - 1, C]
        for j in range(k - 1):
            y = y + u_full[:, j : j + T] * w[:, j]
    return y


# Above this many taps an explicit filter runs through causal_conv: depthwise_causal_conv makes one pass over
# [B, T, C] per tap (k = 256 at d = 512, B = 256, T = 256: 256 passes over 3.4·10⁷ elements), where the Toeplitz
# matmul does T multiply-adds per element whatever k is.
SHIFTED_SUM_MAX_TAPS = 32


def explicit_causal_conv(u: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
    """depthwise_causal_conv's result for any kernel length: its shifted sum up to SHIFTED_SUM_MAX_TAPS taps, else
    causal_conv.

    u: [B, T, C]; weight: [C, k] (weight[:, k-1] multiplies the current input); history: [B, k-1, C], or None for
    zeros (a sequence's start) -> [B, T, C]. Without a history the long branch convolves the T positions alone;
    with one it convolves all T + k - 1 and keeps the last T.
    """
    k = weight.shape[1]
    if k <= SHIFTED_SUM_MAX_TAPS:
        if history is None:
            history = u.new_zeros(u.shape[0], k - 1, u.shape[2])
        return depthwise_causal_conv(u, weight, history)
    h = weight.flip(1).T  # [k, C]: h[lag] = weight[:, k-1-lag]
    if history is None:
        return causal_conv(u, h)
    u_full = torch.cat([history.to(u.dtype), u], dim=1)  # [B, T + k - 1, C]
    return causal_conv(u_full, h)[:, k - 1 :]
