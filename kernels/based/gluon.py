"""Based forward as a Gluon kernel for Hopper (sm_90): bf16, K = 16, V = 64, normalised (kernels/based/README.md).

One program per sequence, chunks of C = 64 tokens, three partitions of 4 warps sharing two slots (`ready` / `free`
mbarriers): producer 0 builds ψ(q) and w = 1 + s + s²/2 (training: also den), producer 1 φ(k) and the denominator's
state; the consumer holds the state transposed in fp32 MMA accumulators. v comes by TMA: `fence_async_shared` waits
for every load a thread has in flight, but not for TMA. Each feature is a product of two K = 16 MMAs with 0/1
matrices (`_factor_mats`), in one of two layouts (`feature_rows`): wide, 192 rows, which training stores for the
backward; narrow, 160 rows, for inference, whose denominator comes from the key moments Σ [k, 1]ᵀ k."""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.based.primitives import gather_rows, invert_rows
from kernels.launch import launch

# names that changed after Triton 3.6 (the H200's)
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
C_ = gl.constexpr(64)  # tokens per chunk
K_ = gl.constexpr(16)  # feature dim
V_ = gl.constexpr(64)  # value dim
NB = gl.constexpr(3)  # feature blocks of 64
ZR_ = gl.constexpr(273)  # rows of the Taylor-order denominator state: 1 + 16 + 16²


def _acc_layout(n: int):
    """The wgmma accumulator layout of 4 warps for [*, n] tiles."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


def _shared(rows: int, cols: int):
    """The NVMMA shared layout of a bf16 [rows, cols] tile."""
    return gl.constexpr(gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16))


A64, A16, A8 = gl.constexpr(_acc_layout(64)), gl.constexpr(_acc_layout(16)), gl.constexpr(_acc_layout(8))
OP64 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_acc_layout(64), k_width=2))  # register A operands
OP16 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_acc_layout(16), k_width=2))
SL16, SLR, SL64, SL8 = _shared(64, 16), _shared(16, 64), _shared(64, 64), _shared(8, 64)
PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
LV = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))  # [C, 64] tiles
L16 = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0]))  # [C, 16] tiles
LR = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # [16, 64] factor matrices
L1 = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # [C] vectors


@gluon.jit
def _grid(R: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
    """Row and column indices [R, 1], [1, C] of an [R, C] tile in layout L."""
    return gl.arange(0, R, layout=gl.SliceLayout(1, L))[:, None], gl.arange(0, C, layout=gl.SliceLayout(0, L))[None, :]


@gluon.jit
def _offsets(i_bh, T, H: gl.constexpr):
    """Where sequence i_bh starts in q, k [B, T, H, K], in v, dO, o [B, T, H, V] and in den [B, T, H]."""
    i_b = (i_bh // H).to(gl.int64)
    return i_b * T * H * K_ + (i_bh % H) * K_, i_b * T * H * V_ + (i_bh % H) * V_, i_b * T * H + i_bh % H


@gluon.jit
def _rcp(x):
    """1/x by rcp.approx.ftz (one MUFU, ≤ 1 ulp) for positive normal x, as the denominators are (≥ ½)."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _block0(f, fa, c, one, CONST: gl.constexpr):
    """The block holding orders 0 and 1 from f = fa ⊙ fb: + fa in columns 0-15 (x_a, where fb is zero) and 1 in
    column CONST where `one` holds (c: the columns [1, W], in f's layout)."""
    return f + gl.where(c < 16, fa, 0.0) + gl.where((c == CONST) & one, 1.0, 0.0)


@gluon.jit
def _factor_mats(ra, rb, BLK: gl.constexpr, QUERY: gl.constexpr, L: gl.constexpr, NARROW: gl.constexpr,
                 W: gl.constexpr):
    """The 0/1 matrices [K_, W] of feature block BLK, feature = (x·ra) ⊙ (x·rb), the query's ½ weights in rb.
    Factor a is x_(c mod 16) in column c of every block. Wide: block 0 = x_a, x_a², 1 at 32; blocks 1, 2: the pairs
    (a, a + d mod 16), d = 1..8 (d = 8 twice, ½ each). Narrow: blocks 0, 1: the pairs d = 0..3 and 4..7 (d = 0 the
    diagonal); block 2: x_a, the pairs (a, a + 8) for a < 8, 1 at 24."""
    r, c = _grid(K_, W, L)
    if NARROW:
        if BLK == 2:
            b = gl.where((c >= 16) & (c < 24), c - 8, -1)
            half = c < 0
        else:
            d = c // 16 + 4 * BLK
            b = (c % 16 + d) % 16
            half = d == 0
    elif BLK == 0:
        b = gl.where((c >= 16) & (c < 32), c - 16, -1)
        half = (c >= 16) & (c < 32)
    else:
        j = c + 64 * (BLK - 1)
        d = 1 + j // 16
        b = (j % 16 + d) % 16
        half = d == 8
    ra.store(gl.where(r == c % 16, 1.0, 0.0).to(gl.bfloat16))
    one_b = gl.where(r == b, 1.0, 0.0)
    if QUERY:
        rb.store((gl.where(half, 0.5, 1.0) * one_b).to(gl.bfloat16))
    else:
        rb.store(one_b.to(gl.bfloat16))


