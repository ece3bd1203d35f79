"""One decoding step of rotary sliding-window attention over a ring buffer, in one launch:

    q, k ← rotary(q, k) at position pos;  ring[pos mod w] ← (k, v);  o = softmax(q·Kᵀ/√D over the live slots) V

One program per (batch, head): it rotates its head's q and k, writes k and v into the ring slot of `pos`, and reads
the whole ring once (the new token's row from registers, so no barrier orders the store before the loads). The
rotary cosines and sines come in from the caller, computed by PyTorch as the PyTorch step computes them. The
PyTorch step runs the same math as about 56 kernels a layer (rotary's elementwise ops, the ring writes, the mask
and SDPA's own), each reading or writing a few KB, which is what keeps a large-batch decode step off the memory
roofline. `pos` and `start` are read on the device, so the step can be captured in a CUDA graph; the caller
advances `pos` after it.
"""

import torch
import triton
import triton.language as tl

from kernels.launch import check_devices, launch, next_power_of_2


@triton.jit
def _window_decode_kernel(qkv, ring_k, ring_v, pos_ptr, start, cos_ptr, sin_ptr, out, sm_scale,
                          H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                          BD2: tl.constexpr, HAS_START: tl.constexpr):
    i_bh = tl.program_id(0)
    b = i_bh // H
    h = i_bh % H
    half: tl.constexpr = D // 2
    d = tl.arange(0, BD2)
    m_d = d < half
    pos = tl.load(pos_ptr)  # int64
    cos = tl.load(cos_ptr + d, mask=m_d, other=0.0)  # [BD2] rotary at pos
    sin = tl.load(sin_ptr + d, mask=m_d, other=0.0)
    row = qkv + b.to(tl.int64) * 3 * H * D + h * D  # q at [0, H·D), k at [H·D, 2·H·D), v after
    dt = qkv.dtype.element_ty
    q1 = tl.load(row + d, mask=m_d, other=0.0).to(tl.float32)
    q2 = tl.load(row + half + d, mask=m_d, other=0.0).to(tl.float32)
    k1 = tl.load(row + H * D + d, mask=m_d, other=0.0).to(tl.float32)
    k2 = tl.load(row + H * D + half + d, mask=m_d, other=0.0).to(tl.float32)
    v1 = tl.load(row + 2 * H * D + d, mask=m_d, other=0.0)
    v2 = tl.load(row + 2 * H * D + half + d, mask=m_d, other=0.0)
    # rotated, then rounded to the activations' dtype, as the PyTorch step's apply_rotary returns them
    rq1 = (q1 * cos - q2 * sin).to(dt).to(tl.float32)
    rq2 = (q2 * cos + q1 * sin).to(dt).to(tl.float32)
    rk1 = (k1 * cos - k2 * sin).to(dt)
    rk2 = (k2 * cos + k1 * sin).to(dt)

    slot = pos % W
    rdt = ring_k.dtype.element_ty
    base = b.to(tl.int64) * W * H * D + h * D
    new_row = base + slot * H * D
    tl.store(ring_k + new_row + d, rk1.to(rdt), mask=m_d)
    tl.store(ring_k + new_row + half + d, rk2.to(rdt), mask=m_d)
    tl.store(ring_v + new_row + d, v1.to(rdt), mask=m_d)
    tl.store(ring_v + new_row + half + d, v2.to(rdt), mask=m_d)

    s = tl.arange(0, BW)
    slot_pos = pos - ((pos - s) % W + W) % W  # the latest position ≤ pos held in slot s
    live = (s < W) & (slot_pos >= 0)
    if HAS_START:
        live = live & (slot_pos >= tl.load(start + b))
    is_new = (s == slot)[:, None]
    offs = base + s[:, None] * H * D + d[None, :]  # [BW, BD2]
    m = live[:, None] & m_d[None, :]
    # the ring as the PyTorch step reads it: in the activations' dtype
    kr1 = tl.where(is_new, rk1.to(rdt)[None, :], tl.load(ring_k + offs, mask=m, other=0.0)).to(dt).to(tl.float32)
    kr2 = tl.where(is_new, rk2.to(rdt)[None, :], tl.load(ring_k + offs + half, mask=m, other=0.0))
    kr2 = kr2.to(dt).to(tl.float32)
    scores = (tl.sum(kr1 * rq1[None, :], 1) + tl.sum(kr2 * rq2[None, :], 1)) * sm_scale  # [BW]
    scores = tl.where(live, scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, 0))
    p = tl.where(live, p, 0.0)
    p = p / tl.sum(p, 0)
    vr1 = tl.where(is_new, v1.to(rdt)[None, :], tl.load(ring_v + offs, mask=m, other=0.0)).to(dt).to(tl.float32)
    vr2 = tl.where(is_new, v2.to(rdt)[None, :], tl.load(ring_v + offs + half, mask=m, other=0.0))
    vr2 = vr2.to(dt).to(tl.float32)
    o_row = out + b.to(tl.int64) * H * D + h * D
    tl.store(o_row + d, tl.sum(p[:, None] * vr1, 0).to(out.dtype.element_ty), mask=m_d)
    tl.store(o_row + half + d, tl.sum(p[:, None] * vr2, 0).to(out.dtype.element_ty), mask=m_d)


def window_decode(qkv: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, pos: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [B, 3·H·D] (q, k, v of one token, heads side by side in each), ring_k, ring_v: [B, W, H, D]
    contiguous, pos: [] int64 (the token's position; not advanced here), cos, sin: [D/2] fp32, the rotary
    angles' cosines and sines at pos (computed by the caller as `apply_rotary` computes them, so both paths
    rotate alike), start: [B] int64 or None (the first position each row may attend to) -> o [B, H·D] in qkv's
    dtype. Writes the rotated k and v into slot pos mod W of the rings."""
    B, W, H, D = ring_k.shape
    if qkv.shape != (B, 3 * H * D) or ring_v.shape != ring_k.shape or D % 2:
        raise ValueError(f"window_decode: qkv must be [B, 3·H·D] and the rings [B, W, H, D] with D even, got "
                         f"{tuple(qkv.shape)}, {tuple(ring_k.shape)}, {tuple(ring_v.shape)}")
    if not (ring_k.is_contiguous() and ring_v.is_contiguous()) or pos.dtype != torch.int64 or pos.dim() != 0:
        raise ValueError("window_decode: the rings must be contiguous and pos a 0-dim int64 tensor")
    if cos.shape != (D // 2,) or sin.shape != (D // 2,) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"window_decode: cos and sin must be [D/2] = [{D // 2}] fp32 tensors")
    check_devices("window_decode", qkv, ring_k, ring_v, pos, cos, sin, start)
    qkv = qkv.contiguous()
    out = torch.empty(B, H * D, device=qkv.device, dtype=qkv.dtype)
    launch(_window_decode_kernel, (B * H,), qkv, ring_k, ring_v, pos, pos if start is None else start,
           cos.contiguous(), sin.contiguous(), out, D**-0.5, H=H, D=D, W=W, BW=next_power_of_2(W),
           BD2=next_power_of_2(D // 2), HAS_START=start is not None, num_warps=4)
    return out
