"""One decoding step of BaseConv's gated short convolution, in one launch:

    y = SiLU(bias + w_{k-1}·u_t + Σ_{i<k-1} w_i·h_i) ⊙ g_t,    h ← (h_1, ..., h_{k-2}, u_t)

where u_t, g_t are the two halves of the input projection and h the last k−1 conv inputs. One program per
(sequence, block of channels) reads u, g and the history once, writes the shifted history and y. The PyTorch step
(zoo/models/mixers/base_conv.py) runs the same math as seven elementwise kernels a layer over [B, channels]
(the multiply-adds, the history shift, SiLU and the gate), each a full pass over memory. The kernel rounds to the
activations' dtype after each multiply-add, SiLU and the gate, where the PyTorch step's ops round, so both paths
give the same values in every dtype, up to how each computes exp.
"""

import torch
import triton
import triton.language as tl

from kernels.launch import check_devices, launch, next_power_of_2


@triton.jit
def _conv_decode_kernel(ug, history, weight, bias, out, C, K: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = c < C
    dt = out.dtype.element_ty
    u = tl.load(ug + b * 2 * C + c, mask=m, other=0.0)
    g = tl.load(ug + b * 2 * C + C + c, mask=m, other=0.0).to(tl.float32)
    # the weights in the activations' dtype, as the PyTorch step casts them
    w = tl.load(weight + c * K + (K - 1), mask=m, other=0.0).to(dt).to(tl.float32)
    acc = (tl.load(bias + c, mask=m, other=0.0).to(dt).to(tl.float32) + u.to(tl.float32) * w).to(dt)
    hist = history + b * (K - 1) * C
    for i in tl.static_range(K - 1):
        h = tl.load(hist + i * C + c, mask=m, other=0.0)
        if i > 0:  # the shift, from the value just read: slot i - 1 was read in the previous iteration
            tl.store(hist + (i - 1) * C + c, h, mask=m)
        w = tl.load(weight + c * K + i, mask=m, other=0.0).to(dt).to(tl.float32)
        acc = (acc.to(tl.float32) + h.to(dt).to(tl.float32) * w).to(dt)
    if K > 1:
        tl.store(hist + (K - 2) * C + c, u.to(history.dtype.element_ty), mask=m)
    a = acc.to(tl.float32)
    y = (a / (1.0 + tl.exp(-a))).to(dt)  # SiLU, rounded as F.silu rounds
    tl.store(out + b * C + c, (y.to(tl.float32) * g).to(dt), mask=m)


def conv_decode(ug: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """ug: [B, 2·C] (u then g, one token's input projection), history: [B, k−1, C] contiguous (the last k−1 conv
    inputs, oldest first), weight: [C, 1, k] or [C, k] (the depthwise conv's), bias: [C] -> y [B, C] in ug's dtype.
    Shifts the history in place and appends u."""
    B, C2 = ug.shape
    C = C2 // 2
    k = weight.shape[-1]
    weight = weight.reshape(weight.shape[0], -1)
    if C2 != 2 * C or weight.shape != (C, k) or bias.shape != (C,) or history.shape != (B, k - 1, C):
        raise ValueError(f"conv_decode: ug must be [B, 2·C], history [B, k−1, C], weight [C, k] and bias [C], got "
                         f"{tuple(ug.shape)}, {tuple(history.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}")
    if not history.is_contiguous():
        raise ValueError("conv_decode: the history must be contiguous (it is updated in place)")
    check_devices("conv_decode", ug, history, weight, bias)
    out = torch.empty(B, C, device=ug.device, dtype=ug.dtype)
    BC = min(1024, next_power_of_2(C))
    launch(_conv_decode_kernel, (B, triton.cdiv(C, BC)), ug.contiguous(), history, weight.contiguous(),
           bias.contiguous(), out, C, K=k, BC=BC, num_warps=4)
    return out
