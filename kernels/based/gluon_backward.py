"""Based backward as Gluon kernels for Hopper (sm_90), the twin of `gluon.py`'s forward.

From the forward's o, den and every second chunk's entering state (wide rows), with g = dO/den and e = −(dO·o)/den:
`_dq_kernel` runs over steps of two chunks, fully parallel; `_dkv_kernel` walks each sequence backwards with the
reverse state dS = Σ_{later} ψ gᵀ and dz = Σ ψ e in three partitions (producer, consumer: dS and dv, dk). Each
feature is f = h ⊙ (x·A) ⊙ (x·B) (`factor_matrices`, h the query's ½ weights), so its Jacobian is two MMAs a block:

    dx = (G_f ⊙ h ⊙ (x·B + u))·Aᵀ + (G_f ⊙ h ⊙ (x·A))·Bᵀ,   u = 1 in block 0's columns 0-15, else 0"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.based.gluon import (
    A8,
    A16,
    A64,
    L1,
    L16,
    LR,
    LV,
    OP16,
    OP64,
    PLAIN,
    SL16,
    SL64,
    SLR,
    _barrier,
    _block0,
    _grid,
    _offsets,
    feature_rows,
)
from kernels.based.primitives import invert_rows, scatter_rows
from kernels.launch import launch, sm_count

# cp.async to shared memory: renamed after Triton 3.6 (the H200's)
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

C_ = gl.constexpr(64)  # tokens per chunk
K_ = gl.constexpr(16)  # feature dim
V_ = gl.constexpr(64)  # value dim
NB = gl.constexpr(3)  # feature blocks of 64
F_ = gl.constexpr(192)  # state rows
DQ_CHUNK = 128  # tokens per step of the dq kernel: the forward stores every second chunk's entering state
DQ_ = gl.constexpr(DQ_CHUNK)


@gluon.jit
def _load_mats(mats, dst, M: gl.constexpr):
    """Factor matrix M (0 A, 1 B, 2 B ⊙ h) of every block from `mats` [3, NB, K_, 64] into dst [NB, K_, 64]."""
    r, c = _grid(K_, 64, LR)
    for b in gl.static_range(NB):
        dst.index(b).store(gl.load(mats + ((M * NB + b) * K_ + r) * 64 + c))


@gluon.jit
def _load_x(q, k, start, T, scale, H: gl.constexpr):
    """A chunk's q_s (rounded to bf16, as the forward's features take it) and k [C, 16]; zero past T."""
    rx, cx = _grid(C_, K_, L16)
    tx = start + rx
    xq = gl.load(q + tx * (H * K_) + cx, mask=(tx < T) & (cx >= 0), other=0.0).to(gl.float32) * scale
    xk = gl.load(k + tx * (H * K_) + cx, mask=(tx < T) & (cx >= 0), other=0.0)
    return xq.to(gl.bfloat16), xk


@gluon.jit
def _stage_chunk(q, k, v, do, o, den, qst, dost, ost, dnst, xk_dst, v_dst, start, T, H: gl.constexpr, pred):
    """Start copying a chunk's q, k, v, dO, o and den into shared memory (cp.async, one commit group); zero past T
    and where pred is false."""
    rx, cx = _grid(C_, K_, L16)
    rv, cv = _grid(C_, V_, LV)
    tx = start + rx
    tv = start + rv
    mx = pred & (tx < T) & (cx >= 0)
    mv = pred & (tv < T) & (cv >= 0)
    _cp_async(qst, q + tx * (H * K_) + cx, mask=mx)
    _cp_async(xk_dst, k + tx * (H * K_) + cx, mask=mx)
    _cp_async(v_dst, v + tv * (H * V_) + cv, mask=mv)
    _cp_async(dost, do + tv * (H * V_) + cv, mask=mv)
    _cp_async(ost, o + tv * (H * V_) + cv, mask=mv)
    td = start + gl.arange(0, C_, layout=L1)
    _cp_async(dnst, den + td * H, mask=pred & (td < T))
    async_copy.commit_group()


@gluon.jit
def _ge_from_stage(qst, dost, ost, dnst, start, T, scale, H: gl.constexpr, g_out, e_out):
    """From a staged chunk: q_s [C, 16] bf16, g = dO/den (bf16) and e = −(dO·o)/den [C] fp32, zero past T; g and e
    also go to g_out and e_out for the dk/dv walk."""
    rv, cv = _grid(C_, V_, LV)
    tv = start + rv
    tr = start + gl.arange(0, C_, layout=gl.SliceLayout(1, LV))
    xq = (qst.load(L16).to(gl.float32) * scale).to(gl.bfloat16)
    dd = dost.load(LV).to(gl.float32)
    oo = ost.load(LV).to(gl.float32)
    rn = gl.where(tr < T, 1.0 / dnst.load(gl.SliceLayout(1, LV)), 0.0)  # one division per row, then products
    g = (dd * rn[:, None]).to(gl.bfloat16)
    e = -gl.sum(dd * oo, 1) * rn
    gl.store(g_out + tv * (H * V_) + cv, g, mask=tv < T)
    gl.store(e_out + tr * H, e, mask=tr < T)
    return xq, g, e


@gluon.jit
def _copy_state(h_s, z_s, hs, zs, idx, rf, cv, pred):
    """Start copying the state entering step idx (hs bf16 transposed, zs fp32) into h_s ([V, 64] a block) and z_s
    (cp.async, one commit group; nothing where pred is false)."""
    rz = gl.arange(0, 64, layout=L1)
    src = hs + idx.to(gl.int64) * (F_ * V_)
    for b in gl.static_range(NB):
        _cp_async(h_s.index(b), src + rf * F_ + b * 64 + cv, mask=pred & (rf >= 0))
        _cp_async(z_s.slice(b * 64, 64), zs + idx.to(gl.int64) * F_ + b * 64 + rz, mask=pred & (rz >= 0))
    async_copy.commit_group()


@gluon.jit
def _dq_kernel(q, k, v, do, o, den, hs, zs, mats, dq, g_out, e_out, T, scale, BH, H: gl.constexpr):
    """dq, a step of two chunks at a time: each program takes steps pid, pid + grid, … of all sequences (NQ each) and
    for each chunk adds its own part, the second chunk's read of the first one's keys and the read of the step's
    entering state (hs, zs) through the query feature map. Also stores g = dO/den and e = −(dO·o)/den for the walk."""
    xq_s = gl.allocate_shared_memory(gl.bfloat16, [C_, K_], SL16)
    xk_s = gl.allocate_shared_memory(gl.bfloat16, [2, C_, K_], SL16)  # the step's two chunks' keys and values
    v_s = gl.allocate_shared_memory(gl.bfloat16, [2, C_, V_], SL64)
    g_s = gl.allocate_shared_memory(gl.bfloat16, [C_, V_], SL64)
    h_s = gl.allocate_shared_memory(gl.bfloat16, [NB, V_, 64], SL64)  # the step's entering state, Sᵀ
    qst = gl.allocate_shared_memory(gl.bfloat16, [C_, K_], SL16)  # the next chunk's q, dO and o, in flight
    dost = gl.allocate_shared_memory(gl.bfloat16, [C_, V_], SL64)
    ost = gl.allocate_shared_memory(gl.bfloat16, [C_, V_], SL64)
    dnst = gl.allocate_shared_memory(gl.float32, [C_], PLAIN)
    z_s = gl.allocate_shared_memory(gl.float32, [256], PLAIN)  # its z
    ra_s = gl.allocate_shared_memory(gl.bfloat16, [NB, K_, 64], SLR)
    rb_s = gl.allocate_shared_memory(gl.bfloat16, [NB, K_, 64], SLR)  # B ⊙ h: the query side's
    _load_mats(mats, ra_s, 0)
    _load_mats(mats, rb_s, 2)
    rf, cv = _grid(64, V_, LV)
    ri = gl.arange(0, C_, layout=gl.SliceLayout(1, A64))[:, None]
    cj = gl.arange(0, 64, layout=gl.SliceLayout(0, A64))
    r16, c16 = _grid(C_, K_, A16)
    u0 = gl.where(cj[None, :] < 16, 1.0, 0.0)  # block 0's order-1 columns, whose second factor is 1
    z64 = gl.zeros([C_, 64], gl.float32, A64)
    NQ = gl.cdiv(T, DQ_)
    total = NQ * BH
    step = gl.num_programs(0)
    first = gl.program_id(0)
    # commit groups, in order: chunk (idx, 0)'s inputs, step idx's state, chunk (idx, 1)'s inputs, …
    ok, ov, od = _offsets(first // NQ, T, H)
    _stage_chunk(q + ok, k + ok, v + ov, do + ov, o + ov, den + od, qst, dost, ost, dnst, xk_s.index(0), v_s.index(0),
                 (first % NQ) * DQ_, T, H, first < total)
    _copy_state(h_s, z_s, hs, zs, first, rf, cv, first < total)
    for idx in range(first, total, step):
        ok, ov, od = _offsets(idx // NQ, T, H)
        nxt = idx + step
        okn, ovn, odn = _offsets(nxt // NQ, T, H)
        for jc in gl.static_range(2):  # a step's second chunk past T runs on zeros and stores nothing
            start = (idx % NQ) * DQ_ + jc * C_
            async_copy.wait_group(1 - jc)  # this chunk's inputs have landed (the step's state may still fly)
            _barrier()
            xq, g, e = _ge_from_stage(qst, dost, ost, dnst, start, T, scale, H, g_out + ov, e_out + od)
            xq_s.store(xq)
            g_s.store(g)
            fence_async_shared()
            _barrier()  # the stage is read: the next chunk's inputs may come in
            if jc == 0:  # the step's second chunk, into buffers 1
                _stage_chunk(q + ok, k + ok, v + ov, do + ov, o + ov, den + od, qst, dost, ost, dnst,
                             xk_s.index(1), v_s.index(1), start + C_, T, H, True)
            er = gl.convert_layout(e, gl.SliceLayout(1, A64))[:, None]
            acc = gl.zeros([C_, K_], gl.float32, A16)
            # q_s and g once from shared memory into registers, the A operand of their MMAs below
            xqa = xq_s.load(OP64)
            ga = g_s.load(OP64)
            for j in gl.static_range(jc + 1):  # keys of the step's chunks up to this one (causal for its own)
                a1 = warpgroup_mma(xqa, xk_s.index(j).permute((1, 0)), z64, use_acc=False, is_async=True)
                dp = warpgroup_mma(ga, v_s.index(j).permute((1, 0)), z64, use_acc=False, is_async=True)
                a1, dp = warpgroup_mma_wait(0, deps=[a1, dp])  # s, g_i·v_j
                t = dp + er
                if j == jc:  # (g_i·v_j + e_i)(1 + s_ij) as one FMA
                    ds = gl.where(ri >= cj[None, :], t * a1 + t, 0.0)
                else:
                    ds = t * a1 + t
                acc = warpgroup_mma(gl.convert_layout(ds.to(gl.bfloat16), OP16), xk_s.index(j), acc)
                if jc == 1 and j == 0:  # buffers 0 are free: the next step's first chunk comes in
                    _barrier()
                    _stage_chunk(q + okn, k + okn, v + ovn, do + ovn, o + ovn, den + odn, qst, dost, ost, dnst,
                                        xk_s.index(0), v_s.index(0), (nxt % NQ) * DQ_, T, H, nxt < total)
            if jc == 0:
                async_copy.wait_group(1)  # the step's state has landed (the second chunk's inputs may still fly)
                fence_async_shared()
                _barrier()
            for b in gl.static_range(NB):
                gp = warpgroup_mma(ga, h_s.index(b), z64, use_acc=False, is_async=True)
                xb = warpgroup_mma(xqa, rb_s.index(b), z64, use_acc=False, is_async=True)
                if b < 2:  # blocks 1 and 2 share factor a (x_a, a = j mod 16)
                    xa = warpgroup_mma(xqa, ra_s.index(b), z64, use_acc=False, is_async=True)
                    gp, xb, xa = warpgroup_mma_wait(0, deps=[gp, xb, xa])
                else:
                    gp, xb = warpgroup_mma_wait(0, deps=[gp, xb])
                zb = z_s.slice(b * 64, 64).load(gl.SliceLayout(0, A64))[None, :]
                gp = gp + er * zb  # the weights h are in rb_s (B ⊙ h): (G ⊙ h ⊙ x·B) = G ⊙ x·(B ⊙ h)
                if b == 0:
                    xb = xb + u0
                acc = warpgroup_mma(gl.convert_layout((gp * xb).to(gl.bfloat16), OP16),
                                    ra_s.index(b).permute((1, 0)), acc)
                acc = warpgroup_mma(gl.convert_layout((gp * xa).to(gl.bfloat16), OP16),
                                    rb_s.index(b).permute((1, 0)), acc)
            if jc == 1:  # this step's reads of its state are done: the next step's comes in
                _barrier()
                _copy_state(h_s, z_s, hs, zs, idx + step, rf, cv, idx + step < total)
            t16 = start + r16
            gl.store(dq + ok + t16 * (H * K_) + c16, (acc * scale).to(dq.dtype.element_ty),
                     mask=(t16 < T) & (c16 >= 0))


@gluon.jit
def _copy_vg(v_s, g_s, slot, v, g, start, T, H: gl.constexpr, rv, cv):
    """Start copying a chunk's v and g [C, V] into their slot (cp.async, one commit group; zero past T)."""
    t = start + rv
    _cp_async(v_s.index(slot), v + t * (H * V_) + cv, mask=(t < T) & (cv >= 0))
    _cp_async(g_s.index(slot), g + t * (H * V_) + cv, mask=(t < T) & (cv >= 0))
    async_copy.commit_group()


