"""RWKV-4's WKV in Triton, forward and backward: one program per (sequence, block of BD channels) walks the T
tokens carrying the stable state (a, b, p) of `naive.wkv4_step` in fp32 registers, one launch per direction.
The forward stores the state entering every token ([B, T, 3, d] fp32) when a gradient will follow; the backward
walks the tokens in reverse with the gradient of the state after each token and reads the state before it.
dw and du are summed over sequences from per-program partials (no atomics: deterministic). README.md derives
the backward; the specification is `naive.wkv4_naive`.

The two directions are custom ops (`zoo_rwkv4::wkv_fwd`, `zoo_rwkv4::wkv_bwd`) with fake implementations and
autograd, so torch.compile and CUDA graphs run these kernels too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, check_devices, grad_needed, launch, next_power_of_2
from kernels.rwkv4.naive import NO_TOKEN, State
from kernels.vmap import channels_as_members, members_as_channels, members_first

_NO_TOKEN = tl.constexpr(NO_TOKEN)


@triton.jit
def _fwd_kernel(k, v, w, u, a0, b0, p0, y, s, aT, bT, pT, T, D: tl.constexpr, BD: tl.constexpr,
                USE_STATE: tl.constexpr, SAVE: tl.constexpr):
    i_b, i_d = tl.program_id(0), tl.program_id(1)
    offs = i_d * BD + tl.arange(0, BD)
    mask = offs < D
    ww = tl.load(w + offs, mask=mask, other=0.0)
    uu = tl.load(u + offs, mask=mask, other=0.0)
    seq = i_b.to(tl.int64) * D + offs  # this program's channels of a [B, D] state
    if USE_STATE:
        a = tl.load(a0 + seq, mask=mask, other=0.0)
        b = tl.load(b0 + seq, mask=mask, other=0.0)
        p = tl.load(p0 + seq, mask=mask, other=0.0)
    else:
        a = tl.zeros([BD], dtype=tl.float32)
        b = tl.zeros([BD], dtype=tl.float32)
        p = tl.full([BD], _NO_TOKEN, dtype=tl.float32)
    for t in range(T):
        row = i_b.to(tl.int64) * T + t
        kt = tl.load(k + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        vt = tl.load(v + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        if SAVE:
            tl.store(s + row * 3 * D + offs, a, mask=mask)
            tl.store(s + row * 3 * D + D + offs, b, mask=mask)
            tl.store(s + row * 3 * D + 2 * D + offs, p, mask=mask)
        now = uu + kt
        m = tl.maximum(p, now)
        e_old, e_now = tl.exp(p - m), tl.exp(now - m)
        tl.store(y + row * D + offs, (e_old * a + e_now * vt) / (e_old * b + e_now), mask=mask)
        decayed = p + ww
        q = tl.maximum(decayed, kt)
        e_old, e_new = tl.exp(decayed - q), tl.exp(kt - q)
        a = e_old * a + e_new * vt
        b = e_old * b + e_new
        p = q
    tl.store(aT + seq, a, mask=mask)
    tl.store(bT + seq, b, mask=mask)
    tl.store(pT + seq, p, mask=mask)


@triton.jit
def _bwd_kernel(k, v, w, u, s, aT, bT, pT, gy, gaT, gbT, gpT, gk, gv, gw, gu, ga0, gb0, gp0, T,
                D: tl.constexpr, BD: tl.constexpr, USE_DSTATE: tl.constexpr):
    """Reverse walk (README.md): (ga, gb, gp) is dL/d(state after token t); per token the output's and the
    update's local derivatives give dk_t, dv_t, the token's share of dw and du, and dL/d(state before t)."""
    i_b, i_d = tl.program_id(0), tl.program_id(1)
    offs = i_d * BD + tl.arange(0, BD)
    mask = offs < D
    ww = tl.load(w + offs, mask=mask, other=0.0)
    uu = tl.load(u + offs, mask=mask, other=0.0)
    seq = i_b.to(tl.int64) * D + offs
    a1 = tl.load(aT + seq, mask=mask, other=0.0)  # the state after the token (the final one first)
    b1 = tl.load(bT + seq, mask=mask, other=0.0)
    p1 = tl.load(pT + seq, mask=mask, other=0.0)
    if USE_DSTATE:
        ga = tl.load(gaT + seq, mask=mask, other=0.0)
        gb = tl.load(gbT + seq, mask=mask, other=0.0)
        gp = tl.load(gpT + seq, mask=mask, other=0.0)
    else:
        ga = tl.zeros([BD], dtype=tl.float32)
        gb = tl.zeros([BD], dtype=tl.float32)
        gp = tl.zeros([BD], dtype=tl.float32)
    dw = tl.zeros([BD], dtype=tl.float32)
    du = tl.zeros([BD], dtype=tl.float32)
    for i in range(T):
        row = i_b.to(tl.int64) * T + (T - 1 - i)
        kt = tl.load(k + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        vt = tl.load(v + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        gt = tl.load(gy + row * D + offs, mask=mask, other=0.0)
        a = tl.load(s + row * 3 * D + offs, mask=mask, other=0.0)
        b = tl.load(s + row * 3 * D + D + offs, mask=mask, other=0.0)
        p = tl.load(s + row * 3 * D + 2 * D + offs, mask=mask, other=0.0)
        # The output (e_old·a + e_now·v) / den does not depend on the max m, so m is a constant here.
        now = uu + kt
        m = tl.maximum(p, now)
        e_old, e_now = tl.exp(p - m), tl.exp(now - m)
        den = e_old * b + e_now
        yt = (e_old * a + e_now * vt) / den
        g = gt / den
        g_now = g * e_now * (vt - yt)  # dL/d(u + k_t) through the output
        # The update: a1 = E1·a + E2·v, b1 = E1·b + E2, p1 = q = max(p + w, k), exactly as the forward computed it.
        decayed = p + ww
        e1, e2 = tl.exp(decayed - p1), tl.exp(kt - p1)
        gq = gp - ga * a1 - gb * b1  # q is both the new p and the scale of a1, b1
        to_decayed = tl.where(decayed > kt, gq, tl.where(decayed == kt, 0.5 * gq, 0.0))  # torch.maximum's rule
        g_decayed = e1 * (ga * a + gb * b) + to_decayed
        tl.store(gk + row * D + offs, e2 * (ga * vt + gb) + (gq - to_decayed) + g_now, mask=mask)
        tl.store(gv + row * D + offs, ga * e2 + g * e_now, mask=mask)
        dw += g_decayed
        du += g_now
        gp = g_decayed + g * e_old * (a - yt * b)
        ga = ga * e1 + g * e_old
        gb = gb * e1 - g * e_old * yt
        a1, b1, p1 = a, b, p
    tl.store(gw + seq, dw, mask=mask)
    tl.store(gu + seq, du, mask=mask)
    tl.store(ga0 + seq, ga, mask=mask)
    tl.store(gb0 + seq, gb, mask=mask)
    tl.store(gp0 + seq, gp, mask=mask)


def _blocks(D: int) -> tuple[int, int]:
    """(channels per program, warps): one channel per thread, at most 64 channels a program."""
    BD = max(16, min(64, next_power_of_2(D)))
    return BD, max(1, BD // 32)


@torch.library.custom_op("zoo_rwkv4::wkv_fwd", mutates_args=())
def _fwd_op(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor, a0: torch.Tensor | None,
            b0: torch.Tensor | None, p0: torch.Tensor | None, save: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, D = k.shape
    f32 = dict(device=k.device, dtype=torch.float32)
    y = torch.empty(B, T, D, **f32)
    s = torch.empty(B, T, 3, D, **f32) if save else torch.empty(0, **f32)
    aT, bT, pT = (torch.empty(B, D, **f32) for _ in range(3))
    BD, warps = _blocks(D)
    launch(_fwd_kernel, (B, cdiv(D, BD)), k, v, w, u, a0, b0, p0, y, s, aT, bT, pT, T, D=D, BD=BD,
           USE_STATE=a0 is not None, SAVE=save, num_warps=warps)
    return y, s, aT, bT, pT


@_fwd_op.register_fake
def _fwd_fake(k, v, w, u, a0, b0, p0, save):
    B, T, D = k.shape
    f32 = dict(device=k.device, dtype=torch.float32)
    s = torch.empty(B, T, 3, D, **f32) if save else torch.empty(0, **f32)
    return torch.empty(B, T, D, **f32), s, *(torch.empty(B, D, **f32) for _ in range(3))


@torch.library.custom_op("zoo_rwkv4::wkv_bwd", mutates_args=())
def _bwd_op(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor, s: torch.Tensor, aT: torch.Tensor,
            bT: torch.Tensor, pT: torch.Tensor, gy: torch.Tensor, gaT: torch.Tensor | None, gbT: torch.Tensor | None,
            gpT: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor, torch.Tensor]:
    B, T, D = k.shape
    f32 = dict(device=k.device, dtype=torch.float32)
    gk, gv = torch.empty_like(k), torch.empty_like(v)
    gw, gu, ga0, gb0, gp0 = (torch.empty(B, D, **f32) for _ in range(5))  # gw, gu: one row per sequence
    BD, warps = _blocks(D)
    launch(_bwd_kernel, (B, cdiv(D, BD)), k, v, w, u, s, aT, bT, pT, gy, gaT, gbT, gpT, gk, gv, gw, gu, ga0, gb0,
           gp0, T, D=D, BD=BD, USE_DSTATE=gaT is not None, num_warps=warps)
    return gk, gv, gw.sum(0), gu.sum(0), ga0, gb0, gp0


@_bwd_op.register_fake
def _bwd_fake(k, v, w, u, s, aT, bT, pT, gy, gaT, gbT, gpT):
    return torch.empty_like(k), torch.empty_like(v), torch.empty_like(w), torch.empty_like(u), *(
        torch.empty_like(aT) for _ in range(3))


def _setup(ctx, inputs, output):
    k, v, w, u, a0, _, _, save = inputs
    _, s, aT, bT, pT = output
    ctx.save_for_backward(k, v, w, u, s, aT, bT, pT)
    ctx.has_state, ctx.kept_states = a0 is not None, save


def _grad(ctx, gy, _gs, gaT, gbT, gpT):
    if not ctx.kept_states:
        raise RuntimeError("wkv4: the forward ran without a gradient in view and kept no states for a backward")
    k, v, w, u, s, aT, bT, pT = ctx.saved_tensors
    gy = torch.zeros(k.shape, device=k.device, dtype=torch.float32) if gy is None else gy.float().contiguous()
    final = [gaT, gbT, gpT]
    if all(g is None for g in final):
        final = [None] * 3
    else:
        final = [torch.zeros_like(aT) if g is None else g.float().contiguous() for g in final]
    gk, gv, gw, gu, ga0, gb0, gp0 = torch.ops.zoo_rwkv4.wkv_bwd(k, v, w, u, s, aT, bT, pT, gy, *final)
    initial = (ga0, gb0, gp0) if ctx.has_state else (None, None, None)
    return gk, gv, gw, gu, *initial, None


_fwd_op.register_autograd(_grad, setup_context=_setup)


@_fwd_op.register_vmap
def _fwd_vmap(info, in_dims, k, v, w, u, a0, b0, p0, save):
    """Members side by side as channels (every channel's recurrence is its own): one launch for the whole pack."""
    n = info.batch_size
    k, v, w, u, a0, b0, p0 = (members_as_channels(members_first(n, t, dim))
                              for t, dim in zip((k, v, w, u, a0, b0, p0), in_dims))
    save = save or grad_needed(k, v, w, u, a0, b0, p0)  # the caller saw batched tensors (see grad_needed)
    y, s, aT, bT, pT = torch.ops.zoo_rwkv4.wkv_fwd(k, v, w, u, a0, b0, p0, save)
    s = channels_as_members(s, n) if save else s  # [N, B, T, 3, d], or the empty placeholder
    return (channels_as_members(y, n), s, *(channels_as_members(x, n) for x in (aT, bT, pT))), (
        0, 0 if save else None, 0, 0, 0)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def wkv4(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
         state: State | None = None) -> tuple[torch.Tensor, State]:
    """RWKV-4's WKV (naive.py has the math). k, v: [B, T, d] in fp32, fp16 or bf16; w (the decay, < 0), u (the
    bonus): [d]; state: (a, b, p) [B, d] to continue from, or None (no token yet). Computes in fp32 and returns
    (wkv [B, T, d] fp32, the final state (a, b, p) [B, d] fp32); gradients reach k, v, w, u and the state."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"wkv4: k and v must both be [B, T, d], got {list(k.shape)} and {list(v.shape)}")
    B, _, d = k.shape
    if w.shape != (d,) or u.shape != (d,):
        raise ValueError(f"wkv4: w and u must be [d] = [{d}], got {list(w.shape)} and {list(u.shape)}")
    if state is not None and (len(state) != 3 or any(x.shape != (B, d) for x in state)):
        raise ValueError(f"wkv4: state must be (a, b, p), each [B, d] = [{B}, {d}]")
    if k.dtype not in _DTYPES or v.dtype not in _DTYPES:
        raise TypeError(f"wkv4 computes in fp32 from fp32/fp16/bf16 inputs, got {k.dtype}, {v.dtype}; "
                        "kernels/rwkv4/naive.py runs any dtype")
    state = () if state is None else tuple(state)
    check_devices("wkv4", k, v, w, u, *state)
    save = grad_needed(k, v, w, u, *state)
    a0, b0, p0 = (x.float().contiguous() for x in state) if state else (None, None, None)
    y, _, aT, bT, pT = _fwd_op(k.contiguous(), v.contiguous(), w.float().contiguous(), u.float().contiguous(), a0,
                               b0, p0, save)
    return y, (aT, bT, pT)
