"""The split chunked Based kernels, the portable training path (kernels/based/README.md, "The forms kept"): a
features kernel and a chain kernel store the state entering every chunk, then every chunk runs at once. The states
use the pair layout (`primitives.pair_rows`, R = 161 rows) in the operand dtype (fp16 as S/n, n the tokens summed);
the denominator's state stays fp32 in the padded Taylor-order layout (`primitives.padded_rows`, ZR = 273 rows).
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.based.primitives import (
    _load_dout,
    _mm,
    _pair_contract,
    _pairs,
    forward_dot,
    gather_rows,
    invert_rows,
    padded_rows,
    pair_rows,
    symmetrise_order2,
)
from kernels.launch import cdiv, launch, next_power_of_2


@dataclass(frozen=True)
class SplitConfig:
    """Launch settings, the fastest measured on an H200 (experiments/LOG.md). BC: tokens per chunk; BV: the value
    block of the state passes and dk/dv (at 32, Triton 3.6 compiles the dk kernel into an out-of-bounds shared-memory
    read); output_BV: that of the output pass and dq; OP: parts of the pair rows a per-chunk kernel reads at a time;
    *_chunks, *_stages: chunks per program and pipeline stages of the per-chunk kernels; maxnreg: their register cap
    (168: 3 programs of 4 warps per SM); features_rows, features_parts, features_stages: the chain's row part, the
    features kernel's pair-row parts, the chain's pipeline stages."""

    BC: int = 64
    BV: int = 64
    output_BV: int = 64
    OP: int = 2
    warps: int = 4
    output_chunks: int = 8
    output_stages: int = 3
    dq_chunks: int = 1
    dq_stages: int = 1
    dv_chunks: int = 4
    dv_stages: int = 2
    dk_chunks: int = 1
    dk_stages: int = 1
    maxnreg: int = 168
    features_rows: int = 128
    features_parts: int = 2
    features_stages: int = 3


CONFIG = SplitConfig()
R_, ZR_ = 1 + 2 * 16 + 16 * 8, 1 + 16 + 16 * 16  # the state's and the denominator state's rows


def _state_dtype(dot: int) -> torch.dtype:
    """The stored features' and states' dtype: the dots' operand dtype (bf16, fp16), else fp32."""
    return {2: torch.bfloat16, 4: torch.float16}.get(dot, torch.float32)


def _blocks(T: int, V: int, BV: int, cfg: SplitConfig) -> tuple[int, int, int, int]:
    """(BC, BV, NV, NC): chunk, value block (at most BV), their counts."""
    BV = min(BV, max(16, next_power_of_2(V)))
    return cfg.BC, BV, cdiv(V, BV), cdiv(T, cfg.BC)


@triton.jit
def _dout_scale(den, c, T, BC: tl.constexpr, H: tl.constexpr):
    """The factor fp16 operands (DOT 4) carry dO/den in for chunk c: the chunk's smallest |den| (den at the
    sequence). dO/den shrinks like 1/tokens and in fp16 falls into subnormals; times this it is at most dO's size."""
    t = c * BC + tl.arange(0, BC)
    d = tl.load(den + t * H, mask=t < T, other=float("inf"))
    return tl.maximum(tl.min(tl.abs(d), 0), 1e-30)