@gluon.jit
def _store_features(x_s, ra_s, rb_s, dst, base, z64, cj, rj, c, T, KEY: gl.constexpr):
    """The three feature blocks of x_s [C, 16] (chunk c) into dst[base + b], f = (x·A_b) ⊙ (x·B_b) (blocks 1 and 2
    share factor a), block 0 with x_a and the constant (`_block0`; on the key side 0 past T)."""
    for b in gl.static_range(NB):
        fb = warpgroup_mma(x_s, rb_s.index(b), z64, use_acc=False, is_async=True)
        if b < 2:
            fa = warpgroup_mma(x_s, ra_s.index(b), z64, use_acc=False, is_async=True)
            fb, fa = warpgroup_mma_wait(0, deps=[fb, fa])
        else:
            fb = warpgroup_mma_wait(0, deps=[fb])
        f = fa * fb
        if b == 0 and KEY:
            f = _block0(f, fa, cj[None, :], c * C_ + rj < T, 32)
        elif b == 0:
            f = _block0(f, fa, cj[None, :], True, 32)
        dst.index(base + b).store(f.to(gl.bfloat16))


@gluon.jit
def _producer(q, k, v, g_in, e_in, dzT, dz0, i_bh, T, scale, H: gl.constexpr, USE_DHT: gl.constexpr,
              STORE_DH0: gl.constexpr, mats, xq_s, xk_s, v_s, g_s, e_s, psi_s, phi_s, dz_s, ra_s, rb_s, rbq_s,
              mats_ready, ready, free, NSLOT: gl.constexpr):
    """Worker partition 0: loads the factor matrices for all three partitions, then, from the last chunk, stores each
    chunk's inputs, e (bf16 head and tail), ψ(q), φ(k) and the entering dz into the slot the others read next. It keeps
    dz = Σ_{later} ψᵀ e (fp32 accumulators [64, 8] a block: columns 0 and 1 sum e's head and tail), and copies the
    next chunk's v and g into the other slot once it is free."""
    c8z = gl.arange(0, 8, layout=gl.SliceLayout(0, A8))[None, :]
    r8z = gl.arange(0, 64, layout=gl.SliceLayout(1, A8))[:, None]
    if USE_DHT:
        dzT += i_bh.to(gl.int64) * F_
        Z0 = gl.load(dzT + r8z + c8z * 0, mask=c8z == 0, other=0.0)
        Z1 = gl.load(dzT + 64 + r8z + c8z * 0, mask=c8z == 0, other=0.0)
        Z2 = gl.load(dzT + 128 + r8z + c8z * 0, mask=c8z == 0, other=0.0)
    else:
        Z0 = gl.zeros([64, 8], gl.float32, A8)
        Z1 = gl.zeros([64, 8], gl.float32, A8)
        Z2 = gl.zeros([64, 8], gl.float32, A8)
    cj = gl.arange(0, 64, layout=gl.SliceLayout(0, A64))
    rj = gl.arange(0, C_, layout=gl.SliceLayout(1, A64))[:, None]
    c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, L16))[None, :]
    z64 = gl.zeros([C_, 64], gl.float32, A64)
    _load_mats(mats, ra_s, 0)
    _load_mats(mats, rb_s, 1)
    _load_mats(mats, rbq_s, 2)
    fence_async_shared()
    _barrier()
    mbarrier.arrive(mats_ready)
    NC = gl.cdiv(T, C_)
    rv, cv = _grid(C_, V_, LV)
    tr = gl.arange(0, C_, layout=gl.SliceLayout(1, L16))
    # v and g go straight into their slot (cp.async, one chunk ahead); q, k and e through registers
    _copy_vg(v_s, g_s, 0, v, g_in, (NC - 1) * C_, T, H, rv, cv)
    nxq, nxk = _load_x(q, k, (NC - 1) * C_, T, scale, H)
    ne = gl.load(e_in + ((NC - 1) * C_ + tr) * H, mask=((NC - 1) * C_ + tr) < T, other=0.0)
    for i in range(NC):
        c = NC - 1 - i
        slot = i % NSLOT
        xq_s.index(slot).store(nxq)
        xk_s.index(slot).store(nxk)
        el = ne[:, None]
        ehi = el.to(gl.bfloat16)
        elo = (el - ehi.to(gl.float32)).to(gl.bfloat16)
        e_s.index(slot).store(gl.where(c8 == 0, ehi, gl.where(c8 == 1, elo, gl.zeros_like(ehi))))
        dz_s.index(slot * NB).store(_zsum(Z0))  # dz entering this chunk
        dz_s.index(slot * NB + 1).store(_zsum(Z1))
        dz_s.index(slot * NB + 2).store(_zsum(Z2))
        fence_async_shared()
        _barrier()
        # ψ(q) (B ⊙ h: the query's weights; its constant stays past T, harmless: g = e = 0 there) and φ(k)
        _store_features(xq_s.index(slot), ra_s, rbq_s, psi_s, slot * NB, z64, cj, rj, c, T, False)
        _store_features(xk_s.index(slot), ra_s, rb_s, phi_s, slot * NB, z64, cj, rj, c, T, True)
        async_copy.wait_group(0)  # this chunk's v and g have landed
        fence_async_shared()
        _barrier()
        # dz_b += ψ_bᵀ e, done before the hand-over (the consumer overwrites ψ's first block once its updates read it)
        es = e_s.index(slot)
        Z0 = warpgroup_mma(psi_s.index(slot * NB).permute((1, 0)), es, Z0, is_async=True)
        Z1 = warpgroup_mma(psi_s.index(slot * NB + 1).permute((1, 0)), es, Z1, is_async=True)
        Z2 = warpgroup_mma(psi_s.index(slot * NB + 2).permute((1, 0)), es, Z2, is_async=True)
        Z0, Z1, Z2 = warpgroup_mma_wait(0, deps=[Z0, Z1, Z2])
        mbarrier.arrive(ready.index(slot))
        if c > 0:  # the next chunk: q, k and e into registers at once, v and g into the other slot once both
            # readers are done with it
            nxq, nxk = _load_x(q, k, (c - 1) * C_, T, scale, H)
            ne = gl.load(e_in + ((c - 1) * C_ + tr) * H, mask=((c - 1) * C_ + tr) < T, other=0.0)
            nxt = (i + 1) % NSLOT
            mbarrier.wait(free.index(nxt), (((i + 1) // NSLOT) & 1) ^ 1)
            _copy_vg(v_s, g_s, nxt, v, g_in, (c - 1) * C_, T, H, rv, cv)
    if STORE_DH0:
        dz0 += i_bh.to(gl.int64) * F_
        rz = gl.arange(0, 64, layout=gl.SliceLayout(1, A8))
        gl.store(dz0 + rz, _zsum(Z0))
        gl.store(dz0 + 64 + rz, _zsum(Z1))
        gl.store(dz0 + 128 + rz, _zsum(Z2))


@gluon.jit
def _dk_partition(dk, T, H: gl.constexpr, xq_s, xk_s, v_s, g_s, e_s, ra_s, rb_s, dS_s, dz_s, mats_ready, ready, free,
                  ds_ready, ds_free, NSLOT: gl.constexpr):
    """Worker partition 1, stateless: dk = dsᵀ q_s + Σ_b [(G_b ⊙ x·B_b)·A_bᵀ + (G_b ⊙ x·A_b)·B_bᵀ] with
    G_b = v dS_bᵀ + dz_b, from the reverse state the consumer published for this chunk."""
    rj, ci = _grid(C_, C_, A64)
    ce = gl.arange(0, 8, layout=gl.SliceLayout(0, L16))[None, :]
    r16, c16 = _grid(C_, K_, A16)
    u0 = gl.where(ci < 16, 1.0, 0.0)  # block 0's order-1 columns, whose second factor is 1
    z64 = gl.zeros([C_, 64], gl.float32, A64)
    mbarrier.wait(mats_ready, 0)
    NC = gl.cdiv(T, C_)
    for i in range(NC):
        c = NC - 1 - i
        slot = i % NSLOT
        buf = i % 2
        mbarrier.wait(ready.index(slot), (i // NSLOT) & 1)
        # k and v once from shared memory into registers, the A operand of their MMAs below
        xk = xk_s.index(slot).load(OP64)
        va = v_s.index(slot).load(OP64)
        # the chunk's own part: dsᵀ [j, i] = ((g_i·v_j) + e_i)(1 + s_ij), i ≥ j
        at = warpgroup_mma(xk, xq_s.index(slot).permute((1, 0)), z64, use_acc=False, is_async=True)  # sᵀ
        dpt = warpgroup_mma(va, g_s.index(slot).permute((1, 0)), z64, use_acc=False, is_async=True)
        eh = e_s.index(slot).load(L16).to(gl.float32)
        e = gl.convert_layout(gl.sum(gl.where(ce < 2, eh, 0.0), 1), gl.SliceLayout(0, A64))[None, :]
        at, dpt = warpgroup_mma_wait(0, deps=[at, dpt])
        t = dpt + e
        dst = gl.where(ci >= rj, t * at + t, 0.0).to(gl.bfloat16)  # (g_i·v_j + e_i)(1 + s_ij) as one FMA
        acc = warpgroup_mma(gl.convert_layout(dst, OP16), xq_s.index(slot), gl.zeros([C_, K_], gl.float32, A16),
                            use_acc=False)
        # the later chunks' part, through the key feature map
        mbarrier.wait(ds_ready.index(buf), (i // 2) & 1)
        for b in gl.static_range(NB):
            gf = warpgroup_mma(va, dS_s.index(buf * NB + b).permute((1, 0)), z64, use_acc=False,
                               is_async=True)
            fb = warpgroup_mma(xk, rb_s.index(b), z64, use_acc=False, is_async=True)
            if b < 2:  # blocks 1 and 2 share factor a
                fa = warpgroup_mma(xk, ra_s.index(b), z64, use_acc=False, is_async=True)
                gf, fb, fa = warpgroup_mma_wait(0, deps=[gf, fb, fa])
            else:
                gf, fb = warpgroup_mma_wait(0, deps=[gf, fb])
            zb = dz_s.index(slot * NB + b).load(gl.SliceLayout(0, A64))
            if b == NB - 1:  # every read of this dS buffer is done
                _barrier()
                mbarrier.arrive(ds_free.index(buf))
            gf = gf + zb[None, :]
            if b == 0:
                fb = fb + u0
            acc = warpgroup_mma(gl.convert_layout((gf * fb).to(gl.bfloat16), OP16), ra_s.index(b).permute((1, 0)),
                                acc, is_async=True)
            acc = warpgroup_mma(gl.convert_layout((gf * fa).to(gl.bfloat16), OP16), rb_s.index(b).permute((1, 0)),
                                acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()
        mbarrier.arrive(free.index(slot))
        t16 = c * C_ + r16
        gl.store(dk + t16 * (H * K_) + c16, acc.to(dk.dtype.element_ty), mask=(t16 < T) & (c16 >= 0))


@gluon.jit
def _zsum(Z):
    """dz's accumulators [64, 8] -> dz [64]: column 0 (e's bf16 head) plus column 1 (its tail)."""
    c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, Z.type.layout))[None, :]
    return gl.sum(gl.where(c8 < 2, Z, 0.0), 1)


@gluon.jit
def _publish(dS_s, buf, S0, S1, S2):
    """The reverse state dS into buffer buf, in bf16 for the MMAs."""
    dS_s.index(buf * NB).store(S0.to(gl.bfloat16))
    dS_s.index(buf * NB + 1).store(S1.to(gl.bfloat16))
    dS_s.index(buf * NB + 2).store(S2.to(gl.bfloat16))
    fence_async_shared()
    _barrier()


@gluon.jit
def _consumer(dv, dhT, dh0, i_bh, T, H: gl.constexpr, USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr, xq_s, xk_s,
              g_s, psi_s, phi_s, dS_s, mats_ready, ready, free, ds_ready, ds_free, NSLOT: gl.constexpr):
    """The default partition: holds dS (fp32, [64, V] a block); per chunk publishes dS_b += ψ_bᵀ g (bf16,
    double-buffered) and computes dv = wᵀ g + Σ_b φ_b dS_b from the state before the chunk."""
    rs, cs = _grid(64, V_, A64)  # dS [features, values]; wᵀ [keys j, queries i]
    ro, co = _grid(C_, V_, LV)
    z64 = gl.zeros([C_, 64], gl.float32, A64)
    if USE_DHT:
        dhT += i_bh.to(gl.int64) * (F_ * V_)
        S0 = gl.load(dhT + rs * V_ + cs)
        S1 = gl.load(dhT + (64 + rs) * V_ + cs)
        S2 = gl.load(dhT + (128 + rs) * V_ + cs)
    else:
        S0 = gl.zeros([64, V_], gl.float32, A64)
        S1 = gl.zeros([64, V_], gl.float32, A64)
        S2 = gl.zeros([64, V_], gl.float32, A64)
    _publish(dS_s, 0, S0, S1, S2)
    mbarrier.arrive(ds_ready.index(0))
    mbarrier.wait(mats_ready, 0)
    NC = gl.cdiv(T, C_)
    for i in range(NC):
        c = NC - 1 - i
        slot = i % NSLOT
        buf = i % 2
        mbarrier.wait(ready.index(slot), (i // NSLOT) & 1)
        gs = g_s.index(slot)
        # the chunk's queries into the reverse state, dS_b += ψ_bᵀ g, published first (the dk partition's next chunk
        # waits on it); buffer buf keeps the state before this chunk, for dv below
        S0 = warpgroup_mma(psi_s.index(slot * NB).permute((1, 0)), gs, S0, is_async=True)
        S1 = warpgroup_mma(psi_s.index(slot * NB + 1).permute((1, 0)), gs, S1, is_async=True)
        S2 = warpgroup_mma(psi_s.index(slot * NB + 2).permute((1, 0)), gs, S2, is_async=True)
        S0, S1, S2 = warpgroup_mma_wait(0, deps=[S0, S1, S2])
        if i > 0:  # the dk partition has read the other buffer (at chunk i - 1)
            mbarrier.wait(ds_free.index(1 - buf), ((i - 1) // 2) & 1)
        _publish(dS_s, 1 - buf, S0, S1, S2)
        mbarrier.arrive(ds_ready.index(1 - buf))
        # dv = wᵀ g + Σ_b φ_b dS_b, wᵀ [j, i] = ((1 + s_ij)² + 1)/2 for i ≥ j
        st = warpgroup_mma(xk_s.index(slot), xq_s.index(slot).permute((1, 0)), z64, use_acc=False)  # sᵀ
        wt = gl.where(cs >= rs, (0.5 * st + 1.0) * st + 1.0, 0.0).to(gl.bfloat16)  # 1 + s + s²/2, two FMAs
        # wᵀ through shared memory, into the slot's first ψ block (the updates above were its last reader): as a
        # register operand it leaves ptxas short of registers for the MMAs in flight
        wt_s = psi_s.index(slot * NB)
        wt_s.store(wt)
        fence_async_shared()
        _barrier()
        acc = warpgroup_mma(wt_s, gs, z64, use_acc=False, is_async=True)
        acc = warpgroup_mma(phi_s.index(slot * NB), dS_s.index(buf * NB), acc, is_async=True)
        acc = warpgroup_mma(phi_s.index(slot * NB + 1), dS_s.index(buf * NB + 1), acc, is_async=True)
        acc = warpgroup_mma(phi_s.index(slot * NB + 2), dS_s.index(buf * NB + 2), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()
        mbarrier.arrive(free.index(slot))
        t = c * C_ + ro
        gl.store(dv + t * (H * V_) + co, gl.convert_layout(acc.to(gl.bfloat16), LV), mask=t < T)
    if STORE_DH0:
        dh0 += i_bh.to(gl.int64) * (F_ * V_)
        gl.store(dh0 + rs * V_ + cs, S0)
        gl.store(dh0 + (64 + rs) * V_ + cs, S1)
        gl.store(dh0 + (128 + rs) * V_ + cs, S2)


@gluon.jit
def _dkv_kernel(q, k, v, g, e, mats, dk, dv, dhT, dzT, dh0, dz0, T, scale, H: gl.constexpr,
                USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr, NSLOT: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                DK_REGS: gl.constexpr):
    """One program per sequence, walking its chunks from the last in three partitions: the producer, the consumer
    (dv and the reverse state) and the dk partition; with STORE_DH0 also the initial state's gradient."""
    i_bh = gl.program_id(0)
    ok, ov, od = _offsets(i_bh, T, H)
    q += ok
    k += ok
    dk += ok
    v += ov
    g += ov
    dv += ov
    e += od
    sl8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C_, 8], gl.bfloat16)
    # the slots: a chunk's inputs, e, ψ(q) and φ(k)
    xq_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, C_, K_], SL16)
    xk_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, C_, K_], SL16)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, C_, V_], SL64)
    g_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, C_, V_], SL64)
    e_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, C_, 8], sl8)
    psi_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT * NB, C_, 64], SL64)
    phi_s = gl.allocate_shared_memory(gl.bfloat16, [NSLOT * NB, C_, 64], SL64)
    ra_s = gl.allocate_shared_memory(gl.bfloat16, [NB, K_, 64], SLR)
    rb_s = gl.allocate_shared_memory(gl.bfloat16, [NB, K_, 64], SLR)
    rbq_s = gl.allocate_shared_memory(gl.bfloat16, [NB, K_, 64], SLR)  # B ⊙ h, for ψ(q)
    dz_s = gl.allocate_shared_memory(gl.float32, [NSLOT * NB, 64], PLAIN)  # dz entering each slot's chunk
    # the reverse state dS, two buffers in bf16
    dS_s = gl.allocate_shared_memory(gl.bfloat16, [2 * NB, 64, V_], SL64)
    mats_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(mats_ready, count=1)
    for s in gl.static_range(NSLOT):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=2)  # the consumer and the dk partition
    for s in gl.static_range(2):
        mbarrier.init(ds_ready.index(s), count=1)
        mbarrier.init(ds_free.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (dv, dhT, dh0, i_bh, T, H, USE_DHT, STORE_DH0, xq_s, xk_s, g_s, psi_s, phi_s, dS_s, mats_ready,
                     ready, free, ds_ready, ds_free, NSLOT)),
        (_producer, (q, k, v, g, e, dzT, dz0, i_bh, T, scale, H, USE_DHT, STORE_DH0, mats, xq_s, xk_s, v_s, g_s, e_s,
                     psi_s, phi_s, dz_s, ra_s, rb_s, rbq_s, mats_ready, ready, free, NSLOT)),
        (_dk_partition, (dk, T, H, xq_s, xk_s, v_s, g_s, e_s, ra_s, rb_s, dS_s, dz_s, mats_ready, ready, free,
                         ds_ready, ds_free, NSLOT)),
    ], [4, 4], [PRODUCER_REGS, DK_REGS])


