"""The fused chunked Based kernels: one program per (sequence, value block) carries the state through the sequence
in registers (kernels/based/README.md, "The forms kept"). Order 2 is in the pair layout (PAIR_ROWS, K ≤ 16) or
K² rows (K ≤ 32); states cross the boundary Taylor-order, fp32."""

import torch
import triton
import triton.language as tl

from kernels.based.primitives import (
    _load_dout,
    _mm,
    _pair_cols,
    _pair_contract,
    _pairs,
    backward_dot,
    forward_dot,
    symmetrise_order2,
)
from kernels.launch import cdiv, launch, next_power_of_2, sm_count


@triton.jit
def _outer(x, BC: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
    """Row-wise x⊗x: [BC, BK] -> [BC, BK·BK], column a·BK + b (the K² form)."""
    if DOT == 2:
        x = x.to(tl.bfloat16)
    return tl.reshape(x[:, :, None] * x[:, None, :], (BC, BK * BK))


@triton.jit
def _pair_state_load(h, offs_k, offs_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, P: tl.constexpr,
                     NP: tl.constexpr):
    """From a Taylor-order state h [F, V]: the diagonal [BK, BV] and the pair rows [J, BV] of part P, row j =
    h_(a,b) + h_(b,a) where w_j = 2, h_(a,b) where w_j = 1 (the mirror has its own row)."""
    a, b, w = _pair_cols(BK, P, NP)
    m_v = offs_v < V
    m_k = offs_k < K
    m_j = ((a < K) & (b < K))[:, None] & m_v[None, :]
    Sd = tl.load(h + (1 + K + offs_k * (K + 1))[:, None] * V + offs_v[None, :], mask=m_k[:, None] & m_v[None, :],
                 other=0.0)
    Sp = tl.load(h + (1 + K + a * K + b)[:, None] * V + offs_v[None, :], mask=m_j, other=0.0)
    Sp += tl.load(h + (1 + K + b * K + a)[:, None] * V + offs_v[None, :], mask=m_j & (w > 1.5)[:, None], other=0.0)
    return Sd, Sp


@triton.jit
def _pair_state_store(h, Sd, Sp, c, offs_k, offs_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      P: tl.constexpr, NP: tl.constexpr):
    """c·(the symmetric K² form of (Sd, Sp)) into the order-2 rows of a Taylor-order state h [F, V]."""
    a, b, w = _pair_cols(BK, P, NP)
    m_v = offs_v < V
    m_k = offs_k < K
    m_j = ((a < K) & (b < K))[:, None] & m_v[None, :]
    tl.store(h + (1 + K + offs_k * (K + 1))[:, None] * V + offs_v[None, :], c * Sd, mask=m_k[:, None] & m_v[None, :])
    x = c * Sp / w[:, None]
    tl.store(h + (1 + K + a * K + b)[:, None] * V + offs_v[None, :], x, mask=m_j)
    tl.store(h + (1 + K + b * K + a)[:, None] * V + offs_v[None, :], x, mask=m_j & (w > 1.5)[:, None])


@triton.jit
def _order2_init(h, LOAD: tl.constexpr, offs_k, offs_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, PAIR_ROWS: tl.constexpr):
    """The order-2 state (Sd, S2, S2b): zero, or with LOAD from the Taylor-order state h [F, V]. PAIR_ROWS: the
    diagonal and the two halves of the pair rows; else S2 the K² rows [BK², BV]."""
    Sd = tl.zeros([BK, BV], dtype=tl.float32)
    S2b = tl.zeros([BK * (BK // 2) // 2, BV], dtype=tl.float32)
    if PAIR_ROWS:
        S2 = tl.zeros([BK * (BK // 2) // 2, BV], dtype=tl.float32)
        if LOAD:
            hd, hp = _pair_state_load(h, offs_k, offs_v, K, V, BK, 0, 2)
            Sd += hd
            S2 += hp
            S2b += _pair_state_load(h, offs_k, offs_v, K, V, BK, 1, 2)[1]
    else:
        S2 = tl.zeros([BK * BK, BV], dtype=tl.float32)
        if LOAD:
            offs_kk = tl.arange(0, BK * BK)
            row_kk = 1 + K + (offs_kk // BK) * K + offs_kk % BK  # state row of the pair (a, b)
            m_kk = ((offs_kk // BK) < K) & ((offs_kk % BK) < K)
            S2 += tl.load(h + row_kk[:, None] * V + offs_v[None, :], mask=m_kk[:, None] & (offs_v < V)[None, :],
                          other=0.0)
    return Sd, S2, S2b


@triton.jit
def _order2_store(h, Sd, S2, S2b, c, offs_k, offs_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  PAIR_ROWS: tl.constexpr):
    """c·(the order-2 state in `_order2_init`'s layout) into the order-2 rows of a Taylor-order state h."""
    if PAIR_ROWS:
        _pair_state_store(h, Sd, S2, c, offs_k, offs_v, K, V, BK, 0, 2)
        _pair_state_store(h, Sd, S2b, c, offs_k, offs_v, K, V, BK, 1, 2)
    else:
        offs_kk = tl.arange(0, BK * BK)
        row_kk = 1 + K + (offs_kk // BK) * K + offs_kk % BK
        m_kk = ((offs_kk // BK) < K) & ((offs_kk % BK) < K)
        tl.store(h + row_kk[:, None] * V + offs_v[None, :], c * S2, mask=m_kk[:, None] & (offs_v < V)[None, :])


@triton.jit
def _load_state(hv, hz, idx, LOAD: tl.constexpr, load_z, offs_k, offs_v, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, PAIR_ROWS: tl.constexpr):
    """The state a kernel carries, (S0 [BV], S1 [BK, BV], the order-2 state of `_order2_init`, n, z1 [BK],
    Z2 [BK, BK]): zero, or with LOAD the Taylor-order state idx of hv [*, F, V], hz [*, F] (z where load_z holds)."""
    F: tl.constexpr = 1 + K + K * K
    m_k, m_v = offs_k < K, offs_v < V
    S0 = tl.zeros([BV], dtype=tl.float32)
    S1 = tl.zeros([BK, BV], dtype=tl.float32)
    n = 0.0
    z1 = tl.zeros([BK], dtype=tl.float32)
    Z2 = tl.zeros([BK, BK], dtype=tl.float32)
    if LOAD:
        hv += idx.to(tl.int64) * F * V
        hz += idx.to(tl.int64) * F
        S0 += tl.load(hv + offs_v, mask=m_v, other=0.0)
        S1 += tl.load(hv + (1 + offs_k[:, None]) * V + offs_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        if load_z:
            n += tl.load(hz)
            z1 += tl.load(hz + 1 + offs_k, mask=m_k, other=0.0)
            Z2 += tl.load(hz + 1 + K + offs_k[:, None] * K + offs_k[None, :], mask=m_k[:, None] & m_k[None, :],
                          other=0.0)
    Sd, S2, S2b = _order2_init(hv, LOAD, offs_k, offs_v, K, V, BK, BV, PAIR_ROWS)
    return S0, S1, Sd, S2, S2b, n, z1, Z2


@triton.jit
def _store_state(hv, hz, idx, S0, S1, Sd, S2, S2b, n, z1, Z2, c, store_z, offs_k, offs_v, K: tl.constexpr,
                 V: tl.constexpr, BK: tl.constexpr, PAIR_ROWS: tl.constexpr):
    """`_load_state`'s state, order 2 times c, into the Taylor-order state idx of hv, hz (z where store_z holds)."""
    F: tl.constexpr = 1 + K + K * K
    m_k, m_v = offs_k < K, offs_v < V
    hv += idx.to(tl.int64) * F * V
    hz += idx.to(tl.int64) * F
    tl.store(hv + offs_v, S0, mask=m_v)
    tl.store(hv + (1 + offs_k[:, None]) * V + offs_v[None, :], S1, mask=m_k[:, None] & m_v[None, :])
    _order2_store(hv, Sd, S2, S2b, c, offs_k, offs_v, K, V, BK, PAIR_ROWS)
    if store_z:
        tl.store(hz, n)
        tl.store(hz + 1 + offs_k, z1, mask=m_k)
        tl.store(hz + 1 + K + offs_k[:, None] * K + offs_k[None, :], c * Z2, mask=m_k[:, None] & m_k[None, :])


@triton.jit
def _order2_read(x, Sd, S2, S2b, BC: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, PAIR_ROWS: tl.constexpr):
    """(x⊗x)·S for the order-2 state in `_order2_init`'s layout: x [BC, BK] -> [BC, BV]."""
    if PAIR_ROWS:
        o2 = _mm(x * x, Sd, DOT) + _mm(_pairs(x, BK, DOT, 0, 2, False), S2, DOT)
        o2 += _mm(_pairs(x, BK, DOT, 1, 2, False), S2b, DOT)
        return o2
    else:
        return _mm(_outer(x, BC, BK, DOT), S2, DOT)  # (x⊗x) [BC, K²] · S2


@triton.jit
def _order2_update(x, xt, y, Sd, S2, S2b, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
                   PAIR_ROWS: tl.constexpr):
    """(Sd, S2, S2b) + Σ_c (x_c⊗x_c) y_cᵀ in `_order2_init`'s layout: x [BC, BK], xt = xᵀ, y [BC, BV]."""
    if PAIR_ROWS:
        Sd += _mm(xt * xt, y, DOT)
        S2 += _mm(_pairs(xt, BK, DOT, 0, 2, True), y, DOT)
        S2b += _mm(_pairs(xt, BK, DOT, 1, 2, True), y, DOT)
    else:
        S2 += _mm(tl.trans(_outer(x, BC, BK, DOT)), y, DOT)
    return Sd, S2, S2b


@triton.jit
def _order2_contract(y, x, Sd, S2, S2b, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
                     PAIR_ROWS: tl.constexpr):
    """Σ_b (y·S[a, b])·x_b for the symmetric order-2 state S: y [BC, BV], x [BC, BK] -> [BC, BK], the order-2 part
    of ∂/∂x of (x⊗x)·S·y / 2."""
    if PAIR_ROWS:
        g = x * _mm(y, tl.trans(Sd), DOT) + _pair_contract(_mm(y, tl.trans(S2), DOT), x, BK, DOT, 0, 2)
        g += _pair_contract(_mm(y, tl.trans(S2b), DOT), x, BK, DOT, 1, 2)
        return g
    else:
        return tl.sum(tl.reshape(_mm(y, tl.trans(S2), DOT), (BC, BK, BK)) * x[:, None, :], 2)  # Σ_b m[:, a·BK + b] x_b


@triton.jit
def _fwd_kernel(q, k, v, o, den, hv0, hz0, hvT, hzT, scale, T, SEG,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                USE_H0: tl.constexpr, STORE_HT: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
                PAIR_ROWS: tl.constexpr, STATE_ONLY: tl.constexpr):
    """Value block i_v, segment i_s (SEG tokens) of sequence i_bh. States are per (sequence, segment):
    [B·H, NS, F, V], [B·H, NS, F]. STATE_ONLY sums the segment's state and writes no output."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_v, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NS = tl.num_programs(1)
    i_b, i_h = i_bh // H, i_bh % H
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    causal = offs_c[:, None] >= offs_c[None, :]
    q += i_b.to(tl.int64) * T * H * K + i_h * K
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    o += i_b.to(tl.int64) * T * H * V + i_h * V
    if NORMALIZE:
        den += i_b.to(tl.int64) * T * H + i_h
    S0, S1, Sd, S2, S2b, n, z1, Z2 = _load_state(hv0, hz0, i_bh * NS + i_s, USE_H0, True, offs_k, offs_v, K, V, BK,
                                                 BV, PAIR_ROWS)
    seg_end = tl.minimum(T, (i_s + 1) * SEG)
    for start in range(i_s * SEG, seg_end, BC):
        t = start + offs_c
        m_t = t < seg_end
        bk = tl.load(k + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bv = tl.load(v + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        if PAIR_ROWS:
            bkt = tl.load(k + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        else:
            bkt = tl.trans(bk)
        if not STATE_ONLY:
            bq = tl.load(q + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        kf = bk.to(tl.float32)
        kft = bkt.to(tl.float32)
        if not STATE_ONLY:
            qs = bq.to(tl.float32) * scale  # [BC, BK]
            s = _mm(bq, bkt, DOT) * scale  # [BC, BC]
            w = tl.where(causal, 1.0 + s + 0.5 * s * s, 0.0)
            if DOT == 4:
                # fp16 operands: the state read as S/n, whose terms have one token's scale, then times n
                nn = tl.maximum(n, 1.0)
                r = 1.0 / nn
                o2 = _order2_read(qs, Sd * r, S2 * r, S2b * r, BC, BK, DOT, PAIR_ROWS) * nn
                o1 = _mm(qs, S1 * r, DOT) * nn
            else:
                o2 = _order2_read(qs, Sd, S2, S2b, BC, BK, DOT, PAIR_ROWS)
                o1 = _mm(qs, S1, DOT)
            num = _mm(w, bv, DOT) + S0[None, :] + o1 + 0.5 * o2
            if NORMALIZE:
                qZ = _mm(qs, Z2, 0)
                d = tl.sum(w, 1) + n + tl.sum(qs * z1[None, :], 1) + 0.5 * tl.sum(qZ * qs, 1)
                num = num / d[:, None]
                if i_v == 0:
                    tl.store(den + t * H, d, mask=m_t)
            tl.store(o + t[:, None] * H * V + offs_v[None, :], num.to(o.dtype.element_ty),
                     mask=m_t[:, None] & m_v[None, :])
        S0 += tl.sum(bv.to(tl.float32), 0)
        S1 += _mm(kft, bv, DOT)
        Sd, S2, S2b = _order2_update(kf, kft, bv, Sd, S2, S2b, BC, BK, BV, DOT, PAIR_ROWS)
        n += tl.sum(m_t.to(tl.float32), 0)
        z1 += tl.sum(kf, 0)
        Z2 += _mm(kft, kf, 0)
    if STORE_HT:
        _store_state(hvT, hzT, i_bh * NS + i_s, S0, S1, Sd, S2, S2b, n, z1, Z2, 1.0, i_v == 0, offs_k, offs_v, K, V,
                     BK, PAIR_ROWS)


@triton.jit
def _dden_kernel(do, o, den, dden, R, V: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr):
    """dden = -Σ_v dO·o / den over the rows of [B·T·H, V]: the gradient reaching the denominator."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, BV)
    m = (r[:, None] < R) & (c[None, :] < V)
    bdo = tl.load(do + r[:, None].to(tl.int64) * V + c[None, :], mask=m, other=0.0).to(tl.float32)
    bo = tl.load(o + r[:, None].to(tl.int64) * V + c[None, :], mask=m, other=0.0).to(tl.float32)
    d = tl.load(den + r, mask=r < R, other=1.0)
    tl.store(dden + r, -tl.sum(bdo * bo, 1) / d, mask=r < R)


@triton.jit
def _bwd_dq_kernel(q, k, v, do, den, dden, dq, hv0, hz0, scale, T,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                   USE_H0: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr, PAIR_ROWS: tl.constexpr):
    """dq, first chunk to last, recomputing the forward state; dq [NV, B, T, H, K]: sums over V blocks."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    causal = offs_c[:, None] >= offs_c[None, :]
    first = i_v == 0
    q += i_b.to(tl.int64) * T * H * K + i_h * K
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    dq += (i_v * (tl.num_programs(1) // H) + i_b).to(tl.int64) * T * H * K + i_h * K
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    do += i_b.to(tl.int64) * T * H * V + i_h * V
    if NORMALIZE:
        den += i_b.to(tl.int64) * T * H + i_h
        dden += i_b.to(tl.int64) * T * H + i_h
    _, S1, Sd, S2, S2b, _, z1, Z2 = _load_state(hv0, hz0, i_bh, USE_H0, True, offs_k, offs_v, K, V, BK, BV, PAIR_ROWS)
    for start in range(0, T, BC):
        t = start + offs_c
        m_t = t < T
        bq = tl.load(q + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bk = tl.load(k + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bv = tl.load(v + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        dnum, dd = _load_dout(do, den, dden, t, m_t, offs_v, m_v, first, H, V, BC, NORMALIZE)
        qs = bq.to(tl.float32) * scale
        kf = bk.to(tl.float32)
        if PAIR_ROWS:
            bkt = tl.load(k + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        else:
            bkt = tl.trans(bk)
        kft = bkt.to(tl.float32)
        s = _mm(bq, bkt, DOT) * scale  # [BC, BC]
        dp = _mm(dnum, tl.trans(bv), DOT) + dd[:, None]
        ds = tl.where(causal, dp * (1.0 + s), 0.0)
        dqs = _mm(ds, bk, DOT) + _mm(dnum, tl.trans(S1), DOT)
        dqs += _order2_contract(dnum, qs, Sd, S2, S2b, BC, BK, BV, DOT, PAIR_ROWS)
        if NORMALIZE:
            dqs += dd[:, None] * (z1[None, :] + _mm(qs, Z2, 0))
        tl.store(dq + t[:, None] * H * K + offs_k[None, :], dqs * scale, mask=m_t[:, None] & m_k[None, :])
        S1 += _mm(kft, bv, DOT)
        Sd, S2, S2b = _order2_update(kf, kft, bv, Sd, S2, S2b, BC, BK, BV, DOT, PAIR_ROWS)
        z1 += tl.sum(kf, 0)
        Z2 += _mm(kft, kf, 0)


@triton.jit
def _bwd_dkv_kernel(q, k, v, do, den, dden, dk, dv, dhvT, dhzT, dhv0, dhz0, scale, T,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
                    PAIR_ROWS: tl.constexpr):
    """dk ([NV, B, T, H, K], sums over V blocks) and dv, last chunk to first, with the reverse states D0 = Σ dnum,
    D1 = Σ q_s dnumᵀ, D2 = Σ (q_s⊗q_s) dnumᵀ (and d0, d1, d2 for dden). What is left at t = 0 is the initial state's
    gradient (order 2 halved)."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    causal_t = offs_c[:, None] <= offs_c[None, :]  # [key j, query i]: j ≤ i
    first = i_v == 0
    q += i_b.to(tl.int64) * T * H * K + i_h * K
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    dk += (i_v * (tl.num_programs(1) // H) + i_b).to(tl.int64) * T * H * K + i_h * K
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    do += i_b.to(tl.int64) * T * H * V + i_h * V
    dv += i_b.to(tl.int64) * T * H * V + i_h * V
    if NORMALIZE:
        den += i_b.to(tl.int64) * T * H + i_h
        dden += i_b.to(tl.int64) * T * H + i_h
    # dhvT/dhzT: the final state's gradient, order 2 symmetrised (G + Gᵀ); the denominator's part enters dk once,
    # through the first V block
    D0, D1, Dd, D2, D2b, d0, d1, d2 = _load_state(dhvT, dhzT, i_bh, USE_DHT, i_v == 0, offs_k, offs_v, K, V, BK, BV,
                                                  PAIR_ROWS)
    n_chunks = tl.cdiv(T, BC)
    for i in range(0, n_chunks):
        t = (n_chunks - 1 - i) * BC + offs_c
        m_t = t < T
        bq = tl.load(q + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bk = tl.load(k + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bv = tl.load(v + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        dnum, dd = _load_dout(do, den, dden, t, m_t, offs_v, m_v, first, H, V, BC, NORMALIZE)
        qs = bq.to(tl.float32) * scale
        kf = bk.to(tl.float32)
        if PAIR_ROWS:
            bqt = tl.load(q + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        else:
            bqt = tl.trans(bq)
        qst = bqt.to(tl.float32) * scale
        st = _mm(bk, bqt, DOT) * scale  # [BC keys, BC queries]
        wt = tl.where(causal_t, 1.0 + st + 0.5 * st * st, 0.0)
        o2 = _order2_read(kf, Dd, D2, D2b, BC, BK, DOT, PAIR_ROWS)
        bdv = _mm(wt, dnum, DOT) + D0[None, :] + _mm(kf, D1, DOT) + 0.5 * o2
        tl.store(dv + t[:, None] * H * V + offs_v[None, :], bdv.to(dv.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        dpt = _mm(bv, tl.trans(dnum), DOT) + dd[None, :]
        dst = tl.where(causal_t, dpt * (1.0 + st), 0.0)
        bdk = _mm(dst, qs, DOT) + _mm(bv, tl.trans(D1), DOT)
        bdk += _order2_contract(bv, kf, Dd, D2, D2b, BC, BK, BV, DOT, PAIR_ROWS)
        # d1, d2 hold dO's share through the denominator and the final k_sum's gradient, normalised or not
        bdk += d1[None, :] + _mm(kf, d2, 0)
        tl.store(dk + t[:, None] * H * K + offs_k[None, :], bdk, mask=m_t[:, None] & m_k[None, :])
        D0 += tl.sum(dnum, 0)
        D1 += _mm(qst, dnum, DOT)
        Dd, D2, D2b = _order2_update(qs, qst, dnum, Dd, D2, D2b, BC, BK, BV, DOT, PAIR_ROWS)
        d0 += tl.sum(dd, 0)
        d1 += tl.sum(qs * dd[:, None], 0)
        d2 += _mm(qst, qs * dd[:, None], 0)
    if STORE_DH0:
        _store_state(dhv0, dhz0, i_bh, D0, D1, Dd, D2, D2b, d0, d1, d2, 0.5, i_v == 0, offs_k, offs_v, K, V, BK,
                     PAIR_ROWS)


def _config(K: int, V: int, dtype: torch.dtype, kind: str):
    """(BK, BV, BC, num_warps, num_stages): chunks of 64 for bf16 and fp16 forwards at K ≤ 16, 32 elsewhere (the
    backward faults at 64 on Triton 3.6 in some configurations; K = 32 at 64 overflows shared memory)."""
    BK = max(16, next_power_of_2(K))
    BV = min(32, max(16, next_power_of_2(V)))
    half = dtype in (torch.bfloat16, torch.float16)
    BC = 64 if kind == "fwd" and half and BK <= 16 else 32
    return BK, BV, BC, 4, 2


def _pair_rows(BK: int) -> bool:
    """The order-2 layout: True, the pair rows in two halves (BK = 16), or False, the K² rows (BK = 32)."""
    return BK <= 16


# Segments run in parallel while the programs are fewer than the device's SMs, each of at least MIN_SEGMENT_CHUNKS
# chunks: beyond that the extra state pass and prefix sum cost more than shorter chains gain.
MIN_SEGMENT_CHUNKS = 8


def segment_tokens(T: int, programs: int, BC: int, sms: int) -> int:
    """Tokens per segment of the forward (a multiple of BC; ≥ T: one segment) for `programs` programs a segment on a
    device of `sms` SMs."""
    n_chunks = cdiv(T, BC)
    segments = min(cdiv(sms, programs), n_chunks // MIN_SEGMENT_CHUNKS)
    if segments <= 1:
        return n_chunks * BC
    return cdiv(n_chunks, segments) * BC


def forward(q, k, v, hv0, hz0, scale: float, output_final_state: bool, normalize: bool):
    """(o, den, hvT, hzT): o [B, T, H, V], den [B, T, H] fp32 (None unless normalize), the final state Taylor-order
    (or None, None). q, k, v contiguous; hv0/hz0: the initial state, Taylor-order, fp32, or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    F = 1 + K + K * K
    BK, BV, BC, num_warps, num_stages = _config(K, V, q.dtype, "fwd")
    NV = cdiv(V, BV)
    o = torch.empty_like(v)
    den = torch.empty(B, T, H, device=q.device, dtype=torch.float32) if normalize else None
    meta = dict(H=H, K=K, V=V, BK=BK, BV=BV, BC=BC, NORMALIZE=normalize, DOT=forward_dot(q.dtype, K),
                PAIR_ROWS=_pair_rows(BK), num_warps=num_warps, num_stages=num_stages)
    SEG = segment_tokens(T, NV * B * H, BC, sm_count(q.device))
    NS = cdiv(T, SEG)
    if NS == 1:
        hvT = torch.empty(B, H, F, V, device=q.device, dtype=torch.float32) if output_final_state else None
        hzT = torch.empty(B, H, F, device=q.device, dtype=torch.float32) if output_final_state else None
        launch(_fwd_kernel, (NV, 1, B * H), q, k, v, o, den, hv0, hz0, hvT, hzT, scale, T, SEG,
               USE_H0=hv0 is not None, STORE_HT=output_final_state, STATE_ONLY=False, **meta)
        return o, den, hvT, hzT
    # each segment's own state, then every segment from h0 plus the segments before it (an exclusive prefix sum)
    hs = torch.empty(B, H, NS, F, V, device=q.device, dtype=torch.float32)
    zs = torch.empty(B, H, NS, F, device=q.device, dtype=torch.float32)
    launch(_fwd_kernel, (NV, NS, B * H), q, k, v, o, den, None, None, hs, zs, scale, T, SEG, USE_H0=False,
           STORE_HT=True, STATE_ONLY=True, **meta)
    hv_in = torch.cat([torch.zeros_like(hs[:, :, :1]), hs[:, :, :-1].cumsum(2)], 2)
    hz_in = torch.cat([torch.zeros_like(zs[:, :, :1]), zs[:, :, :-1].cumsum(2)], 2)
    if hv0 is not None:
        hv_in += hv0[:, :, None]
        hz_in += hz0[:, :, None]
    hvT = hzT = None
    if output_final_state:
        hvT = (hv_in[:, :, -1] + hs[:, :, -1]).contiguous()
        hzT = (hz_in[:, :, -1] + zs[:, :, -1]).contiguous()
    launch(_fwd_kernel, (NV, NS, B * H), q, k, v, o, den, hv_in, hz_in, None, None, scale, T, SEG, USE_H0=True,
           STORE_HT=False, STATE_ONLY=False, **meta)
    return o, den, hvT, hzT


def backward(q, k, v, o, den, hv0, hz0, do, dhvT, dhzT, scale: float, normalize: bool):
    """dq, dk, dv and the initial state's gradient (Taylor-order, or None without one). dhvT/dhzT: the final
    state's gradient (Taylor-order, not symmetrised) or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV, BC, num_warps, num_stages = _config(K, V, q.dtype, "bwd")
    NV = cdiv(V, BV)
    do = do.contiguous()
    dden = None
    if normalize:
        dden = torch.empty_like(den)
        R = B * T * H
        launch(_dden_kernel, (cdiv(R, 32),), do, o, den, dden, R, V=V, BR=32, BV=next_power_of_2(V))
    use_dht = dhvT is not None
    if use_dht:
        dhvT, dhzT = symmetrise_order2(dhvT, K), symmetrise_order2(dhzT, K)
    store_dh0 = hv0 is not None
    dhv0 = torch.empty_like(hv0) if store_dh0 else None
    dhz0 = torch.empty_like(hz0) if store_dh0 else None
    dq = torch.empty(NV, B, T, H, K, device=q.device, dtype=torch.float32)
    dk = torch.empty(NV, B, T, H, K, device=q.device, dtype=torch.float32)
    dv = torch.empty_like(v)
    meta = dict(H=H, K=K, V=V, BK=BK, BV=BV, BC=BC, NORMALIZE=normalize, DOT=backward_dot(q.dtype, K),
                PAIR_ROWS=_pair_rows(BK), num_warps=num_warps, num_stages=num_stages)
    launch(_bwd_dq_kernel, (NV, B * H), q, k, v, do, den, dden, dq, hv0, hz0, scale, T, USE_H0=hv0 is not None,
           **meta)
    launch(_bwd_dkv_kernel, (NV, B * H), q, k, v, do, den, dden, dk, dv, dhvT, dhzT, dhv0, dhz0, scale, T,
           USE_DHT=use_dht, STORE_DH0=store_dh0, **meta)
    return dq.sum(0).to(q.dtype), dk.sum(0).to(k.dtype), dv, dhv0, dhz0