@triton.jit
def _load_k(k, c, T, offs_c, offs_k, m_k, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """Chunk c's keys [BC, BK] (zero past T)."""
    t = c * BC + offs_c
    return tl.load(k + t[:, None] * H * K + offs_k[None, :], mask=(t < T)[:, None] & m_k[None, :], other=0.0)


@triton.jit
def _features_kernel(k, g, F, zc, w, den, wout, o, scale, T, NC, H: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, NPF: tl.constexpr,
                     DOT: tl.constexpr, USE_G: tl.constexpr, STORE_W: tl.constexpr,
                     DDEN: tl.constexpr = False):
    """Chunk i_c of sequence i_bh: the features of x = scale·k (the queries in the reverse pass) feature-major in the
    pair-layout row order (F [B·H, R, T], operand dtype), and the chunk's own denominator sums with per-token weights g
    (zc [B·H, NC, ZR] fp32: Σ g, Σ x g, Σ x xᵀ g; without USE_G, g = 1). With STORE_W also the reverse walk's operand
    wout = w / den; with DDEN, g = dden = -Σ_v dO·o / den is computed here (dO and den are loaded anyway) and stored."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
    JP: tl.constexpr = BK * (BK // 2) // NPF
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    m_k = offs_k < K
    t = i_c * BC + offs_c
    m_t = t < T
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    F += i_bh.to(tl.int64) * R * T
    zc += (i_bh.to(tl.int64) * NC + i_c) * ZR
    kft = tl.load(k + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
    kft = kft.to(tl.float32) * scale  # [BK, BC]
    if STORE_W:
        offs_w = tl.arange(0, BW)
        m_w = m_t[:, None] & (offs_w < V)[None, :]
        at = (i_b.to(tl.int64) * T + t[:, None]) * H * V + i_h * V + offs_w[None, :]
        bw = tl.load(w + at, mask=m_w, other=0.0).to(tl.float32)
        d = tl.load(den + i_b.to(tl.int64) * T * H + i_h + t * H, mask=m_t, other=1.0)
    if DDEN:
        gt = -tl.sum(bw * tl.load(o + at, mask=m_w, other=0.0).to(tl.float32), 1) / d
        tl.store(g + i_b.to(tl.int64) * T * H + i_h + t * H, gt, mask=m_t)
    elif USE_G:
        gt = tl.load(g + i_b.to(tl.int64) * T * H + i_h + t * H, mask=m_t, other=0.0)
    else:
        gt = m_t.to(tl.float32)
    dt = F.dtype.element_ty
    tl.store(F + t, tl.full([BC], 1.0, tl.float32).to(dt), mask=m_t)
    tl.store(F + (1 + offs_k)[:, None] * T + t[None, :], kft.to(dt), mask=m_t[None, :])
    tl.store(F + (1 + BK + offs_k)[:, None] * T + t[None, :], (kft * kft).to(dt), mask=m_t[None, :])
    for p in tl.static_range(NPF):
        rows = 1 + 2 * BK + p * JP + tl.arange(0, JP)
        pairs = _pairs(kft, BK, DOT, p, NPF, True)
        tl.store(F + rows[:, None] * T + t[None, :], pairs.to(dt), mask=m_t[None, :])
    tl.store(zc, tl.sum(gt, 0))
    tl.store(zc + 1 + offs_k, tl.sum(kft * gt[None, :], 1))
    # x loaded again untransposed for Σ x xᵀ g in exact fp32
    Z2 = _mm(kft, _load_k(k, i_c, T, offs_c, offs_k, m_k, H, K, BC).to(tl.float32) * scale * gt[:, None], 0)
    tl.store(zc + 1 + BK + offs_k[:, None] * BK + offs_k[None, :], Z2)
    if STORE_W:
        bw = bw / d[:, None]
        if DOT == 4:  # fp16 operands: dO/den times the chunk's own factor (`_dout_scale`), so it stays in range
            bw = bw * _dout_scale(den + i_b.to(tl.int64) * T * H + i_h, i_c, T, BC, H)
        tl.store(wout + at, bw.to(wout.dtype.element_ty), mask=m_w)


@triton.jit
def _chain_kernel(F, v, hs, h0, hT, zc, z0, zT, den, T, NC, H: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
                  RP: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr, ZR: tl.constexpr, BZ: tl.constexpr,
                  USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr,
                  REVERSE: tl.constexpr = False, SCALED_W: tl.constexpr = False):
    """Rows i_p·RP up to (i_p + 1)·RP of sequence i_bh's state, value block i_v: hs[c] = h0 + Σ_{c' < c} F[:, c'] v[c']
    (REVERSE: c' > c), the whole sum in hT, one load and one dot per pipelined step. The first program of a sequence
    also turns zc into the entering denominator states in place, from z0 (total in zT). fp16 (DOT 4): the forward
    stores hs[c] / max(n_c, 1), n_c the tokens summed; the reverse walk (SCALED_W) divides the chunk's `_dout_scale`
    out of each step's dot."""
    i_p, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_p * RP + tl.arange(0, RP)
    m_r = rows < R
    offs_c = tl.arange(0, BC)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_v = offs_v < V
    m_s = m_r[:, None] & m_v[None, :]
    offs_z = tl.arange(0, BZ)
    m_z = (offs_z < ZR) & (offs_z * 0 + i_p + i_v == 0)  # the first program only
    F += i_bh.to(tl.int64) * R * T
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    hs += i_bh.to(tl.int64) * NC * R * V
    zc += i_bh.to(tl.int64) * NC * ZR
    S = tl.zeros([RP, BV], dtype=tl.float32)
    Z = tl.zeros([BZ], dtype=tl.float32)
    n0 = 0.0
    if USE_H0:
        S += tl.load(h0 + i_bh.to(tl.int64) * R * V + rows[:, None] * V + offs_v[None, :], mask=m_s, other=0.0)
        Z += tl.load(z0 + i_bh.to(tl.int64) * ZR + offs_z, mask=m_z, other=0.0)
        n0 = tl.load(z0 + i_bh.to(tl.int64) * ZR)
    if SCALED_W:
        den += i_b.to(tl.int64) * T * H + i_h
    for i in tl.range(0, NC, num_stages=STAGES):
        c = NC - 1 - i if REVERSE else i
        if DOT == 4 and not REVERSE:
            hc = S * (1.0 / tl.maximum(n0 + c * BC, 1.0))
        else:
            hc = S
        tl.store(hs + c * R * V + rows[:, None] * V + offs_v[None, :], hc.to(hs.dtype.element_ty), mask=m_s)
        t = c * BC + offs_c
        m_t = t < T
        f = tl.load(F + rows[:, None] * T + t[None, :], mask=m_r[:, None] & m_t[None, :], other=0.0)
        bv = tl.load(v + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        dz = tl.load(zc + c * ZR + offs_z, mask=m_z, other=0.0)
        tl.store(zc + c * ZR + offs_z, Z, mask=m_z)
        Z += dz
        if SCALED_W:
            S += _mm(f, bv, DOT) * (1.0 / _dout_scale(den, c, T, BC, H))
        else:
            S += _mm(f, bv, DOT)
    if STORE_HT:
        tl.store(hT + i_bh.to(tl.int64) * R * V + rows[:, None] * V + offs_v[None, :], S, mask=m_s)
        tl.store(zT + i_bh.to(tl.int64) * ZR + offs_z, Z, mask=m_z)


@triton.jit
def _output_kernel(q, k, v, o, den, hs, zs, scale, T, NC,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   BC: tl.constexpr, OP: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
                   G: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """Chunks i_g·G up to (i_g + 1)·G of sequence i_bh, value block i_v (STAGES > 1: the next chunk's loads in flight):
    the causal tile plus the read of the entering state, the pair rows in OP parts."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_g, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
    for i_c in tl.range(i_g * G, tl.minimum(i_g * G + G, NC), num_stages=STAGES):
        t = i_c * BC + offs_c
        m_t = t < T
        h = hs + (i_bh.to(tl.int64) * NC + i_c) * R * V
        z = zs + (i_bh.to(tl.int64) * NC + i_c) * ZR
        bq = tl.load(q + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bkt = tl.load(k + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        bv = tl.load(v + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        qs = bq.to(tl.float32) * scale  # [BC, BK]
        s = _mm(bq, bkt, DOT) * scale  # [BC, BC]
        w = tl.where(causal, 1.0 + s + 0.5 * s * s, 0.0)
        S0 = tl.load(h + offs_v, mask=m_v, other=0.0).to(tl.float32)
        # the state tiles go to the dots as stored (`_mm` casts to the operand dtype), so that a pipelined loop
        # (STAGES > 1) can load them ahead
        S1 = tl.load(h + (1 + offs_k)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
        o2 = _order2_of(qs, h, offs_v, m_v, V, BK, OP, DOT)
        if DOT == 4:  # fp16 operands: hs holds the state over max(n, 1) (`_chain_kernel`)
            num = _mm(w, bv, DOT) + (S0[None, :] + _mm(qs, S1, DOT) + 0.5 * o2) * tl.maximum(tl.load(z), 1.0)
        else:
            num = _mm(w, bv, DOT) + S0[None, :] + _mm(qs, S1, DOT) + 0.5 * o2
        if NORMALIZE:
            Z2 = tl.load(z + 1 + BK + offs_k[:, None] * BK + offs_k[None, :])
            d2 = tl.sum(_mm(qs, Z2, 0) * qs, 1)
            d = tl.sum(w, 1) + tl.load(z) + tl.sum(qs * tl.load(z + 1 + offs_k)[None, :], 1) + 0.5 * d2
            num = num / d[:, None]
            if i_v == 0:
                tl.store(den + i_b.to(tl.int64) * T * H + i_h + t * H, d, mask=m_t)
        tl.store(o + t[:, None] * H * V + offs_v[None, :], num.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def _pair_grad(y, x, h, offs_v, m_v, V: tl.constexpr, BK: tl.constexpr, OP: tl.constexpr, DOT: tl.constexpr):
    """Σ_b (y·S[a, b])·x_b for the symmetric order-2 state S in the pair layout at h: y [BC, BV], x [BC, BK] ->
    [BC, BK] (`fused._order2_contract`)."""
    JP: tl.constexpr = BK * (BK // 2) // OP
    offs_k = tl.arange(0, BK)
    offs_j = tl.arange(0, JP)
    Sdt = tl.load(h + (1 + BK + offs_k)[None, :] * V + offs_v[:, None], mask=m_v[:, None], other=0.0)
    g = x * _mm(y, Sdt, DOT)
    for p in tl.static_range(OP):
        S2t = tl.load(h + (1 + 2 * BK + p * JP + offs_j)[None, :] * V + offs_v[:, None], mask=m_v[:, None], other=0.0)
        g += _pair_contract(_mm(y, S2t, DOT), x, BK, DOT, p, OP)
    return g


@triton.jit
def _order2_of(x, h, offs_v, m_v, V: tl.constexpr, BK: tl.constexpr, OP: tl.constexpr, DOT: tl.constexpr):
    """(x⊗x)·S for the order-2 state S in the pair layout at h: x [BC, BK] -> [BC, BV]."""
    JP: tl.constexpr = BK * (BK // 2) // OP
    offs_k = tl.arange(0, BK)
    offs_j = tl.arange(0, JP)
    Sd = tl.load(h + (1 + BK + offs_k)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
    o2 = _mm(x * x, Sd, DOT)
    for p in tl.static_range(OP):
        S2 = tl.load(h + (1 + 2 * BK + p * JP + offs_j)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
        o2 += _mm(_pairs(x, BK, DOT, p, OP, False), S2, DOT)
    return o2


@triton.jit
def _dq_kernel(q, k, v, do, den, dden, dq, hs, zs, scale, T, NC,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               BC: tl.constexpr, OP: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
               G: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """dq of chunks i_g·G up to (i_g + 1)·G (dq [NV, B, T, H, K], sums over V blocks) from the forward's entering
    states."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_g, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    first = i_v == 0
    causal = offs_c[:, None] >= offs_c[None, :]
    q += i_b.to(tl.int64) * T * H * K + i_h * K
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    dq += (i_v * (tl.num_programs(2) // H) + i_b).to(tl.int64) * T * H * K + i_h * K
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    do += i_b.to(tl.int64) * T * H * V + i_h * V
    if NORMALIZE:
        den += i_b.to(tl.int64) * T * H + i_h
        dden += i_b.to(tl.int64) * T * H + i_h
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
    for i_c in tl.range(i_g * G, tl.minimum(i_g * G + G, NC), num_stages=STAGES):
        t = i_c * BC + offs_c
        m_t = t < T
        h = hs + (i_bh.to(tl.int64) * NC + i_c) * R * V
        z = zs + (i_bh.to(tl.int64) * NC + i_c) * ZR
        bq = tl.load(q + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bk = tl.load(k + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bkt = tl.load(k + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        bvt = tl.load(v + t[None, :] * H * V + offs_v[:, None], mask=m_v[:, None] & m_t[None, :], other=0.0)
        dnum, dd = _load_dout(do, den, dden, t, m_t, offs_v, m_v, first, H, V, BC, NORMALIZE)
        qs = bq.to(tl.float32) * scale
        s = _mm(bq, bkt, DOT) * scale  # [BC, BC]
        # fp16 (DOT 4): dO/den and dd times u, the chunk's `_dout_scale`, and hs over max(n, 1), both undone in fp32
        # (elsewhere u = r = 1, and the products by them fold away)
        u = 1.0
        if DOT == 4 and NORMALIZE:
            u = _dout_scale(den, i_c, T, BC, H)
        dnum = dnum * u
        dp = _mm(dnum, bvt, DOT) + (dd * u)[:, None]
        ds = tl.where(causal, dp * (1.0 + s), 0.0)
        S1t = tl.load(h + (1 + offs_k)[None, :] * V + offs_v[:, None], mask=m_v[:, None], other=0.0)
        r = 1.0
        if DOT == 4:
            r = tl.maximum(tl.load(z), 1.0) / u
        dqs = _mm(ds, bk, DOT) * (1.0 / u) + _mm(dnum, S1t, DOT) * r
        dqs += _pair_grad(dnum, qs, h, offs_v, m_v, V, BK, OP, DOT) * r
        if NORMALIZE:  # dd is zero past the first V block; no branch, so that a pipelined loop loads Z2 ahead
            Z2 = tl.load(z + 1 + BK + offs_k[:, None] * BK + offs_k[None, :])
            dqs += dd[:, None] * (tl.load(z + 1 + offs_k)[None, :] + _mm(qs, Z2, 0))
        tl.store(dq + t[:, None] * H * K + offs_k[None, :], (dqs * scale).to(dq.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])


@triton.jit
def _dkv_kernel(q, k, v, do, den, dden, dk, dv, ds, dzs, scale, T, NC,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                BC: tl.constexpr, OP: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
                DV: tl.constexpr = True, DK: tl.constexpr = True, G: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """dv (DV) and dk (DK; dk [NV, B, T, H, K], sums over V blocks) of chunks i_g·G up to (i_g + 1)·G from the reverse
    states entering them."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_g, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    first = i_v == 0
    causal_t = offs_c[:, None] <= offs_c[None, :]  # [key j, query i]: j ≤ i
    q += i_b.to(tl.int64) * T * H * K + i_h * K
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    dk += (i_v * (tl.num_programs(2) // H) + i_b).to(tl.int64) * T * H * K + i_h * K
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    do += i_b.to(tl.int64) * T * H * V + i_h * V
    dv += i_b.to(tl.int64) * T * H * V + i_h * V
    if NORMALIZE:
        den += i_b.to(tl.int64) * T * H + i_h
        dden += i_b.to(tl.int64) * T * H + i_h
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
    for i_c in tl.range(i_g * G, tl.minimum(i_g * G + G, NC), num_stages=STAGES):
        t = i_c * BC + offs_c
        m_t = t < T
        h = ds + (i_bh.to(tl.int64) * NC + i_c) * R * V
        z = dzs + (i_bh.to(tl.int64) * NC + i_c) * ZR
        bq = tl.load(q + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bqt = tl.load(q + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        bk = tl.load(k + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bv = tl.load(v + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        dnum, dd = _load_dout(do, den, dden, t, m_t, offs_v, m_v, first, H, V, BC, NORMALIZE)
        qs = bq.to(tl.float32) * scale
        kf = bk.to(tl.float32)
        # fp16 (DOT 4): dO/den and dd times u, the chunk's `_dout_scale`, divided out of the fp32 results (elsewhere
        # u = 1, and the products by it fold away)
        u = 1.0
        if DOT == 4 and NORMALIZE:
            u = _dout_scale(den, i_c, T, BC, H)
        st = _mm(bk, bqt, DOT) * scale  # [BC keys, BC queries]
        if DV:
            wt = tl.where(causal_t, 1.0 + st + 0.5 * st * st, 0.0)
            D0 = tl.load(h + offs_v, mask=m_v, other=0.0).to(tl.float32)
            D1 = tl.load(h + (1 + offs_k)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
            bdv = _mm(wt, dnum * u, DOT) * (1.0 / u) + D0[None, :] + _mm(kf, D1, DOT)
            bdv += 0.5 * _order2_of(kf, h, offs_v, m_v, V, BK, OP, DOT)
            tl.store(dv + t[:, None] * H * V + offs_v[None, :], bdv.to(dv.dtype.element_ty),
                     mask=m_t[:, None] & m_v[None, :])
        if DK:
            # dO/den loaded again, transposed, rather than tl.trans(dnum): Triton 3.6 miscompiles the latter
            dnumt = tl.load(do + t[None, :] * H * V + offs_v[:, None], mask=m_v[:, None] & m_t[None, :], other=0.0)
            dnumt = dnumt.to(tl.float32)
            if NORMALIZE:
                dnumt = dnumt / tl.load(den + t * H, mask=m_t, other=1.0)[None, :]
            # (the order of these lines matters: with the D1t load first Triton 3.6 reads shared memory out of bounds)
            dpt = _mm(bv, dnumt * u, DOT) + (dd * u)[None, :]
            dst = tl.where(causal_t, dpt * (1.0 + st), 0.0)
            D1t = tl.load(h + (1 + offs_k)[None, :] * V + offs_v[:, None], mask=m_v[:, None], other=0.0)
            bdk = _mm(dst, qs, DOT) * (1.0 / u) + _mm(bv, D1t, DOT)
            bdk += _pair_grad(bv, kf, h, offs_v, m_v, V, BK, OP, DOT)
            # the denominator's reverse state, counted once (first V block), weighted by 0 or 1 rather than in a branch
            d2 = tl.load(z + 1 + BK + offs_k[:, None] * BK + offs_k[None, :])
            bdk += first.to(tl.float32) * (tl.load(z + 1 + offs_k)[None, :] + _mm(kf, d2, 0))
            tl.store(dk + t[:, None] * H * K + offs_k[None, :], bdk.to(dk.dtype.element_ty),
                     mask=m_t[:, None] & m_k[None, :])



@functools.cache
def _unpair_maps(K: int, order2: float):
    """The rows and weights taking pair-layout states back to the Taylor-order form, order 2 times order2."""
    rows, weights = pair_rows(K)
    inv = invert_rows(rows, K)
    scale = [1.0] * (1 + K) + [order2] * (K * K)
    return inv, tuple(s / weights[r] for s, r in zip(scale, inv)), invert_rows(padded_rows(K), K), tuple(scale)


def _to_pairs(hv: torch.Tensor, hz: torch.Tensor, K: int):
    """A Taylor-order state [B, H, F, V], [B, H, F] (order 2 symmetric) -> the pair and padded layouts [B·H, R, V],
    [B·H, ZR]."""
    return gather_rows(hv.flatten(0, 1), *pair_rows(K)), gather_rows(hz.flatten(0, 1), padded_rows(K))


def _from_pairs(h: torch.Tensor, z: torch.Tensor, K: int, B: int, H: int, order2: float = 1.0):
    """The inverse of `_to_pairs`, order 2 times order2: -> [B, H, F, V], [B, H, F]."""
    rows, weights, zrows, zweights = _unpair_maps(K, order2)
    return gather_rows(h, rows, weights).view(B, H, -1, h.shape[-1]), gather_rows(z, zrows, zweights).view(B, H, -1)


def _state_pass(x, w, scale: float, h0, z0, store_total: bool, reverse: bool, dot: int, g=None, den=None, o=None,
                cfg: SplitConfig = CONFIG):
    """The states entering every chunk: `_features_kernel`, then the walk over w (`_chain_kernel`, from the last chunk
    with reverse). Forward: x = k, w = v, g None. Reverse: x = q, w = dO; with den and o the walk runs over dO/den and
    dden is written into g. h0, z0: the starting state (pair / padded layouts) or None. Returns hs [B·H, NC, R, V],
    zs [B·H, NC, ZR] and with store_total the whole sums hT, zT (else None)."""
    B, T, H, K = x.shape
    V = w.shape[-1]
    BC, BV, NV, NC = _blocks(T, V, cfg.BV, cfg)
    dev = x.device
    dt = _state_dtype(dot)
    F = torch.empty(B * H, R_, T, device=dev, dtype=dt)
    zc = torch.empty(B * H, NC, ZR_, device=dev, dtype=torch.float32)
    wout = None if den is None else torch.empty(w.shape, device=dev, dtype=dt)
    launch(_features_kernel, (NC, B * H), x, g, F, zc, w, den, wout, o, scale, T, NC, H=H, K=K, V=V, BK=16, BC=BC,
           BW=max(16, next_power_of_2(V)), NPF=cfg.features_parts, DOT=dot, USE_G=g is not None,
           STORE_W=den is not None, DDEN=o is not None, num_warps=cfg.warps)
    hs = torch.empty(B * H, NC, R_, V, device=dev, dtype=dt)
    hT = torch.empty(B * H, R_, V, device=dev, dtype=torch.float32) if store_total else None
    zT = torch.empty(B * H, ZR_, device=dev, dtype=torch.float32) if store_total else None
    scaled_w = dot == 4 and den is not None
    # zc becomes the entering denominator states in place (the chain's first program per sequence)
    launch(_chain_kernel, (cdiv(R_, cfg.features_rows), NV, B * H), F, w if den is None else wout, hs, h0, hT, zc,
           z0, zT, den if scaled_w else None, T, NC, H=H, V=V, R=R_, RP=cfg.features_rows, BV=BV, BC=BC, ZR=ZR_,
           BZ=next_power_of_2(ZR_), USE_H0=h0 is not None, STORE_HT=store_total, DOT=dot,
           STAGES=cfg.features_stages, REVERSE=reverse, SCALED_W=scaled_w, num_warps=cfg.warps, maxnreg=None)
    return hs, zc, hT, zT


def forward(q, k, v, hv0, hz0, scale: float, output_final_state: bool, normalize: bool, cfg: SplitConfig = CONFIG):
    """(o, den, hvT, hzT, hs, zs): o, den fp32 (None unless normalize), the final state Taylor-order (or None, None)
    and the states entering every chunk, for `backward`. hv0/hz0: the initial state, Taylor-order, or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dot = forward_dot(q.dtype, K)
    h0, z0 = _to_pairs(hv0, hz0, K) if hv0 is not None else (None, None)
    hs, zs, hT, zT = _state_pass(k, v, 1.0, h0, z0, output_final_state, False, dot, cfg=cfg)
    BC, BV, NV, NC = _blocks(T, V, cfg.output_BV, cfg)
    o = torch.empty_like(v)
    den = torch.empty(B, T, H, device=q.device, dtype=torch.float32) if normalize else None
    G = cfg.output_chunks
    launch(_output_kernel, (cdiv(NC, G), NV, B * H), q, k, v, o, den, hs, zs, scale, T, NC, H=H, K=K, V=V, BK=16,
           BV=BV, BC=BC, OP=cfg.OP, NORMALIZE=normalize, DOT=dot, G=G, STAGES=cfg.output_stages,
           num_warps=cfg.warps, maxnreg=cfg.maxnreg)
    hvT, hzT = _from_pairs(hT, zT, K, B, H) if output_final_state else (None, None)
    return o, den, hvT, hzT, hs, zs


def backward(q, k, v, o, den, hv0, hz0, hs, zs, do, dhvT, dhzT, scale: float, normalize: bool,
             cfg: SplitConfig = CONFIG):
    """dq, dk, dv (in q's dtype) and the initial state's gradient (Taylor-order, or None) from the forward's inputs,
    o, den and entering states. dhvT/dhzT: the final state's gradient (Taylor-order) or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dot = forward_dot(q.dtype, K)
    do = do.contiguous()
    dhT, dzT = (None, None) if dhvT is None else _to_pairs(symmetrise_order2(dhvT, K), symmetrise_order2(dhzT, K), K)
    # the reverse state pass; normalised, the features kernel writes dden = -Σ_v dO·o / den into g
    g = torch.empty(B, T, H, device=q.device, dtype=torch.float32) if normalize else torch.zeros(
        B, T, H, device=q.device, dtype=torch.float32)
    ds, dzs, dh0, dz0 = _state_pass(q, do, scale, dhT, dzT, hv0 is not None, True, dot, g=g,
                                    den=den if normalize else None, o=o if normalize else None, cfg=cfg)
    dden = g if normalize else None
    # every chunk's dq, dv and dk at once; dv and dk in two launches, to halve what is live
    BC, BV, NV, NC = _blocks(T, V, cfg.BV, cfg)
    _, BVQ, NVQ, _ = _blocks(T, V, cfg.output_BV, cfg)
    dq = torch.empty(NVQ, B, T, H, K, device=q.device, dtype=q.dtype if NVQ == 1 else torch.float32)
    dk = torch.empty(NV, B, T, H, K, device=q.device, dtype=q.dtype if NV == 1 else torch.float32)
    dv = torch.empty_like(v)
    meta = dict(H=H, K=K, V=V, BK=16, BC=BC, OP=cfg.OP, NORMALIZE=normalize, DOT=dot, num_warps=cfg.warps,
                maxnreg=cfg.maxnreg)
    G = cfg.dq_chunks
    launch(_dq_kernel, (cdiv(NC, G), NVQ, B * H), q, k, v, do, den, dden, dq, hs, zs, scale, T, NC, BV=BVQ, G=G,
           STAGES=cfg.dq_stages, **meta)
    for G, stages, is_dv in ((cfg.dv_chunks, cfg.dv_stages, True), (cfg.dk_chunks, cfg.dk_stages, False)):
        launch(_dkv_kernel, (cdiv(NC, G), NV, B * H), q, k, v, do, den, dden, dk, dv, ds, dzs, scale, T, NC, BV=BV,
               G=G, STAGES=stages, DV=is_dv, DK=not is_dv, **meta)
    dq = dq[0] if NVQ == 1 else dq.sum(0)
    dk = dk[0] if NV == 1 else dk.sum(0)
    # what is left of the reverse states at t = 0 is the initial state's gradient, order 2 halved
    dhv0, dhz0 = _from_pairs(dh0, dz0, K, B, H, 0.5) if hv0 is not None else (None, None)
    return dq.to(q.dtype), dk.to(k.dtype), dv, dhv0, dhz0