# registers per thread of the dk/dv walk's worker partitions: ptxas holds the kernel to 168 whatever these ask
PRODUCER_REGS = 168
DK_REGS = 168


def factor_matrices(device=None) -> torch.Tensor:
    """[3, 3, 16, 64] bf16: A (index 0), B (1) and B ⊙ h (2) of each feature block, feature f of block b being
    (x·A_b)_f · (x·B_b)_f (the forward's `_factor_mats`, key side; block 0's x_a are (x·A_0)_f alone, its constant is
    added by `_block0`); h, the query side's weights, is ½ on x_a² and on the pairs d = 8 (held twice), so that
    Σ_f h_f ψ_f(q) φ_f(k) = 1 + s + s²/2."""
    m = torch.zeros(3, 3, 16, 64)
    for c in range(32):  # block 0: x_a (a < 16), x_a²
        m[0, 0, c % 16, c] = 1
        if c >= 16:
            m[1, 0, c - 16, c] = 1
    for j in range(128):  # blocks 1, 2: the pairs x_a·x_b, b = (a + d) mod 16
        a, d = j % 16, 1 + j // 16
        m[0, 1 + j // 64, a, j % 64] = 1
        m[1, 1 + j // 64, (a + d) % 16, j % 64] = 1
    h = torch.ones(3, 1, 64)
    h[0, :, 16:32] = h[2, :, 48:] = 0.5
    m[2] = m[1] * h
    return m.to(device=device, dtype=torch.bfloat16)


# dq's programs per SM (each loops over steps of two chunks, the next step's state in flight; 2 fit by shared memory)
DQ_PROGRAMS_PER_SM = 2


@functools.cache
def _constants(device):
    """The factor matrices on `device`, made once."""
    return factor_matrices(device).contiguous()


def state_grad_to_rows(dhv: torch.Tensor, dhz: torch.Tensor):
    """The final state's gradient, Taylor-order (dhv [B, H, 1+K+K², V], dhz [B, H, 1+K+K²], not symmetrised) -> that
    of the kernel's rows [B·H, 192, V], [B·H, 192]: the transpose of `gluon.from_kernel_rows`'s gather."""
    inv = invert_rows(feature_rows(), 16)
    return scatter_rows(dhv.flatten(0, 1), inv, 192), scatter_rows(dhz.flatten(0, 1), inv, 192)


def rows_grad_to_state(dh: torch.Tensor, dz: torch.Tensor, B: int, H: int):
    """The gradient of the kernel's initial rows -> that of the Taylor-order initial state: the transpose of
    `gluon.to_kernel_rows`'s gather."""
    F = 1 + 16 + 16 * 16
    return (scatter_rows(dh, feature_rows(), F).view(B, H, F, dh.shape[-1]),
            scatter_rows(dz, feature_rows(), F).view(B, H, F))


def backward(q, k, v, o, do, den, hs, zs, scale, dhvT=None, dhzT=None, need_dh0=False):
    """The gradient of `gluon.forward(..., store_states=True)`: q, k, v, o, do bf16, den fp32, (hs, zs) the stored
    states; dhvT/dhzT: the final state's gradient (Taylor-order) or None. Returns dq, dk, dv (bf16) and with need_dh0
    the initial state's gradient (Taylor-order)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    mats = _constants(q.device)
    do = do.contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dhT = dzT = dh0 = dz0 = dq  # placeholders where unused
    use_dht = dhvT is not None
    if use_dht:
        dhT, dzT = state_grad_to_rows(dhvT, dhzT)
    if need_dh0:
        dh0 = torch.empty(B * H, 192, V, device=q.device, dtype=torch.float32)
        dz0 = torch.empty(B * H, 192, device=q.device, dtype=torch.float32)
    grid = min(-(-T // DQ_CHUNK) * B * H, DQ_PROGRAMS_PER_SM * sm_count(q.device))
    g = torch.empty_like(do)  # dO/den, bf16, and −(dO·o)/den, fp32: written by dq's kernel, read by the walk
    e = torch.empty_like(den)
    launch(_dq_kernel, (grid,), q, k, v, do, o, den, hs, zs, mats, dq, g, e, T, scale, B * H, H, num_warps=4)
    launch(_dkv_kernel, (B * H,), q, k, v, g, e, mats, dk, dv, dhT, dzT, dh0, dz0, T, scale, H, USE_DHT=use_dht,
           STORE_DH0=need_dh0, NSLOT=2, PRODUCER_REGS=PRODUCER_REGS, DK_REGS=DK_REGS, num_warps=4)
    return dq, dk, dv, *(rows_grad_to_state(dh0, dz0, B, H) if need_dh0 else (None, None))
