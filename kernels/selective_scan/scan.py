"""Mamba's selective scan in Triton: one program per (sequence, block of BD channels) walks the T tokens with
its [BD, N] state in registers, in one launch (the PyTorch loop launches ~6 kernels per token forward and twice
that backward). When a backward is to come, the forward stores the state at the start of every chunk of `chunk`
tokens (fp32, [B, ⌈T/chunk⌉, D, N]); the backward walks the chunks in reverse, recomputes each chunk's states from
its start into a per-program scratch of `chunk` tiles, and walks those tokens in reverse carrying dL/dh. Every
h_t kept instead would be [B, T, D, N] fp32: 16 GiB a layer for a pack of 4 at B = 256, T = 256, d_inner =
1,024. dB and dC are reduced over channel blocks and dA over sequences from per-program partial
sums (no atomics: deterministic). Both directions are `torch.library` custom ops with fake impls, so
torch.compile and CUDA graphs call the same kernels as eager code, and the forward has a vmap rule, so packed runs
(zoo/steps.py) call them once per pack. Specification: `naive.selective_scan_naive`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, grad_needed, launch, next_power_of_2
from kernels.vmap import members_first


@triton.jit
def _tile(i_d, D: tl.constexpr, N: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """A program's channel and state offsets, their masks, and the [BD, BN] offsets into a [D, N] tensor."""
    offs_d = i_d * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    m_d, m_n = offs_d < D, offs_n < N
    return offs_d, offs_n, m_d, m_n, m_d[:, None] & m_n[None, :], offs_d[:, None] * N + offs_n[None, :]


@triton.jit
def _token(u, dt, Bm, Cm, row, offs_d, offs_n, m_d, m_n, D: tl.constexpr, N: tl.constexpr):
    """One token's u, Δ (this program's channels) and B, C, in fp32."""
    ut = tl.load(u + row * D + offs_d, mask=m_d, other=0.0).to(tl.float32)
    dtt = tl.load(dt + row * D + offs_d, mask=m_d, other=0.0).to(tl.float32)
    bt = tl.load(Bm + row * N + offs_n, mask=m_n, other=0.0).to(tl.float32)
    ct = tl.load(Cm + row * N + offs_n, mask=m_n, other=0.0).to(tl.float32)
    return ut, dtt, bt, ct