@gluon.jit
def _head_tail(Z, c8):
    """[64, 8] with equal columns z -> bf16 [z_hi, z_lo, 0, …] (z_hi + z_lo ≈ z to 16 bits)."""
    hi = Z.to(gl.bfloat16)
    lo = (Z - hi.to(gl.float32)).to(gl.bfloat16)
    return gl.where(c8 == 0, hi, gl.where(c8 == 1, lo, gl.zeros_like(hi)))


@gluon.jit
def _publish_z(zt01_s, zt2_s, slot, Z0, Z1, Z2, c8):
    """z of the three feature blocks (wide) into slot `slot` as bf16 head and tail [8, 64] each, for den."""
    zt01_s.index(slot * 2).store(gl.permute(_head_tail(Z0, c8), (1, 0)))
    zt01_s.index(slot * 2 + 1).store(gl.permute(_head_tail(Z1, c8), (1, 0)))
    zt2_s.index(slot).store(gl.permute(_head_tail(Z2, c8), (1, 0)))


@gluon.jit
def _producer(q, k, z0, zT, zs, i_bh, T, scale, H: gl.constexpr, USE_H0: gl.constexpr,
              STORE_HT: gl.constexpr, STORE_STATES: gl.constexpr, x_s, q16_s, k16_s, ra_s, rb_s, ra2_s, rb2_s, f01_s,
              f2_s, w_s, zt01_s, zt2_s, dn_s, ones_s, one0_s, kt_s, ready, free, zready, NSLOT: gl.constexpr,
              ROLE: gl.constexpr, NARROW: gl.constexpr, W2: gl.constexpr):
    """A worker partition (4 warps); both arrive on the `ready` barrier (count 2) of the slot the consumer reads next.
    ROLE 0 builds ψ(q) (from q_s in q16_s), w and, wide, den = w·1 + ψ·z. ROLE 1 builds φ(k) and keeps the
    denominator's state in fp32 MMA accumulators: wide, z = Σ φ(k), handed to ROLE 0 as bf16 head and tail
    (`zready`); narrow, the moments M = Σ [k, 1]ᵀ k [64, 16], put in the slot for the consumer's den. q and k come
    through registers, loaded a chunk ahead."""
    AW2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, W2, 16])
    NR: gl.constexpr = 128 + W2  # the state's rows
    for blk in gl.static_range(2):
        _factor_mats(ra_s.index(blk), rb_s.index(blk), blk, ROLE == 0, LR, NARROW, 64)
    _factor_mats(ra2_s, rb2_s, 2, ROLE == 0, LR, NARROW, W2)
    r16, c16 = _grid(C_, K_, L16)
    cv = gl.arange(0, V_, layout=gl.SliceLayout(0, LV))[None, :]
    ra, ca = _grid(C_, 64, A64)
    r2, c2 = _grid(C_, W2, AW2)
    r8, c8 = _grid(64, 8, A8)
    rz, cz = _grid(64, K_, A16)
    zrow = gl.where(rz < K_, 1 + K_ + rz * K_ + cz, 1 + cz)  # M's rows 0-16 in the Taylor-order z (narrow)
    n0 = 0.0  # the initial state's token count (narrow: producer 1 writes the final one)
    if NARROW and USE_H0 and ROLE == 1:
        n0 = gl.load(z0 + i_bh.to(gl.int64) * ZR_)
    nk16 = gl.load(k + r16 * (H * K_) + c16, mask=r16 < T, other=0.0)
    if ROLE == 0:
        nq16 = gl.load(q + r16 * (H * K_) + c16, mask=r16 < T, other=0.0)
        xin = q16_s.index(0)
        r8v = gl.arange(0, 16 if NARROW else 8, layout=gl.SliceLayout(1, LV))[:, None]
        # [8, C] (wide) or [16, C] (narrow): row 0 all ones; transposed, B's column 0 (w's row sums) and, narrow, the
        # A operand whose column 0 reads M's row 16 (z's order 1) into every row
        one0_s.store(gl.where((r8v == 0) & (cv >= 0), 1.0, 0.0).to(gl.bfloat16))
        fence_async_shared()
    else:
        xin = x_s
        if NARROW:  # [k, 1, 0…] [C, 64] in kt_s, the A operand of M += [k, 1]ᵀ k; k is its first [C, 16] tile
            xin = kt_s.slice(0, K_, dim=1)
            r64 = gl.arange(0, 64, layout=gl.SliceLayout(1, LV))[:, None]
            kt_s.store(gl.where((cv == K_) & (r64 >= 0), 1.0, 0.0).to(gl.bfloat16))
        else:
            ones_s.store(gl.full([8, C_], 1.0, gl.bfloat16, LV))
        fence_async_shared()
        if STORE_STATES:
            zs += i_bh.to(gl.int64) * gl.cdiv(T, 2 * C_) * (NB * 64)
        if NARROW:  # z as M = Σ [k, 1]ᵀ k [64, 16] (rows 0-15: Σ k kᵀ, row 16: Σ k; the count apart, n0 + start)
            if USE_H0:
                Z = gl.load(z0 + i_bh.to(gl.int64) * ZR_ + zrow, mask=rz <= K_, other=0.0)
            else:
                Z = gl.zeros([64, K_], gl.float32, A16)
        elif USE_H0:
            z0 += i_bh.to(gl.int64) * NR
            Z0 = gl.load(z0 + r8 + c8 * 0)
            Z1 = gl.load(z0 + 64 + r8 + c8 * 0)
            Z2 = gl.load(z0 + 128 + r8 + c8 * 0)
        else:
            Z0 = gl.zeros([64, 8], gl.float32, A8)
            Z1 = gl.zeros([64, 8], gl.float32, A8)
            Z2 = gl.zeros([64, 8], gl.float32, A8)
    for c in range(gl.cdiv(T, C_)):
        start = c * C_
        slot = c % NSLOT
        if ROLE == 0:
            if NARROW:  # q_s per slot, which the consumer reads for den: its chunk c - NSLOT is done first
                mbarrier.wait(free.index(slot), ((c // NSLOT) & 1) ^ 1)
                xin = q16_s.index(slot)
            xin.store((nq16.to(gl.float32) * scale).to(gl.bfloat16))
            k16_s.store(nk16)
        else:
            xin.store(nk16)
        t16 = start + C_ + r16
        if ROLE == 0:
            nk16 = gl.load(k + t16 * (H * K_) + c16, mask=t16 < T, other=0.0)
            nq16 = gl.load(q + t16 * (H * K_) + c16, mask=t16 < T, other=0.0)
        fence_async_shared()
        _barrier()
        if ROLE == 1 or not NARROW:
            mbarrier.wait(free.index(slot), ((c // NSLOT) & 1) ^ 1)  # the consumer is done with this slot
        if ROLE == 1:
            # z entering this chunk, for the denominators
            if NARROW:  # for the consumer's den: M with rows 0-15 halved (the query's ½), bf16 head and tail
                Zh = Z * gl.where(rz < K_, 0.5, 1.0)
                hi = Zh.to(gl.bfloat16)
                zt2_s.index(slot * 2).store(hi)
                zt2_s.index(slot * 2 + 1).store((Zh - hi.to(gl.float32)).to(gl.bfloat16))
            else:
                _publish_z(zt01_s, zt2_s, slot, Z0, Z1, Z2, c8)
                fence_async_shared()
                _barrier()
                mbarrier.arrive(zready.index(slot))
            # the next chunk's keys, after this chunk's fences (each waits for the loads in flight)
            nk16 = gl.load(k + t16 * (H * K_) + c16, mask=t16 < T, other=0.0)
            if STORE_STATES:  # every second chunk's, in this kernel's rows
                if c % 2 == 0:
                    zc = zs + (c // 2) * (NB * 64)
                    gl.store(zc + r8 + c8 * 0, Z0, mask=c8 == 0)
                    gl.store(zc + 64 + r8 + c8 * 0, Z1, mask=c8 == 0)
                    gl.store(zc + 128 + r8 + c8 * 0, Z2, mask=c8 == 0)
        z = gl.zeros([C_, 64], gl.float32, A64)
        if NARROW:  # factor a once a chunk for blocks 0 and 1
            z2 = gl.zeros([C_, W2], gl.float32, AW2)
            fa = warpgroup_mma(xin, ra_s.index(0), z, use_acc=False, is_async=True)
            fb = warpgroup_mma(xin, rb_s.index(0), z, use_acc=False, is_async=True)
            fa, fb = warpgroup_mma_wait(0, deps=[fa, fb])
            f01_s.index(slot * 2).store((fa * fb).to(gl.bfloat16))
            fb = warpgroup_mma(xin, rb_s.index(1), z, use_acc=False)
            f01_s.index(slot * 2 + 1).store((fa * fb).to(gl.bfloat16))
            fa2 = warpgroup_mma(xin, ra2_s, z2, use_acc=False, is_async=True)
            fb2 = warpgroup_mma(xin, rb2_s, z2, use_acc=False, is_async=True)
            fa2, fb2 = warpgroup_mma_wait(0, deps=[fa2, fb2])
            f2_s.index(slot).store(_block0(fa2 * fb2, fa2, c2, (start + r2 < T) | (ROLE == 0), 24).to(gl.bfloat16))
        else:  # wide: factor a once a block (else the compiler keeps the first product live across the blocks)
            for blk in gl.static_range(2):
                fa = warpgroup_mma(xin, ra_s.index(blk), z, use_acc=False)
                fb = warpgroup_mma(xin, rb_s.index(blk), z, use_acc=False)
                f = fa * fb
                if blk == 0:  # the order-1 features x_a and the constant (on the key side, 0 past T)
                    f = _block0(f, fa, ca, (start + ra < T) | (ROLE == 0), 32)
                f01_s.index(slot * 2 + blk).store(f.to(gl.bfloat16))
            fa = warpgroup_mma(xin, ra2_s, z, use_acc=False)
            fb = warpgroup_mma(xin, rb2_s, z, use_acc=False)
            f2_s.index(slot).store((fa * fb).to(gl.bfloat16))
        if ROLE == 0:
            s = warpgroup_mma(xin, k16_s.permute((1, 0)), z, use_acc=False)
            if NARROW:  # w = fma(s, fma(s, ½, 1), 1), masked in fp32 and converted by asm, past which the compiler
                # cannot move the causal select onto bf16 halves
                w = gl.where(ra >= ca, gl.fma(s, gl.fma(s, 0.5, 1.0), 1.0), 0.0)
                w_s.index(slot).store(gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [w],
                                                                dtype=gl.bfloat16, is_pure=True, pack=2))
            else:
                w_s.index(slot).store(gl.where(ra >= ca, 1.0 + s + 0.5 * s * s, 0.0).to(gl.bfloat16))
        fence_async_shared()
        _barrier()
        if ROLE == 0 and not NARROW:  # den = w·1 + Σ_blk ψ_blk·z_blk (z as a bf16 head and tail: ≈ 16 bits)
            dd = warpgroup_mma(w_s.index(slot), one0_s.permute((1, 0)), gl.zeros([C_, 8], gl.float32, A8),
                               use_acc=False, is_async=True)
            mbarrier.wait(zready.index(slot), (c // NSLOT) & 1)
            dd = warpgroup_mma(f01_s.index(slot * 2), zt01_s.index(slot * 2).permute((1, 0)), dd, is_async=True)
            dd = warpgroup_mma(f01_s.index(slot * 2 + 1), zt01_s.index(slot * 2 + 1).permute((1, 0)), dd,
                               is_async=True)
            dd = warpgroup_mma(f2_s.index(slot), zt2_s.index(slot).permute((1, 0)), dd, is_async=True)
            dd = warpgroup_mma_wait(0, deps=[dd])
            dn = gl.sum(gl.where(c8 < 2, dd, 0.0), 1)  # column 0: w·1 + ψ·z's head, column 1: ψ·z's tail
            dn_s.index(slot).store(dn)
            _barrier()
        elif ROLE == 1 and NARROW:  # M += [k, 1]ᵀ k (exact products, fp32 sums)
            Z = warpgroup_mma(kt_s.permute((1, 0)), xin, Z, is_async=True)
        elif ROLE == 1:  # z += φᵀ 1 (bf16 φ, fp32 sums)
            Z0 = warpgroup_mma(f01_s.index(slot * 2).permute((1, 0)), ones_s.permute((1, 0)), Z0, is_async=True)
            Z1 = warpgroup_mma(f01_s.index(slot * 2 + 1).permute((1, 0)), ones_s.permute((1, 0)), Z1, is_async=True)
            Z2 = warpgroup_mma(f2_s.index(slot).permute((1, 0)), ones_s.permute((1, 0)), Z2, is_async=True)
        mbarrier.arrive(ready.index(slot))
        if ROLE == 1 and NARROW:
            Z = warpgroup_mma_wait(0, deps=[Z])
        elif ROLE == 1:
            Z0, Z1, Z2 = warpgroup_mma_wait(0, deps=[Z0, Z1, Z2])
    if ROLE == 1 and STORE_HT:
        if NARROW:  # the Taylor-order z: the count n0 + T (in row 17, column 0), Σ k (row 16), Σ k kᵀ (rows 0-15)
            zT += i_bh.to(gl.int64) * ZR_
            gl.store(zT + gl.where(rz <= K_, zrow, 0), gl.where(rz <= K_, Z, n0 + T),
                     mask=(rz <= K_) | ((rz == K_ + 1) & (cz == 0)))
        else:
            zT += i_bh.to(gl.int64) * NR
            gl.store(zT + r8 + c8 * 0, Z0, mask=c8 == 0)
            gl.store(zT + 64 + r8 + c8 * 0, Z1, mask=c8 == 0)
            gl.store(zT + 128 + r8 + c8 * 0, Z2, mask=c8 == 0)


@gluon.jit
def _den_mmas(w_s, one0_s, q16_s, zt2_s, slot):
    """Issue the narrow layout's denominator MMAs: w·1 (column 0) and p = q_s ½Z₂ + z₁ [C, 16] (M as bf16 head and
    tail), so that den = Σ_j q_s p + w·1 + n."""
    zero = gl.zeros([C_, K_], gl.float32, A16)
    e0 = one0_s.permute((1, 0))  # [C, 16], column 0 ones: B's column 0 (w's row sums); as A, M's row 16 everywhere
    dd = warpgroup_mma(w_s.index(slot), e0, zero, use_acc=False, is_async=True)
    xq = q16_s.index(slot)
    p = warpgroup_mma(xq, zt2_s.index(slot * 2).slice(0, K_), zero, use_acc=False, is_async=True)
    p = warpgroup_mma(xq, zt2_s.index(slot * 2 + 1).slice(0, K_), p, is_async=True)
    p = warpgroup_mma(e0, zt2_s.index(slot * 2).slice(K_, K_), p, is_async=True)
    p = warpgroup_mma(e0, zt2_s.index(slot * 2 + 1).slice(K_, K_), p, is_async=True)
    return dd, p


@gluon.jit
def _update(vt, phi01_s, phi2_s, slot, S0, S1, S2):
    """Issue the chunk's state updates Sᵀ_blk += vᵀ φ_blk (asynchronous; the caller waits)."""
    S0 = warpgroup_mma(vt, phi01_s.index(slot * 2), S0, is_async=True)
    S1 = warpgroup_mma(vt, phi01_s.index(slot * 2 + 1), S1, is_async=True)
    S2 = warpgroup_mma(vt, phi2_s.index(slot), S2, is_async=True)
    return S0, S1, S2


@gluon.jit
def _consumer(o, den_out, h0, hT, hs, hs_desc, v_desc, i_bh, T, H: gl.constexpr, USE_H0: gl.constexpr,
              STORE_HT: gl.constexpr, STORE_STATES: gl.constexpr, psi01_s, psi2_s, phi01_s, phi2_s, w_s, v_s, dn_s,
              hst_s, ready, free, vbar, NSLOT: gl.constexpr, W2: gl.constexpr, o_s, q16_s, zt2_s, one0_s, z0):
    """The default partition: Sᵀ_blk [V, 64] ([V, W2] for block 2) accumulates vᵀ φ(k) and is the register (A)
    operand of numᵀ = Σ Sᵀ ψ(q)ᵀ + vᵀ wᵀ. Wide, den comes with the slot; narrow, it is made here (`_den_mmas`)."""
    LO: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])  # [V, C] tiles stored to o[t, v]
    AW2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, W2, 16])
    NR: gl.constexpr = 128 + W2  # the state's rows
    NARROW: gl.constexpr = W2 == 32  # the inference forward (`_gluon_fwd_kernel`)
    n0 = 0.0  # the initial state's token count (narrow)
    if NARROW and USE_H0:
        n0 = gl.load(z0 + i_bh.to(gl.int64) * ZR_)
    r1 = gl.arange(0, C_, layout=L1)
    ra, ca = _grid(64, 64, A64)  # Sᵀ [value columns, features]
    r2, c2 = _grid(64, W2, AW2)
    vo, to = _grid(V_, C_, LO)
    if USE_H0:
        h0 += i_bh.to(gl.int64) * (NR * V_)
        S0 = gl.load(h0 + ca * V_ + ra)
        S1 = gl.load(h0 + (64 + ca) * V_ + ra)
        S2 = gl.load(h0 + (128 + c2) * V_ + r2)
    else:
        S0 = gl.zeros([V_, 64], gl.float32, A64)
        S1 = gl.zeros([V_, 64], gl.float32, A64)
        S2 = gl.zeros([V_, W2], gl.float32, AW2)
    NC = gl.cdiv(T, C_)
    # v comes by TMA (rows past T zero), NSLOT chunks ahead into the slot just read
    for i in gl.static_range(NSLOT):
        if i < NC:
            mbarrier.expect(vbar.index(i), C_ * V_ * 2)
            _tma_load(v_desc, [i_bh // H, i * C_, (i_bh % H) * V_], vbar.index(i),
                      v_s.index(i).reshape([1, C_, V_]))
    for c in range(NC):
        start = c * C_
        slot = c % NSLOT
        mbarrier.wait(ready.index(slot), (c // NSLOT) & 1)
        mbarrier.wait(vbar.index(slot), (c // NSLOT) & 1)
        b = slot * 2
        # vᵀ once from shared memory into registers, the A operand of its four MMAs
        vt = v_s.index(slot).permute((1, 0)).load(OP64)
        if NARROW:  # den's MMAs first, done when num is
            dd, p = _den_mmas(w_s, one0_s, q16_s, zt2_s, slot)
        num = warpgroup_mma(vt, w_s.index(slot).permute((1, 0)), gl.zeros([V_, C_], gl.float32, A64),
                            use_acc=False, is_async=True)
        num = warpgroup_mma(gl.convert_layout(S0.to(gl.bfloat16), OP64), psi01_s.index(b).permute((1, 0)), num,
                            is_async=True)
        num = warpgroup_mma(gl.convert_layout(S1.to(gl.bfloat16), OP64), psi01_s.index(b + 1).permute((1, 0)), num,
                            is_async=True)
        num = warpgroup_mma(gl.convert_layout(S2.to(gl.bfloat16), OP64), psi2_s.index(slot).permute((1, 0)), num,
                            is_async=True)
        if STORE_STATES:  # in this kernel's rows, every second chunk's: what `gluon_backward` reads
            if c % 2 == 0:  # Sᵀ as the MMAs hold it, through shared memory and a TMA store (hs: [B·H·NQ·V, 192])
                tma.store_wait(0)  # the copies of two chunks ago have left the buffers
                _barrier()
                hst_s.index(0).store(S0.to(gl.bfloat16))
                hst_s.index(1).store(S1.to(gl.bfloat16))
                hst_s.index(2).store(S2.to(gl.bfloat16))
                fence_async_shared()
                _barrier()
                row = (i_bh * gl.cdiv(T, 2 * C_) + c // 2) * V_
                _tma_store(hs_desc, [row, 0], hst_s.index(0))
                _tma_store(hs_desc, [row, 64], hst_s.index(1))
                _tma_store(hs_desc, [row, 128], hst_s.index(2))
        if NARROW:  # the state updates queued behind the reads, num awaited while they run
            S0, S1, S2 = _update(vt, phi01_s, phi2_s, slot, S0, S1, S2)
            qa = q16_s.index(slot).load(A16).to(gl.float32)
            dd, p, num = warpgroup_mma_wait(3, deps=[dd, p, num])
            dn_s.index(slot).store(gl.sum(qa * p + dd, 1) + (n0 + start))
            _barrier()
        else:  # wide: the updates after the reads
            num = warpgroup_mma_wait(0, deps=[num])
        if c + NSLOT < NC:  # vᵀ is in registers: this slot's v buffer takes chunk c + NSLOT's
            fence_async_shared()
            mbarrier.expect(vbar.index(slot), C_ * V_ * 2)
            _tma_load(v_desc, [i_bh // H, (c + NSLOT) * C_, (i_bh % H) * V_], vbar.index(slot),
                      v_s.index(slot).reshape([1, C_, V_]))
        if not NARROW:
            S0, S1, S2 = _update(vt, phi01_s, phi2_s, slot, S0, S1, S2)
        den = dn_s.index(slot).load(gl.SliceLayout(0, A64))
        if STORE_STATES:  # den for the backward, stored here: in producer 0 its next fence waited for the store
            dn1 = dn_s.index(slot).load(L1)
            gl.store(den_out + (start + r1) * H, dn1, mask=(start + r1) < T)
        out = (num * _rcp(den)[None, :]).to(gl.bfloat16)  # one reciprocal per column
        if NARROW:  # transposed through a tile of its own (one round trip, where convert_layout takes four)
            o_s.permute((1, 0)).store(out)
            _barrier()
            out = o_s.permute((1, 0)).load(LO)
        else:
            out = gl.convert_layout(out, LO)
        tt = start + to
        gl.store(o + tt * (H * V_) + vo, out, mask=tt < T)
        S0, S1, S2 = warpgroup_mma_wait(0, deps=[S0, S1, S2])
        _barrier()
        mbarrier.arrive(free.index(slot))
    if STORE_STATES:
        tma.store_wait(0)
    if STORE_HT:
        hT += i_bh.to(gl.int64) * (NR * V_)
        gl.store(hT + ca * V_ + ra, S0)
        gl.store(hT + (64 + ca) * V_ + ra, S1)
        gl.store(hT + (128 + c2) * V_ + r2, S2)


@gluon.jit
def _gluon_fwd_kernel(q, k, o, h0, z0, hT, zT, hs, hs_desc, v_desc, zs, den, T, scale, H: gl.constexpr,
                      USE_H0: gl.constexpr, STORE_HT: gl.constexpr, STORE_STATES: gl.constexpr, NSLOT: gl.constexpr,
                      PRODUCER_REGS: gl.constexpr):
    """One program per sequence. h0/hT [B·H, NR, V], z0/zT [B·H, NR] fp32 in `feature_rows` order: NR = 160 narrow
    (inference; z0/zT Taylor-order [B·H, 273]), 192 wide (STORE_STATES, training), which also writes
    den [B, T, H], zs [B·H, NQ, 192] and by TMA hs [B·H, NQ, V, 192] (NQ = ⌈T/128⌉, transposed)."""
    i_bh = gl.program_id(0)
    ok, ov, od = _offsets(i_bh, T, H)
    q += ok
    k += ok
    o += ov
    if STORE_STATES:
        den += od
    NARROW: gl.constexpr = not STORE_STATES
    W2: gl.constexpr = 32 if NARROW else 64
    slr2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K_, W2], gl.bfloat16)
    slw2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, W2], gl.bfloat16)
    # the slots: ψ(q) and φ(k) (blocks 0 and 1, block 2), w and v of a chunk
    psi01_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT * 2, C_, 64], SL64)
    phi01_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT * 2, C_, 64], SL64)
    psi2_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, C_, W2], slw2)
    phi2_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, C_, W2], slw2)
    w_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, C_, C_], SL64)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, C_, V_], SL64)
    # each producer's inputs and 0/1 factor matrices
    kx_s = gl.allocate_shared_memory(gl.bfloat16, [C_, K_], SL16)
    q16_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT if NARROW else 1, C_, K_], SL16)  # narrow: per slot
    k16_s = gl.allocate_shared_memory(gl.bfloat16, [C_, K_], SL16)
    raq_s = gl.allocate_shared_memory(gl.bfloat16, [2, K_, 64], SLR)
    rbq_s = gl.allocate_shared_memory(gl.bfloat16, [2, K_, 64], SLR)
    rak_s = gl.allocate_shared_memory(gl.bfloat16, [2, K_, 64], SLR)
    rbk_s = gl.allocate_shared_memory(gl.bfloat16, [2, K_, 64], SLR)
    ra2q_s = gl.allocate_shared_memory(gl.bfloat16, [K_, W2], slr2)
    rb2q_s = gl.allocate_shared_memory(gl.bfloat16, [K_, W2], slr2)
    ra2k_s = gl.allocate_shared_memory(gl.bfloat16, [K_, W2], slr2)
    rb2k_s = gl.allocate_shared_memory(gl.bfloat16, [K_, W2], slr2)
    # z entering each slot's chunk, the slot's denominators, the ones of the MMAs that sum z and w's rows
    if NARROW:  # z as the matrix M [64, 16] (`_producer`), B of the denominators' MMAs: head and tail per slot
        zt01_s = gl.allocate_shared_memory(gl.bfloat16, [1, 8, 64], SL8)  # (unused)
        zt2_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT * 2, 64, K_],
                                          gl.NVMMASharedLayout.get_default_for([64, K_], gl.bfloat16))
    else:
        zt01_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT * 2, 8, 64], SL8)
        zt2_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, 8, 64], SL8)
    dn_s = gl.allocate_shared_memory(gl.float32, [NSLOT, C_], PLAIN)
    ones_s = gl.allocate_shared_memory(gl.bfloat16, [8, C_], SL8)
    one0_s = gl.allocate_shared_memory(gl.bfloat16, [16 if NARROW else 8, C_],
                                       gl.NVMMASharedLayout.get_default_for([16 if NARROW else 8, C_], gl.bfloat16))
    # [k, 1, 0…] [C, 64] (narrow only), in four [C, 16] tiles one after another (32-byte swizzle): the first is x_s
    kt_s = gl.allocate_shared_memory(gl.bfloat16, [C_ if NARROW else 8, 64],
                                     gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
    hst_s = gl.allocate_shared_memory(gl.bfloat16, [NB if STORE_STATES else 1, V_, 64], SL64)  # states out
    o_s = gl.allocate_shared_memory(gl.bfloat16, [C_ if NARROW else 8, V_], SL64)  # the output tile [t, v] (narrow)
    ready = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    zready = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    vbar = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSLOT):
        mbarrier.init(vbar.index(i), count=1)
        mbarrier.init(ready.index(i), count=2)  # both producers
        mbarrier.init(free.index(i), count=1)
        mbarrier.init(zready.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (o, den, h0, hT, hs, hs_desc, v_desc, i_bh, T, H, USE_H0, STORE_HT, STORE_STATES, psi01_s,
                     psi2_s, phi01_s, phi2_s, w_s, v_s, dn_s, hst_s, ready, free, vbar, NSLOT, W2, o_s, q16_s,
                     zt2_s, one0_s, z0)),
        (_producer, (q, k, z0, zT, zs, i_bh, T, scale, H, USE_H0, STORE_HT, STORE_STATES, kx_s, q16_s, k16_s,
                     raq_s, rbq_s, ra2q_s, rb2q_s, psi01_s, psi2_s, w_s, zt01_s, zt2_s, dn_s, ones_s, one0_s,
                     kt_s, ready, free, zready, NSLOT, 0, NARROW, W2)),
        (_producer, (q, k, z0, zT, zs, i_bh, T, scale, H, USE_H0, STORE_HT, STORE_STATES, kx_s, q16_s, k16_s,
                     rak_s, rbk_s, ra2k_s, rb2k_s, phi01_s, phi2_s, w_s, zt01_s, zt2_s, dn_s, ones_s, one0_s,
                     kt_s, ready, free, zready, NSLOT, 1, NARROW, W2)),
    ], [4, 4], [PRODUCER_REGS, PRODUCER_REGS])