@triton.jit
def _fwd_kernel(u, dt, A, Bm, Cm, h0, y, ck, hT, T, BPG, NC, D: tl.constexpr, N: tl.constexpr, BD: tl.constexpr,
                BN: tl.constexpr, CHUNK: tl.constexpr, USE_H0: tl.constexpr, SAVE: tl.constexpr):
    """BPG: sequences per A (A is [B / BPG, D, N]: a vmapped pack's members each have their own). With SAVE, ck
    [B, NC, D, N] gets the state before tokens 0, CHUNK, 2·CHUNK, …"""
    i_b, i_d = tl.program_id(0), tl.program_id(1)
    offs_d, offs_n, m_d, m_n, m_dn, dn = _tile(i_d, D, N, BD, BN)
    a = tl.load(A + (i_b // BPG).to(tl.int64) * D * N + dn, mask=m_dn, other=0.0).to(tl.float32)
    if USE_H0:
        h = tl.load(h0 + i_b.to(tl.int64) * D * N + dn, mask=m_dn, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BD, BN], dtype=tl.float32)
    for t in range(T):
        if SAVE:
            if t % CHUNK == 0:
                tl.store(ck + (i_b.to(tl.int64) * NC + t // CHUNK) * D * N + dn, h, mask=m_dn)
        row = i_b.to(tl.int64) * T + t
        ut, dtt, bt, ct = _token(u, dt, Bm, Cm, row, offs_d, offs_n, m_d, m_n, D, N)
        h = tl.exp(dtt[:, None] * a) * h + (dtt * ut)[:, None] * bt[None, :]
        tl.store(y + row * D + offs_d, tl.sum(h * ct[None, :], 1), mask=m_d)
    tl.store(hT + i_b.to(tl.int64) * D * N + dn, h, mask=m_dn)


@triton.jit
def _bwd_kernel(u, dt, A, Bm, Cm, ck, scratch, dy, dhT, du, ddt, dA, dB, dC, dh0, T, B, BPG, NC, NDB,
                D: tl.constexpr, N: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
                USE_DHT: tl.constexpr):
    """Reverse walk, one chunk at a time: the chunk's states h_t are recomputed from its start (ck) into this
    program's CHUNK scratch tiles, then its tokens are walked in reverse. dh holds dL/dh_t; per token:
    dC_t = Σ_d dy_t h_t, dB_t = Σ_d dh (Δu), du, dΔ, and dA += dh ⊙ h_{t-1} ⊙ decay ⊙ Δ; then dh ← dh ⊙ decay
    flows to h_{t-1}. dB, dC: partial over channel blocks [NDB, B, T, N]; dA: partial over sequences [B, D, N]."""
    i_b, i_d = tl.program_id(0), tl.program_id(1)
    offs_d, offs_n, m_d, m_n, m_dn, dn = _tile(i_d, D, N, BD, BN)
    state = i_b.to(tl.int64) * D * N + dn
    a = tl.load(A + (i_b // BPG).to(tl.int64) * D * N + dn, mask=m_dn, other=0.0).to(tl.float32)
    if USE_DHT:
        dh = tl.load(dhT + state, mask=m_dn, other=0.0).to(tl.float32)
    else:
        dh = tl.zeros([BD, BN], dtype=tl.float32)
    da = tl.zeros([BD, BN], dtype=tl.float32)
    part = (i_d.to(tl.int64) * B + i_b) * T  # row offset of this program's partial dB, dC
    tile = tl.arange(0, BD)[:, None] * BN + tl.arange(0, BN)[None, :]  # a [BD, BN] tile of the scratch
    slot = (i_b.to(tl.int64) * NDB + i_d) * CHUNK * BD * BN  # this program's CHUNK tiles
    for ic in range(NC):
        c = NC - 1 - ic
        start = tl.load(ck + (i_b.to(tl.int64) * NC + c) * D * N + dn, mask=m_dn, other=0.0)  # h before the chunk
        t0 = c * CHUNK
        n = tl.minimum(T - t0, CHUNK)
        h = start
        for j in range(n):
            row = i_b.to(tl.int64) * T + t0 + j
            ut, dtt, bt, ct = _token(u, dt, Bm, Cm, row, offs_d, offs_n, m_d, m_n, D, N)
            h = tl.exp(dtt[:, None] * a) * h + (dtt * ut)[:, None] * bt[None, :]
            tl.store(scratch + slot + j * BD * BN + tile, h)
        tl.debug_barrier()  # the tiles, written by the whole program, are read back by it
        # h_t of the chunk's last token; after that, each token's h_{t-1} is the h_t of the one before it
        ht = tl.load(scratch + slot + (n - 1) * BD * BN + tile)
        for jj in range(n):
            j = n - 1 - jj
            t = t0 + j
            row = i_b.to(tl.int64) * T + t
            ut, dtt, bt, ct = _token(u, dt, Bm, Cm, row, offs_d, offs_n, m_d, m_n, D, N)
            dyt = tl.load(dy + row * D + offs_d, mask=m_d, other=0.0).to(tl.float32)
            later = (tl.zeros([BD, BN], dtype=tl.int32) + j) > 0  # h_{t-1} is in the scratch, else the chunk's start
            prev = tl.load(scratch + slot + (j - 1) * BD * BN + tile, mask=later, other=0.0)
            prev = tl.where(later, prev, start)
            tl.store(dC + (part + t) * N + offs_n, tl.sum(tl.where(m_dn, dyt[:, None] * ht, 0.0), 0), mask=m_n)
            dh += dyt[:, None] * ct[None, :]
            decay = tl.exp(dtt[:, None] * a)
            g = dh * prev * decay  # dL/d(Δ·A) elementwise
            dbu = tl.sum(dh * bt[None, :], 1)  # dL/d(Δ·u)
            tl.store(du + row * D + offs_d, dbu * dtt, mask=m_d)
            tl.store(ddt + row * D + offs_d, tl.sum(g * a, 1) + dbu * ut, mask=m_d)
            tl.store(dB + (part + t) * N + offs_n, tl.sum(dh * (dtt * ut)[:, None], 0), mask=m_n)
            da += g * dtt[:, None]
            dh = dh * decay
            ht = prev
        tl.debug_barrier()  # the next chunk overwrites the tiles read above
    tl.store(dA + state, da, mask=m_dn)
    tl.store(dh0 + state, dh, mask=m_dn)


def _groups(A: torch.Tensor) -> int:
    """How many A's the ops get: A [D, N] serves every sequence; A [G, D, N] (a vmapped pack, `_fwd_vmap`) gives
    each of G equal runs of sequences its own."""
    return A.shape[0] if A.dim() == 3 else 1


def _blocks(D: int, N: int) -> tuple[int, int]:
    BN = next_power_of_2(N)
    BD = max(1, min(next_power_of_2(D), 4096 // BN, 64))  # [BD, BN] fp32 tiles: ≤ 4K elements each
    return BD, BN


# Tokens per chunk of the backward's recompute: the forward stores one state per chunk ([B, ⌈T/16⌉, D, N] fp32),
# the backward a scratch of 16 [BD, BN] tiles per program (a sixteenth of every h_t at T = 256 either way).
CHUNK = 16


def _saved_states(Bsz: int, T: int, D: int, N: int, chunk: int, save: bool, **f32) -> torch.Tensor:
    """The chunks' start states the forward keeps for the backward: [B, ⌈T/chunk⌉, D, N], or empty without one."""
    return torch.empty(Bsz, cdiv(T, chunk), D, N, **f32) if save else torch.empty(0, **f32)


@torch.library.custom_op("zoo_selective_scan::fwd", mutates_args=())
def _fwd_op(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
            h0: torch.Tensor | None, save: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> y [B, T, D] fp32, the chunks' start states [B, ⌈T/chunk⌉, D, N] fp32 (empty unless `save`), h_T [B, D, N]
    fp32."""
    Bsz, T, D = u.shape
    N = A.shape[-1]
    BD, BN = _blocks(D, N)
    f32 = dict(device=u.device, dtype=torch.float32)
    y = torch.empty(Bsz, T, D, **f32)
    ck = _saved_states(Bsz, T, D, N, chunk, save, **f32)
    hT = torch.empty(Bsz, D, N, **f32)
    launch(_fwd_kernel, (Bsz, cdiv(D, BD)), u, dt, A, Bm, Cm, h0, y, ck, hT, T, Bsz // _groups(A), cdiv(T, chunk),
           D=D, N=N, BD=BD, BN=BN, CHUNK=chunk, USE_H0=h0 is not None, SAVE=save)
    return y, ck, hT


@_fwd_op.register_fake
def _fwd_fake(u, dt, A, Bm, Cm, h0, save, chunk):
    Bsz, T, D = u.shape
    N = A.shape[-1]
    f32 = dict(device=u.device, dtype=torch.float32)
    return torch.empty(Bsz, T, D, **f32), _saved_states(Bsz, T, D, N, chunk, save, **f32), torch.empty(Bsz, D, N, **f32)


@torch.library.custom_op("zoo_selective_scan::bwd", mutates_args=())
def _bwd_op(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
            ck: torch.Tensor, dy: torch.Tensor, dhT: torch.Tensor | None, chunk: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ck: the forward's chunk start states (h0 or zeros first) -> du, ddt [B, T, D], dA (A's shape), dB, dC
    [B, T, N] and dh0 [B, D, N], all fp32."""
    Bsz, T, D = u.shape
    N = A.shape[-1]
    BD, BN = _blocks(D, N)
    NDB = cdiv(D, BD)
    f32 = dict(device=u.device, dtype=torch.float32)
    du, ddt = torch.empty(Bsz, T, D, **f32), torch.empty(Bsz, T, D, **f32)
    dA = torch.empty(Bsz, D, N, **f32)
    dB, dC = torch.empty(NDB, Bsz, T, N, **f32), torch.empty(NDB, Bsz, T, N, **f32)
    dh0 = torch.empty(Bsz, D, N, **f32)
    scratch = torch.empty(Bsz * NDB * chunk * BD * BN, **f32)  # each program's recomputed chunk
    G = _groups(A)
    launch(_bwd_kernel, (Bsz, NDB), u, dt, A, Bm, Cm, ck, scratch, dy, dhT, du, ddt, dA, dB, dC, dh0, T, Bsz,
           Bsz // G, cdiv(T, chunk), NDB, D=D, N=N, BD=BD, BN=BN, CHUNK=chunk, USE_DHT=dhT is not None)
    return du, ddt, dA.view(G, Bsz // G, D, N).sum(1).view(A.shape), dB.sum(0), dC.sum(0), dh0


@_bwd_op.register_fake
def _bwd_fake(u, dt, A, Bm, Cm, ck, dy, dhT, chunk):
    Bsz, T, D = u.shape
    N = A.shape[-1]
    f32 = dict(device=u.device, dtype=torch.float32)
    return (torch.empty(Bsz, T, D, **f32), torch.empty(Bsz, T, D, **f32), torch.empty(A.shape, **f32),
            torch.empty(Bsz, T, N, **f32), torch.empty(Bsz, T, N, **f32), torch.empty(Bsz, D, N, **f32))


def _setup(ctx, inputs, output):
    u, dt, A, Bm, Cm, h0, save, chunk = inputs
    ctx.save_for_backward(u, dt, A, Bm, Cm, output[1])
    ctx.kept_states, ctx.chunk, ctx.has_h0 = save, chunk, h0 is not None


def _grad(ctx, dy, _dck, dhT):
    if not ctx.kept_states:
        raise RuntimeError("selective_scan: the forward ran without a gradient in view and kept no states")
    u, dt, A, Bm, Cm, ck = ctx.saved_tensors
    dy = torch.zeros(u.shape, device=u.device, dtype=torch.float32) if dy is None else dy.float().contiguous()
    dhT = None if dhT is None else dhT.float().contiguous()
    du, ddt, dA, dB, dC, dh0 = torch.ops.zoo_selective_scan.bwd(u, dt, A, Bm, Cm, ck, dy, dhT, ctx.chunk)
    return (du.to(u.dtype), ddt.to(dt.dtype), dA.to(A.dtype), dB.to(Bm.dtype), dC.to(Cm.dtype),
            dh0 if ctx.has_h0 else None, None, None)


# A custom op, so that torch.compile and CUDA graphs call these kernels as opaque ops, as eager code does.
_fwd_op.register_autograd(_grad, setup_context=_setup)


@_fwd_op.register_vmap
def _fwd_vmap(info, in_dims, u, dt, A, Bm, Cm, h0, save, chunk):
    """The members' sequences one after another (member m's are m·B … (m+1)·B - 1), each member with its own A:
    one launch for the whole pack."""
    n = info.batch_size
    u, dt, Bm, Cm, h0 = (None if t is None else members_first(n, t, dim).flatten(0, 1)
                         for t, dim in zip((u, dt, Bm, Cm, h0), (in_dims[0], in_dims[1], *in_dims[3:6])))
    A = A if in_dims[2] is None else A.movedim(in_dims[2], 0).contiguous()  # [N_members, D, N] or shared [D, N]
    save = save or grad_needed(u, dt, A, Bm, Cm, h0)  # the caller saw batched tensors (see grad_needed)
    y, ck, hT = torch.ops.zoo_selective_scan.fwd(u, dt, A, Bm, Cm, h0, save, chunk)
    ck = ck.unflatten(0, (n, -1)) if save else ck
    return (y.unflatten(0, (n, -1)), ck, hT.unflatten(0, (n, -1))), (0, 0 if save else None, 0)


def selective_scan(u, dt, A, Bm, Cm, h0=None, chunk: int | None = None):
    """Mamba's selective scan (naive.py has the math). u, dt: [B, T, D]; A: [D, N]; Bm, Cm: [B, T, N]; h0:
    [B, D, N] or None. Returns (y [B, T, D] in u's dtype, h_T [B, D, N] fp32); gradients reach every input.
    Computes in fp32 (fp32 or lower-precision inputs). `chunk`: tokens between the states the forward keeps for
    the backward, which recomputes the others (memory ⌈T/chunk⌉·D·N per sequence, plus the backward's scratch);
    None: CHUNK."""
    if u.dim() != 3 or dt.shape != u.shape or Bm.shape != Cm.shape or Bm.shape[:2] != u.shape[:2]:
        raise ValueError(f"selective_scan: u, dt [B, T, D], Bm, Cm [B, T, N]; got {u.shape}, {dt.shape}, "
                         f"{Bm.shape}, {Cm.shape}")
    if A.shape != (u.shape[2], Bm.shape[2]):
        raise ValueError(f"selective_scan: A must be [D, N] = {[u.shape[2], Bm.shape[2]]}, got {list(A.shape)}")
    if u.dtype == torch.float64:
        raise TypeError("selective_scan computes in fp32; use naive.selective_scan_naive for float64")
    chunk = CHUNK if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"selective_scan: chunk must be an int >= 1, got {chunk!r}")
    h0 = None if h0 is None else h0.float().contiguous()
    save = grad_needed(u, dt, A, Bm, Cm, h0)
    chunk = min(chunk, u.shape[1])  # no scratch tiles past the sequence
    y, _, hT = _fwd_op(u.contiguous(), dt.contiguous(), A.contiguous(), Bm.contiguous(), Cm.contiguous(), h0, save,
                       chunk)
    return y.to(u.dtype), hT