@functools.cache
def feature_rows(narrow: bool = False) -> tuple[int, ...]:
    """For each of the kernel's state rows (192 wide, 160 narrow: `_factor_mats`), the row of the Taylor-order form
    (1 + 16 + 16² rows [1, k, k⊗k]) it holds, or -1 for a zero row."""
    K = 16
    if narrow:
        rows = [1 + K + (c % 16) * K + (c % 16 + c // 16) % 16 for c in range(128)]  # pairs d = 0..7
        rows += [1 + c if c < 16 else 1 + K + (c - 16) * K + c - 8 if c < 24 else 0 if c == 24 else -1
                 for c in range(32)]
        return tuple(rows)
    rows = [1 + c if c < 16 else 1 + K + (c - 16) * (K + 1) if c < 32 else 0 if c == 32 else -1 for c in range(64)]
    return tuple(rows + [1 + K + (j % 16) * K + (j % 16 + 1 + j // 16) % 16 for j in range(128)])


def to_kernel_rows(hv: torch.Tensor, hz: torch.Tensor, narrow: bool = False):
    """Taylor-order state (hv [B, H, 1+K+K², V], hz [B, H, 1+K+K²]) -> the kernel's rows [B·H, NR, V], [B·H, NR];
    narrow, z stays Taylor-order [B·H, 1+K+K²] (the kernel keeps it as the moments n, Σ k, Σ k kᵀ: `_producer`)."""
    rows = feature_rows(narrow)
    hz = hz.flatten(0, 1)
    return gather_rows(hv.flatten(0, 1), rows), hz.contiguous() if narrow else gather_rows(hz, rows)


def from_kernel_rows(h: torch.Tensor, z: torch.Tensor, B: int, H: int):
    """Inverse of `to_kernel_rows` (the layout read from the number of rows) -> (hv [B, H, 1+K+K², V], hz)."""
    narrow = h.shape[1] == 160
    inv = invert_rows(feature_rows(narrow), 16)
    return gather_rows(h, inv).view(B, H, -1, h.shape[-1]), (z if narrow else gather_rows(z, inv)).view(B, H, -1)


# registers per thread of each producer partition (setmaxnreg; the consumer gets the rest): fastest on an H200
PRODUCER_REGS = 128


_STATES_BLOCK = [64, 64]
_STATES_LAYOUT = gl.NVMMASharedLayout.get_default_for(_STATES_BLOCK, gl.bfloat16)
_NO_STATES = {}
_V_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)


def _states_descriptor(hs: torch.Tensor | None, device) -> TensorDescriptor:
    """The TMA descriptor of hs [B·H, NQ, V, 192] as [B·H·NQ·V, 192] in [V, 64] tiles (without states, a dummy)."""
    if hs is None:
        if device not in _NO_STATES:
            buf = torch.empty(64, 3 * 64, device=device, dtype=torch.bfloat16)
            _NO_STATES[device] = TensorDescriptor.from_tensor(buf, _STATES_BLOCK, _STATES_LAYOUT)
        return _NO_STATES[device]
    return TensorDescriptor.from_tensor(hs.view(-1, hs.shape[-1]), _STATES_BLOCK, _STATES_LAYOUT)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, hv0: torch.Tensor | None = None,
            hz0: torch.Tensor | None = None, output_final_state: bool = False, store_states: bool = False):
    """(o, den, hvT, hzT, hs, zs) for bf16 q, k, v (contiguous, K = 16, V = 64); states in Taylor-order form (fp32)
    or None. With store_states, what `gluon_backward.backward` reads: den [B, T, H] fp32 and every second chunk's
    entering state in the wide rows, hs [B·H, NQ, V, 192] bf16 and zs [B·H, NQ, 192] fp32 (else None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    narrow = not store_states  # the kernel's narrow layout: 160 state rows (`_factor_mats`)
    h0 = z0 = hT = zT = hs = zs = den = o  # placeholders where unused
    if hv0 is not None:
        h0, z0 = to_kernel_rows(hv0, hz0, narrow)
    if output_final_state:
        hT = torch.empty(B * H, 160 if narrow else 192, V, device=q.device, dtype=torch.float32)
        zT = torch.empty(B * H, 1 + K + K * K if narrow else 192, device=q.device, dtype=torch.float32)
    if store_states:
        NQ = (T + 127) // 128
        hs = torch.empty(B * H, NQ, V, 3 * 64, device=q.device, dtype=torch.bfloat16)
        zs = torch.empty(B * H, NQ, 3 * 64, device=q.device, dtype=torch.float32)
        den = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    hs_desc = _states_descriptor(hs if store_states else None, q.device)
    v_desc = TensorDescriptor.from_tensor(v.view(B, T, H * V), [1, 64, 64], _V_LAYOUT)
    launch(_gluon_fwd_kernel, (B * H,), q, k, o, h0, z0, hT, zT, hs, hs_desc, v_desc, zs, den, T, scale, H,
           USE_H0=hv0 is not None, STORE_HT=output_final_state, STORE_STATES=store_states, NSLOT=2,
           PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    hvT, hzT = from_kernel_rows(hT, zT, B, H) if output_final_state else (None, None)
    return (o, den, hvT, hzT, hs, zs) if store_states else (o, None, hvT, hzT, None, None)
