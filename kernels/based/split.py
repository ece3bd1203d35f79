"""The forward of `chunk_based` as two kernels with no serial output chain: states first, then outputs.

The fused forward (`chunk._fwd_kernel`) walks each sequence in chunks and carries the Taylor-order state in
registers, so one program per (sequence, V block) runs a chain of T/BC dependent steps, each with the state
update, the state read and the intra-chunk tile (experiments/LOG.md: register-bound at 255 registers, ≈ 6 µs
per step on the H200). This split forward separates them:

1. The state pass stores the state that enters every chunk, hs[b·h, c] (the exclusive prefix). By default
   (CONFIG["features"], since session 11) in two launches: `_features_kernel`, grid (chunks, B·H), writes every
   token's key features feature-major (F [B·H, R, T]) and every chunk's own denominator sums, fully parallel;
   then `_chain_kernel`, grid (row parts, V blocks, B·H), walks the chunks with one load and one dot per step,
   hs[c + 1] = hs[c] + F[:, c]·v[c], and turns the denominator sums into entering states on the way. With
   features off, `_state_kernel`, grid (NP + 1 row parts, V blocks, B·H), builds the features inside the walk:
   part p < NP holds 1/NP of the order-2 pair rows, part NP orders 0, 1 and the order-2 diagonal.
2. `_output_kernel`, grid (chunks, V blocks, B·H): every chunk at once, from its entering state:
   o = w·v (the causal tile, w = 1 + s + s²/2) + φ(q)·hs[c], and the same for the denominator.

The state rows use the pair layout of `chunk.py`'s mode 3 (R = 1 + 2·BK + BK²/2 rows: order 0, order 1 [BK],
the order-2 diagonal [BK], then one row per unordered pair, cyclic, with weights 2 or 1), stored in the dot's
operand dtype (bf16 for bf16 inputs, where the fused kernel rounds the state to bf16 at every read too; fp16 for
fp16 inputs, as S/n with n the tokens summed, see `_chain_kernel`; fp32 otherwise). The denominator's state
(n, z1, Z2 [BK, BK]) is kept in fp32, in the Taylor-order layout. States cross the boundary in the Taylor-order
layout of `chunk.py` ([1 + K + K², V]), converted here in PyTorch.

Traffic: the entering states are B·H·(T/BC)·R·V elements, written once and read once: at B=8, H=16, T=4096,
K=16, V=64, BC=64 in bf16, 169 MB each way (≈ 40 µs at the H200's 4.2 TB/s), against ≈ 30 MB for q, k, v, o.
Larger BC trades that for a bigger causal tile.

Selected by `chunk.FORWARD` ("split", or "auto", the default: where a split backward will follow, whose state
pass it then saves). The backward has the same shape (`split_backward`, selected by `chunk.BACKWARD`, "auto" by
default: bf16/fp16, K ≤ 16, 32 < V ≤ 128): the forward's entering states (kept, or computed again), a reverse
state pass over (q, dO/den), then every chunk's dq and dk, dv at once.

Measured on the H200 (session 8, B=8, H=16, T=4096, K=16, V=64, bf16; `experiments/bench/based_kernels.py
--split-sweep`): the split forward 0.50 ms (state pass 0.31, output pass 0.19) against the fused 0.385, so the
forward stays fused; the fused forward with the split backward 1.80 ms forward+backward against 2.25 fused.
The state pass is not bound by its chain: walking each sequence in NS segments at once (CONFIG["NS"]; a first
launch sums each segment, a cumsum over segments gives the entering states, a second launch walks the segments
from them) made it slower at every NS (0.42-0.61 ms for NS = 2-16), as its 3 programs per SM already fill the
GPU; loading the next chunk while summing this one (CONFIG["prefetch"]) saved 8%. Session 9 (Nsight Compute: 2
programs of 4 warps per SM, waiting on loads): register caps, OP=2, the states kept from forward to backward and
a pipelined output pass brought forward+backward to 1.59 ms (split forward 0.44: state pass 0.30, output 0.14);
session 10, the dv launch pipelined, to 1.54 ms (chunk gradients 0.745 -> 0.689). Session 10 also measured what
does not help the state passes: a per-chunk scan, Triton's pipelined loop, and fewer stored states (blocks of
2-8 chunks, the state pass 0.30 -> 0.28 ms while the output pass doubled): a step costs ≈ 4.4 µs of latency inside
the step (ncu: loads behind shared-memory traffic and layout changes), with or without its store. Session 11: the
features computed first (CONFIG["features"]) take the state pass to 0.23 ms and the reverse to 0.26, and with the
dq/dk reductions and the cumsum ops gone forward+backward is 1.27 ms; the split forward, 0.37 ms, now edges out
the fused one (0.38). Nsight Compute: the chain walk runs at 70% of DRAM bandwidth (3.4 TB/s), the features
kernel at 35-49% of DRAM and 73-82% of L1 (its layout changes), so the state passes are near their traffic.
"""

import torch
import triton
import triton.language as tl

from kernels.based.chunk import _load_dout, _mm, _pair_contract, _pairs
from kernels.launch import cdiv, launch, next_power_of_2

# Launch settings of the split kernels; the GPU sweep of experiments/bench/based_kernels.py varies them.
# NP, NS, prefetch, gather (in the state passes), state_warps, state_maxnreg, state_stages and scan shape the state
# passes' walk with the features computed inside it, which runs with features off (the default since session 11).
# H200 (session 8): NP=2 and the one-chunk-ahead load were fastest (fused forward + split backward 1.74 ms at the
# benchmark shape with OP=2, 1.80 ms with OP=4); session 9: OP=2 with 168-register caps 1.70 ms (128-register caps
# spill: 2.23 ms; output_BV=32: 1.83 ms); OP=2 spills 24 B under Triton 3.9 (the caps more); segments (NS > 1)
# were slower (the state passes already fill the GPU, so NS× more programs only add the second walk); BV=32 faults
# in the backward on Triton 3.6 (an out-of-bounds shared-memory read, compute-sanitizer), so the value block
# stays 64.
# gather: the pair features from `tl.gather` instead of dots with 0/1 matrices (`chunk._pairs`; not yet timed).
# state_maxnreg / output_maxnreg / grads_maxnreg: a register cap per thread (Triton's `maxnreg`, None: the
# compiler's choice) for the state passes, the output pass and the dq/dk/dv kernels: at 4 warps, 168 registers let
# 3 programs share an SM and 128 let 4 (ncu, session 9: every split kernel ran at 2 programs, 8 warps, per SM).
# output_BV: the value block of the output pass and the dq kernel (the states are stored at full V, so it need not
# be the state passes' BV; the dk/dv kernel keeps BV, see above).
# output_chunks / output_stages (the output pass), dq_chunks / dq_stages, dv_chunks / dv_stages and dk_chunks /
# dk_stages (the dk/dv kernel's two launches; with dkv_apart off, its one launch takes dk_*): each program takes that
# many chunks of a sequence, one after another, with stages > 1 loading the next chunk's inputs during this one's
# dots (Triton's pipelined loop): ncu (session 9) found these kernels waiting mostly on loads.
# Session 9: the output pass 0.190 ms -> 0.164 at 2 chunks, 2 stages and 0.143 at 8 chunks, 3 stages (the default).
# Session 10 (H200, Triton 3.6, T=4096; chunk grads = dq + dv + dk): unpipelined 0.745 ms; dv at 4 chunks, 2 stages
# 0.689 (the default; gradients bit-identical); dk at 4/2 alone 0.733 (right), dq at 4/2 0.739 (right); dv and dk
# both at 4/2 (session 9's one knob) gave gradients off by 1.6, and dk at SB=4 (a trial of states kept per block of
# chunks, since removed) read shared memory out of bounds (compute-sanitizer), so dk stays unpipelined.
# state_stages: the state passes' chunk walk as a pipelined loop (with prefetch off). Session 10: slower (state pass
# 0.331 ms against 0.299 with prefetch, reverse 0.391 against 0.345).
# scan: the state passes as every chunk's own sum at once (one program per chunk and row part, no chain of dots)
# followed by an in-place exclusive prefix over the chunks (`_prefix_kernel`: a load, an add and a store per step,
# fp32 sums, one slot loaded ahead), instead of one walk that sums with dots as it goes. Session 10: slower (state
# pass 0.317 ms against 0.299, reverse 0.394 against 0.345; 0.346 / 0.417 at NP=1): the per-chunk launch alone
# costs about what the walk does, and the prefix's traffic (169 MB each way) comes on top.
# features (features_rows, features_stages, features_maxnreg): both state passes as a fully parallel kernel that
# stores the features feature-major (`_features_kernel`: of the keys; for the reverse pass of the scaled queries,
# with dden as the denominator sums' weights) and a walk that is one load and one dot per step over them
# (`_chain_kernel`, over v or dO/den, rows in parts of features_rows, a pipelined loop of features_stages). Session
# 10: a minimal kernel of that walk took 1.2-1.5 µs per step on the H200 against the state pass's 4.6. Session 11
# (H200, Triton 3.6, T=4096): state pass 0.300 -> 0.260 ms, reverse 0.346 -> 0.300, forward+backward 1.539 -> 1.458
# (the default since); features_rows=32 0.274 / 0.313, features_stages 2 or 4 0.272-0.274 / 0.313, a 168-register
# cap the same (0.261 / 0.300). It trades the walk's latency for traffic: at that shape F is 169 MB, written once
# and read once, each row part reads v again, and the states are stored: ≈ 0.72 GB, 0.17 ms at the copy ceiling.
# features_gather: the features kernel's pair rows by `tl.gather` (as gather above) instead of dots with 0/1
# matrices (session 11: split forward 0.358 ms against 0.370, forward+backward 1.277 against 1.263, one run).
# features_parts (1, 2, 4 or 8: the pair rows built in that many parts, fewer live at a time) and features_warps:
# the features kernel, which ncu (session 11) found at 150-160 registers and 3 programs per SM, bound by L1 traffic
# (its layout changes) rather than DRAM (34-49%). Session 12 (H200, T=4096, one run): parts 1 0.390 / 1.323 ms
# (split forward / forward+backward), 4 0.373 / 1.273, 8 0.379 / 1.287, against 2 0.372 / 1.270 (and 0.372 / 1.273
# at the sweep's end); 8 warps 0.385 / 1.318; gather 0.359 / 1.254 (gather with 4 parts 0.361 / 1.258).
# Also session 12: the features kernel reading x transposed ([B, H, K, T], a PyTorch copy first) with every feature
# row a contiguous row load in the store's layout (no layout change in registers): 0.412 / 1.353 ms against 0.371 /
# 1.265 (two runs each; removed). chain_warps: the chain walk's warps. fuse_dden: the reverse pass's features kernel
# computes dden (`chunk._dden_kernel`'s values) from the dO and den it loads anyway, plus o, instead of that launch
# (the backward then passes o and an empty dden). Session 12 (two runs each, forward+backward ms): the defaults then
# (rows of 64, dden launched) 1.279 / 1.281, fuse_dden 1.271 / 1.277, features_rows=128 1.268 / 1.496 (an outlier),
# both 1.264 / 1.265 (the defaults since: 2 row parts instead of 3, so v is read twice per step, not three times);
# one run each: rows of 256 at 8 warps 1.263, 8 warps 1.281. The table's T=4096 row: 1.262 eager, 1.250 graphed.
CONFIG = {"BC": 64, "BV": 64, "NP": 2, "OP": 2, "NS": 1, "prefetch": True, "gather": False, "state_warps": 4,
          "output_warps": 4, "dkv_apart": True, "state_maxnreg": 168, "output_maxnreg": 168, "grads_maxnreg": 168,
          "output_BV": 64, "output_chunks": 8, "output_stages": 3, "dq_chunks": 1, "dq_stages": 1,
          "dv_chunks": 4, "dv_stages": 2, "dk_chunks": 1, "dk_stages": 1, "scan": False, "state_stages": 1,
          "features": True, "features_rows": 128, "features_stages": 3, "features_maxnreg": None,
          "features_gather": False, "features_parts": 2, "features_warps": 4, "chain_warps": 4, "fuse_dden": True}


def _state_dtype(dot: int) -> torch.dtype:
    """The stored features and states' dtype: the dots' operand dtype (bf16, fp16), fp32 for tf32 / fp32 dots."""
    return {2: torch.bfloat16, 4: torch.float16}.get(dot, torch.float32)


def takes_fp16(dot: int) -> int:
    """The split kernels' DOT for `chunk`'s `dot`: fp16 operands (DOT 4) only on the default path of stored features
    with one segment and no scan (the paths whose kernels scale what they carry into fp16's range, `_chain_kernel`);
    elsewhere tf32 (DOT 1)."""
    if dot == 4 and not (CONFIG["features"] and CONFIG["NS"] == 1 and not CONFIG["scan"]):
        return 1
    return dot


@triton.jit
def _dout_scale(den, c, T, BC: tl.constexpr, H: tl.constexpr):
    """The factor that fp16 operands (DOT 4) carry dO/den and its products in for chunk c: the smallest |den| of the
    chunk's tokens (den at the sequence, [T, H] strides). den grows like the tokens summed, so dO/den falls far below
    dO and, in fp16, into subnormals and zero; times this factor it is at most dO's size (a min, not the first
    token's den, since den can vary a lot inside a chunk: large scores make some w huge). Every kernel that scales
    or unscales computes it from the same values, and a min is exact in any order."""
    t = c * BC + tl.arange(0, BC)
    d = tl.load(den + t * H, mask=t < T, other=float("inf"))
    return tl.maximum(tl.min(tl.abs(d), 0), 1e-30)


def _pair_index(BK: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pair rows j = (d-1)·BK + a, d = 1..BK/2: a_j, b_j = (a_j + d) mod BK, weight w_j and validity (a, b < K)."""
    j = torch.arange(BK * BK // 2, device=device)
    d = 1 + j // BK
    a = j % BK
    b = (a + d) % BK
    w = torch.where(d < BK // 2, 2.0, 1.0)
    return a, b, w, (a < K) & (b < K)


def orders_to_pairs(h: torch.Tensor, K: int, BK: int) -> torch.Tensor:
    """A Taylor-order state [N, 1 + K + K², C] (order-2 rows (a, b) at 1 + K + a·K + b) -> the pair layout
    [N, 1 + 2·BK + BK²/2, C]: order 0, order 1, the diagonal, then pair row j = h_(a,b) + h_(b,a) where w_j = 2
    and h_(a,b) where w_j = 1 (the mirror has its own row); rows past K are zero."""
    N, _, C = h.shape
    a, b, w, ok = _pair_index(BK, K, h.device)
    o2 = h[:, 1 + K :].reshape(N, K, K, C)
    out = h.new_zeros(N, 1 + 2 * BK + BK * BK // 2, C)
    out[:, : 1 + K] = h[:, : 1 + K]
    idx = torch.arange(K, device=h.device)
    out[:, 1 + BK + idx] = o2[:, idx, idx]
    a, b, w = a[ok], b[ok], w[ok].to(h.dtype)
    out[:, 1 + 2 * BK + ok.nonzero()[:, 0]] = o2[:, a, b] + (w > 1.5).to(h.dtype)[:, None] * o2[:, b, a]
    return out


def pairs_to_orders(p: torch.Tensor, K: int, BK: int) -> torch.Tensor:
    """Inverse of `orders_to_pairs` for symmetric order-2 states: [N, 1 + 2·BK + BK²/2, C] -> [N, 1 + K + K², C]."""
    N, _, C = p.shape
    a, b, w, ok = _pair_index(BK, K, p.device)
    o2 = p.new_zeros(N, K, K, C)
    idx = torch.arange(K, device=p.device)
    o2[:, idx, idx] = p[:, 1 + BK + idx]
    x = p[:, 1 + 2 * BK + ok.nonzero()[:, 0]] / w[ok].to(p.dtype)[:, None]
    a, b, two = a[ok], b[ok], w[ok] > 1.5
    o2[:, a, b] = x
    o2[:, b[two], a[two]] = x[:, two]
    return torch.cat([p[:, : 1 + K], o2.reshape(N, K * K, C)], dim=1)


def _pad_orders(z: torch.Tensor, K: int, BK: int) -> torch.Tensor:
    """A Taylor-order vector [N, 1 + K + K²] -> [N, 1 + BK + BK²], zeros in the rows past K."""
    N = z.shape[0]
    out = z.new_zeros(N, 1 + BK + BK * BK)
    out[:, : 1 + K] = z[:, : 1 + K]
    out[:, 1 + BK :].view(N, BK, BK)[:, :K, :K] = z[:, 1 + K :].reshape(N, K, K)
    return out


def _unpad_orders(z: torch.Tensor, K: int, BK: int) -> torch.Tensor:
    """Inverse of `_pad_orders`."""
    N = z.shape[0]
    return torch.cat([z[:, : 1 + K], z[:, 1 + BK :].reshape(N, BK, BK)[:, :K, :K].reshape(N, K * K)], dim=1)


@triton.jit
def _init_head(h, z, i_bh, LOAD: tl.constexpr, offs_k, offs_v, m_v, first, V: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr):
    """Order 0, order 1 and the order-2 diagonal of a pair-layout state, and the denominator's (n, z1, Z2): zero,
    plus with LOAD what sequence i_bh's rows of h [B·H, R, V] and, in the first V block, of z [B·H, ZR] hold (h and
    z may be None without LOAD). The state passes' row part NP."""
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
    S0 = tl.zeros([BV], dtype=tl.float32)
    S1 = tl.zeros([BK, BV], dtype=tl.float32)
    Sd = tl.zeros([BK, BV], dtype=tl.float32)
    n = 0.0
    z1 = tl.zeros([BK], dtype=tl.float32)
    Z2 = tl.zeros([BK, BK], dtype=tl.float32)
    if LOAD:
        h += i_bh.to(tl.int64) * R * V
        z += i_bh.to(tl.int64) * ZR
        S0 += tl.load(h + offs_v, mask=m_v, other=0.0)
        S1 += tl.load(h + (1 + offs_k)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
        Sd += tl.load(h + (1 + BK + offs_k)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
        if first:  # the denominator's state is kept (and stored) by the first V block only
            n += tl.load(z)
            z1 += tl.load(z + 1 + offs_k)
            Z2 += tl.load(z + 1 + BK + offs_k[:, None] * BK + offs_k[None, :])
    return S0, S1, Sd, n, z1, Z2


@triton.jit
def _store_head(h, z, S0, S1, Sd, n, z1, Z2, offs_k, offs_v, m_v, first, V: tl.constexpr, BK: tl.constexpr):
    """Store order 0, order 1 and the order-2 diagonal rows of a pair-layout state at h (cast to its dtype), and,
    in the first V block, the denominator's (n, z1, Z2) at z: the state passes' row part NP."""
    tl.store(h + offs_v, S0.to(h.dtype.element_ty), mask=m_v)
    tl.store(h + (1 + offs_k)[:, None] * V + offs_v[None, :], S1.to(h.dtype.element_ty), mask=m_v[None, :])
    tl.store(h + (1 + BK + offs_k)[:, None] * V + offs_v[None, :], Sd.to(h.dtype.element_ty), mask=m_v[None, :])
    if first:
        tl.store(z, n)
        tl.store(z + 1 + offs_k, z1)
        tl.store(z + 1 + BK + offs_k[:, None] * BK + offs_k[None, :], Z2)


@triton.jit
def _load_kt_v(k, v, c, T, offs_c, offs_k, offs_v, m_k, m_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BC: tl.constexpr):
    """Chunk c's keys, transposed [BK, BC], and values [BC, BV] (zero past T, and for c past the last chunk)."""
    t = c * BC + offs_c
    m_t = t < T
    bkt = tl.load(k + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
    bv = tl.load(v + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    return bkt, bv


@triton.jit
def _load_k(k, c, T, offs_c, offs_k, m_k, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """Chunk c's keys [BC, BK] (zero past T)."""
    t = c * BC + offs_c
    return tl.load(k + t[:, None] * H * K + offs_k[None, :], mask=(t < T)[:, None] & m_k[None, :], other=0.0)


@triton.jit
def _state_kernel(k, v, hs, zs, h0, z0, hT, zT, T, NC, CPS,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  BC: tl.constexpr, NP: tl.constexpr, NS: tl.constexpr, USE_H0: tl.constexpr,
                  STORE_HS: tl.constexpr, STORE_HT: tl.constexpr, DOT: tl.constexpr, PREFETCH: tl.constexpr,
                  GATHER: tl.constexpr = False, STAGES: tl.constexpr = 1):
    """Row part i_p of the state of sequence i_bh, value block i_v, over segment i_s of NS (chunks i_s·CPS up to
    (i_s + 1)·CPS): with STORE_HS, hs[i_bh, c] = h0 + Σ over the segment's chunks before c; with STORE_HT, what the
    segment adds on top of h0, in hT. With PREFETCH the next chunk's loads are issued before this one is summed
    (more registers), otherwise after; STAGES > 1 leaves it to Triton's pipelined loop instead (the loads of the
    next STAGES - 1 chunks in flight, straight into shared memory; meant with PREFETCH off).

    hs: [B·H, NC, R, V] (operand dtype), h0/hT: [B·H·NS, R, V] fp32 (pair layout, one per segment); zs: [B·H,
    NC, ZR], z0/zT: [B·H·NS, ZR] fp32, the denominator's state in the Taylor-order layout at BK (n, z1 [BK],
    Z2 [BK, BK])."""
    i_p, i_v, i_bs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh, i_s = i_bs // NS, i_bs % NS
    i_b, i_h = i_bh // H, i_bh % H
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
    JP: tl.constexpr = BK * (BK // 2) // NP
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    first = i_v == 0
    c0 = i_s * CPS
    c1 = tl.minimum(c0 + CPS, NC)
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    hs += i_bh.to(tl.int64) * NC * R * V
    zs += i_bh.to(tl.int64) * NC * ZR
    if PREFETCH:
        bkt, bv = _load_kt_v(k, v, c0, T, offs_c, offs_k, offs_v, m_k, m_v, H, K, V, BC)
    if i_p < NP:
        rows = 1 + 2 * BK + i_p * JP + tl.arange(0, JP)
        S = tl.zeros([JP, BV], dtype=tl.float32)
        if USE_H0:
            S += tl.load(h0 + i_bs.to(tl.int64) * R * V + rows[:, None] * V + offs_v[None, :], mask=m_v[None, :],
                         other=0.0)
        for c in tl.range(c0, c1, num_stages=STAGES):
            if STORE_HS:
                tl.store(hs + c * R * V + rows[:, None] * V + offs_v[None, :], S.to(hs.dtype.element_ty),
                         mask=m_v[None, :])
            if PREFETCH:
                nkt, nv = _load_kt_v(k, v, c + 1, T, offs_c, offs_k, offs_v, m_k, m_v, H, K, V, BC)
            else:
                bkt, bv = _load_kt_v(k, v, c, T, offs_c, offs_k, offs_v, m_k, m_v, H, K, V, BC)
            S += _mm(_pairs(bkt.to(tl.float32), BK, DOT, i_p, NP, True, GATHER), bv, DOT)  # [JP, BC] pair features · v
            if PREFETCH:
                bkt, bv = nkt, nv
        if STORE_HT:
            tl.store(hT + i_bs.to(tl.int64) * R * V + rows[:, None] * V + offs_v[None, :], S, mask=m_v[None, :])
    else:
        S0, S1, Sd, n, z1, Z2 = _init_head(h0, z0, i_bs, USE_H0, offs_k, offs_v, m_v, first, V, BK, BV)
        for c in tl.range(c0, c1, num_stages=STAGES):
            if STORE_HS:
                _store_head(hs + c * R * V, zs + c * ZR, S0, S1, Sd, n, z1, Z2, offs_k, offs_v, m_v, first, V, BK)
            if PREFETCH:
                nkt, nv = _load_kt_v(k, v, c + 1, T, offs_c, offs_k, offs_v, m_k, m_v, H, K, V, BC)
            else:
                bkt, bv = _load_kt_v(k, v, c, T, offs_c, offs_k, offs_v, m_k, m_v, H, K, V, BC)
            kft = bkt.to(tl.float32)
            S0 += tl.sum(bv.to(tl.float32), 0)
            S1 += _mm(kft, bv, DOT)
            Sd += _mm(kft * kft, bv, DOT)
            n += tl.sum(((c * BC + offs_c) < T).to(tl.float32), 0)
            if first:
                z1 += tl.sum(kft, 1)
                if DOT == 0 or DOT == 3:  # fp32 inputs: exact fp32, as the fused kernel's denominator; k loaded
                    # again untransposed, because Triton 3.6 computed dot(x, trans(x)) of an fp32 tile wrongly on
                    # the H200 (session 8)
                    Z2 += _mm(kft, _load_k(k, c, T, offs_c, offs_k, m_k, H, K, BC).to(tl.float32), 0)
                else:
                    Z2 += _mm(kft, tl.trans(kft), 0)
            if PREFETCH:
                bkt, bv = nkt, nv
        if STORE_HT:
            _store_head(hT + i_bs.to(tl.int64) * R * V, zT + i_bs.to(tl.int64) * ZR, S0, S1, Sd, n, z1, Z2, offs_k,
                        offs_v, m_v, first, V, BK)

@triton.jit
def _output_kernel(q, k, v, o, den, hs, zs, scale, T, NC,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   BC: tl.constexpr, OP: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
                   GATHER: tl.constexpr = False, G: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """Chunks i_g·G up to (i_g + 1)·G of sequence i_bh, value block i_v, one after another (with STAGES > 1 the
    next chunk's loads are in flight during this one's dots): the causal tile plus the read of the entering state
    (the order-2 pair rows in OP parts, so that one part's [BC, J/OP] pair features are live at a time)."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_g, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    JP: tl.constexpr = BK * (BK // 2) // OP
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_j = tl.arange(0, JP)
    m_k, m_v = offs_k < K, offs_v < V
    causal = offs_c[:, None] >= offs_c[None, :]
    q += i_b.to(tl.int64) * T * H * K + i_h * K
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    o += i_b.to(tl.int64) * T * H * V + i_h * V
    for i_c in tl.range(i_g * G, tl.minimum(i_g * G + G, NC), num_stages=STAGES):
        _output_chunk(q, k, v, o, den, hs, zs, scale, T, NC, i_c, i_b, i_h, i_bh, i_v, offs_c, offs_k, offs_v,
                      offs_j, m_k, m_v, causal, H, K, V, BK, BV, BC, OP, NORMALIZE, DOT, GATHER)


@triton.jit
def _output_chunk(q, k, v, o, den, hs, zs, scale, T, NC, i_c, i_b, i_h, i_bh, i_v, offs_c, offs_k, offs_v, offs_j,
                  m_k, m_v, causal, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, BC: tl.constexpr, OP: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
                  GATHER: tl.constexpr):
    """`_output_kernel`'s chunk i_c (pointers already at the sequence)."""
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
    JP: tl.constexpr = BK * (BK // 2) // OP
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
    Sd = tl.load(h + (1 + BK + offs_k)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
    o2 = _mm(qs * qs, Sd, DOT)
    for p in tl.static_range(OP):
        S2 = tl.load(h + (1 + 2 * BK + p * JP + offs_j)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
        o2 += _mm(_pairs(qs, BK, DOT, p, OP, False, GATHER), S2, DOT)
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
def _prefix_kernel(x, x0, xT, NC, W, REVERSE: tl.constexpr, USE_X0: tl.constexpr, STORE_XT: tl.constexpr,
                   BW: tl.constexpr):
    """In place along the chunk axis of x [N, NC, W] (columns i_w·BW up to (i_w + 1)·BW of row i_n): slot c
    becomes x0 + Σ_{c' < c} x[c'] (with REVERSE, Σ_{c' > c}), summed in fp32 and stored in x's dtype; xT [N, W]
    (fp32) gets x0 + the whole sum. x0: [N, W] fp32 (USE_X0). The state passes' second step under CONFIG["scan"]:
    the per-chunk sums come from a fully parallel launch, and what stays serial is a load, an add and a store (the
    next slot's load issued before this one's store)."""
    i_w, i_n = tl.program_id(0), tl.program_id(1)
    offs = i_w * BW + tl.arange(0, BW)
    m = offs < W
    x += i_n.to(tl.int64) * NC * W
    acc = tl.zeros([BW], dtype=tl.float32)
    if USE_X0:
        acc += tl.load(x0 + i_n.to(tl.int64) * W + offs, mask=m, other=0.0)
    step = -1 if REVERSE else 1
    c = NC - 1 if REVERSE else 0
    d = tl.load(x + c * W + offs, mask=m, other=0.0).to(tl.float32)
    for i in range(NC):
        nd = tl.load(x + (c + step) * W + offs, mask=m & (offs * 0 + i + 1 < NC), other=0.0).to(tl.float32)
        tl.store(x + c * W + offs, acc.to(x.dtype.element_ty), mask=m)
        acc += d
        d = nd
        c += step
    if STORE_XT:
        tl.store(xT + i_n.to(tl.int64) * W + offs, acc, mask=m)


def _prefix(x: torch.Tensor, x0, reverse: bool, store_total: bool):
    """`_prefix_kernel` over x [N, NC, ...] (contiguous) in place, from x0 [N, ...] (fp32) or zero; returns the total
    [N, ...] (fp32) or None."""
    N, NC = x.shape[:2]
    W = x[0, 0].numel()
    xT = torch.empty(N, *x.shape[2:], device=x.device, dtype=torch.float32) if store_total else None
    BW = min(1024, next_power_of_2(W))
    launch(_prefix_kernel, (cdiv(W, BW), N), x, x0, xT, NC, W, REVERSE=reverse, USE_X0=x0 is not None,
           STORE_XT=store_total, BW=BW, num_warps=4)
    return xT


def _blocks(T: int, V: int, BV: int | None = None) -> tuple[int, int, int, int]:
    """(BC, BV, NV, NC) of CONFIG at length T and value width V: chunk, value block (CONFIG["BV"] unless given),
    their counts."""
    BC = CONFIG["BC"]
    BV = min(CONFIG["BV"] if BV is None else BV, max(16, next_power_of_2(V)))
    return BC, BV, cdiv(V, BV), cdiv(T, BC)


def _segments(NC: int) -> tuple[int, int]:
    """(NS, CPS): CONFIG["NS"] segments per sequence, at most one per chunk, of CPS chunks each (the last shorter)."""
    CPS = cdiv(NC, max(1, min(CONFIG["NS"], NC)))
    return cdiv(NC, CPS), CPS


def _exclusive_carry(tot: torch.Tensor, start, reverse: bool) -> torch.Tensor:
    """tot [N, NS, ...] (each segment's sum) -> the state entering each segment: start (None: zero) plus the sum of
    the segments before it (after it, with reverse), in fp32."""
    carry = torch.zeros_like(tot)
    if reverse:
        carry[:, :-1] = tot[:, 1:].flip(1).cumsum(1).flip(1)
    else:
        carry[:, 1:] = tot[:, :-1].cumsum(1)
    if start is not None:
        carry += start[:, None]
    return carry


@triton.jit
def _features_kernel(k, g, F, zc, w, den, wout, o, scale, T, NC, H: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, NPF: tl.constexpr,
                     DOT: tl.constexpr, USE_G: tl.constexpr, STORE_W: tl.constexpr, GATHER: tl.constexpr = False,
                     DDEN: tl.constexpr = False):
    """CONFIG["features"]: chunk i_c of sequence i_bh's features of x = scale·k (k: the keys, or the queries for the
    reverse pass), feature-major, in the state's pair-layout row order (F [B·H, R, T] in the operand dtype: 1, x_a,
    x_a², then w_j·x_{a_j}·x_{b_j}, the products exact in fp32 before the one rounding the dot would apply), and the
    chunk's own denominator sums with per-token weights g (zc [B·H, NC, ZR] fp32: Σ g, Σ x g, Σ x xᵀ g; g = dden
    [B, T, H] with USE_G, else 1 per token: the count, Σ k, Σ k kᵀ). With STORE_W also the walk's other operand for
    the reverse pass, wout = w / den (dO/den, [B, T, H, V] in F's dtype; BW ≥ V). Fully parallel: what the state
    walk then does per step is one load and one dot. With DDEN (and STORE_W) the weights g are computed here rather
    than loaded, g = dden = -Σ_v dO·o / den (`chunk._dden_kernel`'s values), and stored to g for the gradient
    kernels: dO and den are loaded here anyway, so this saves that launch and its second read of dO."""
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
        pairs = _pairs(kft, BK, DOT, p, NPF, True, GATHER)
        tl.store(F + rows[:, None] * T + t[None, :], pairs.to(dt), mask=m_t[None, :])
    tl.store(zc, tl.sum(gt, 0))
    tl.store(zc + 1 + offs_k, tl.sum(kft * gt[None, :], 1))
    # x loaded again untransposed for Σ x xᵀ g in exact fp32 (as Z2 in `_state_kernel`)
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
    """CONFIG["features"]: rows i_p·RP up to (i_p + 1)·RP of sequence i_bh's state, value block i_v, walked over
    the chunks from the features `_features_kernel` stored: hs[i_bh, c] = h0 + Σ_{c' < c} F[:, c'] v[c'] (with
    REVERSE, Σ_{c' > c}: the reverse pass, v = dO/den) and the whole sum in hT (fp32), one load and one dot per
    step, Triton's pipelined loop loading STAGES - 1 chunks ahead. Every row is alike here, so the row parts need
    not follow the layout's orders. The first program of each sequence (row part 0, value block 0) also turns the
    chunks' own denominator sums zc [B·H, NC, ZR] (fp32) into the entering ones in place, from z0, with the whole
    sum in zT (the other programs' masks are empty): no launch or PyTorch op of its own.

    fp16 operands (DOT 4) keep what they carry in fp16's range: the forward walk stores hs[c] / max(n_c, 1), n_c the
    tokens summed (n0 + c·BC, n0 the initial state's count), as the fused forward reads its state; the reverse walk
    (SCALED_W) takes dO/den times the chunk's `_dout_scale` from the features kernel and divides it out of each step's
    dot. Its stored states are sums of dO/den over the later tokens, of dO's own size, and stay unscaled."""
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


def _features_walk(x, g, w, scale: float, h0, z0, store_total: bool, reverse: bool, dot: int, den=None, o=None):
    """A state pass under CONFIG["features"]: the features of scale·x and each chunk's denominator sums (weights g
    [B, T, H] fp32, or None: 1 per token) at once (`_features_kernel`), the walk over w [B, T, H, V] as one load and
    one dot per step (`_chain_kernel`, from the last chunk with reverse), which also sums the denominator's
    entering states over the chunks (fp32). The forward: x = k, w = v; the reverse: x = q (times scale), w = dO,
    g = dden, den the forward's denominator (the walk then runs over dO/den, which the features kernel stores).
    h0, z0: the state the walk starts from, pair / padded Taylor-order layouts, or None. o: the forward's output,
    with den: the features kernel then computes g = dden itself and fills g (an empty [B, T, H] fp32) with it.
    Returns (hs, zs, hT, zT) as `state_pass` does (hT, zT: the whole sums, or None)."""
    B, T, H, K = x.shape
    V = w.shape[-1]
    BK = 16
    BC, BV, NV, NC = _blocks(T, V)
    R, ZR = 1 + 2 * BK + BK * BK // 2, 1 + BK + BK * BK
    dev = x.device
    dt = _state_dtype(dot)
    F = torch.empty(B * H, R, T, device=dev, dtype=dt)
    zc = torch.empty(B * H, NC, ZR, device=dev, dtype=torch.float32)
    wout = None if den is None else torch.empty(w.shape, device=dev, dtype=dt)
    launch(_features_kernel, (NC, B * H), x, g, F, zc, w, den, wout, o, scale, T, NC, H=H, K=K, V=V, BK=BK, BC=BC,
           BW=max(16, next_power_of_2(V)), NPF=CONFIG["features_parts"], DOT=dot,
           USE_G=g is not None, STORE_W=den is not None, GATHER=CONFIG["features_gather"],
           DDEN=o is not None, num_warps=CONFIG["features_warps"])
    w = w if den is None else wout
    hs = torch.empty(B * H, NC, R, V, device=dev, dtype=dt)
    hT = torch.empty(B * H, R, V, device=dev, dtype=torch.float32) if store_total else None
    zT = torch.empty(B * H, ZR, device=dev, dtype=torch.float32) if store_total else None
    RP = CONFIG["features_rows"]
    # zc becomes the entering denominator states in place (the chain's first program per sequence)
    scaled_w = dot == 4 and den is not None
    launch(_chain_kernel, (cdiv(R, RP), NV, B * H), F, w, hs, h0, hT, zc, z0, zT, den if scaled_w else None, T, NC,
           H=H, V=V, R=R, RP=RP, BV=BV, BC=BC, ZR=ZR, BZ=next_power_of_2(ZR), USE_H0=h0 is not None,
           STORE_HT=store_total, DOT=dot, STAGES=CONFIG["features_stages"], REVERSE=reverse, SCALED_W=scaled_w,
           num_warps=CONFIG["chain_warps"], maxnreg=CONFIG["features_maxnreg"])
    return hs, zc, hT, zT


def state_pass(k, v, hv0, hz0, output_final_state: bool, dot: int):
    """The first kernel: (hs [B·H, NC, R, V], zs [B·H, NC, R], hT, zT) in the pair layout (hT, zT None unless
    output_final_state); hv0/hz0 in the Taylor-order layout, or None.

    With CONFIG["NS"] > 1 each sequence is walked in NS segments at once, twice: the first launch sums each
    segment, the states entering the segments follow in PyTorch (an exclusive cumsum over NS), and the second
    launch walks each segment from its entering state, storing hs. Chains NS× shorter for 2× the work."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    BK = 16
    if K > BK:
        raise ValueError(f"the split forward supports K ≤ {BK}, got K={K}")
    BC, BV, NV, NC = _blocks(T, V)
    NS, CPS = _segments(NC)
    NP = CONFIG["NP"]
    R = 1 + 2 * BK + BK * BK // 2
    ZR = 1 + BK + BK * BK
    dev = k.device
    h0 = z0 = hT = zT = None
    if hv0 is not None:
        h0 = orders_to_pairs(hv0.reshape(B * H, 1 + K + K * K, V), K, BK).contiguous()
        z0 = _pad_orders(hz0.reshape(B * H, 1 + K + K * K), K, BK).contiguous()
    if CONFIG["features"]:
        return _features_walk(k, None, v, 1.0, h0, z0, output_final_state, False, dot)
    hs = torch.empty(B * H, NC, R, V, device=dev, dtype=_state_dtype(dot))
    zs = torch.empty(B * H, NC, ZR, device=dev, dtype=torch.float32)
    meta = dict(H=H, K=K, V=V, BK=BK, BV=BV, BC=BC, NP=NP, NS=NS, DOT=dot, PREFETCH=CONFIG["prefetch"],
                GATHER=CONFIG["gather"], num_warps=CONFIG["state_warps"],
                maxnreg=CONFIG["state_maxnreg"], STAGES=CONFIG["state_stages"])
    grid = (NP + 1, NV, B * H * NS)
    if CONFIG["scan"]:
        # every chunk's own sum at once (NC segments of one chunk, stored straight into hs, zs), then the exclusive
        # prefix over chunks in place
        meta.update(NS=NC, PREFETCH=False)
        launch(_state_kernel, (NP + 1, NV, B * H * NC), k, v, hs, zs, None, None, hs, zs, T, NC, 1, USE_H0=False,
               STORE_HS=False, STORE_HT=True, **meta)
        return hs, zs, _prefix(hs, h0, False, output_final_state), _prefix(zs, z0, False, output_final_state)
    if NS == 1:
        if output_final_state:
            hT = torch.empty(B * H, R, V, device=dev, dtype=torch.float32)
            zT = torch.empty(B * H, ZR, device=dev, dtype=torch.float32)
        launch(_state_kernel, grid, k, v, hs, zs, h0, z0, hT, zT, T, NC, CPS, USE_H0=h0 is not None, STORE_HS=True,
               STORE_HT=output_final_state, **meta)
        return hs, zs, hT, zT
    tot = torch.empty(B * H, NS, R, V, device=dev, dtype=torch.float32)
    ztot = torch.empty(B * H, NS, ZR, device=dev, dtype=torch.float32)
    launch(_state_kernel, grid, k, v, hs, zs, None, None, tot, ztot, T, NC, CPS, USE_H0=False, STORE_HS=False,
           STORE_HT=True, **meta)
    carry, zcarry = _exclusive_carry(tot, h0, False), _exclusive_carry(ztot, z0, False)
    launch(_state_kernel, grid, k, v, hs, zs, carry, zcarry, None, None, T, NC, CPS, USE_H0=True, STORE_HS=True,
           STORE_HT=False, **meta)
    if output_final_state:
        hT, zT = carry[:, -1] + tot[:, -1], zcarry[:, -1] + ztot[:, -1]
    return hs, zs, hT, zT


def output_pass(q, k, v, hs, zs, scale: float, normalize: bool, dot: int):
    """The second kernel: o [B, T, H, V] in v's dtype and den [B, T, H] fp32 (None unless normalize)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BC, BV, NV, NC = _blocks(T, V, CONFIG["output_BV"])
    o = torch.empty_like(v)
    den = torch.empty(B, T, H, device=q.device, dtype=torch.float32) if normalize else None
    G = CONFIG["output_chunks"]
    launch(_output_kernel, (cdiv(NC, G), NV, B * H), q, k, v, o, den, hs, zs, scale, T, NC, H=H, K=K, V=V, BK=16,
           BV=BV, BC=BC, OP=CONFIG["OP"], NORMALIZE=normalize, DOT=dot, GATHER=CONFIG["gather"], G=G,
           STAGES=CONFIG["output_stages"], num_warps=CONFIG["output_warps"], maxnreg=CONFIG["output_maxnreg"])
    return o, den


def split_forward(q, k, v, hv0, hz0, scale: float, output_final_state: bool, normalize: bool, dot: int,
                  return_states: bool = False):
    """o [B, T, H, V], den [B, T, H] fp32 (or None), and the final state (hvT, hzT) in the Taylor-order layout
    of `chunk.py` (or None, None). hv0/hz0: the initial state in that layout, or None. K ≤ 16. With return_states,
    also (hs, zs), the states entering every chunk (`state_pass`), for `split_backward`. dot: `chunk`'s DOT (4,
    fp16 operands, becomes tf32 where `takes_fp16` says so)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dot = takes_fp16(dot)
    hs, zs, hT, zT = state_pass(k, v, hv0, hz0, output_final_state, dot)
    o, den = output_pass(q, k, v, hs, zs, scale, normalize, dot)
    hvT = hzT = None
    if output_final_state:
        hvT = pairs_to_orders(hT, K, 16).reshape(B, H, 1 + K + K * K, V).contiguous()
        hzT = _unpad_orders(zT, K, 16).reshape(B, H, 1 + K + K * K).contiguous()
    if return_states:
        return o, den, hvT, hzT, (hs, zs)
    return o, den, hvT, hzT


# ---------------------------------------------------------------------------------------------------------------
# The split backward: the same two-step shape. `state_pass` again (the forward's entering states), a reverse state
# pass over (q, dO/den) storing the state that enters every chunk from the right, then every chunk's dq and dk, dv
# at once from those states. It computes what chunk.py's `_bwd_dq_kernel` / `_bwd_dkv_kernel` compute, chunk by
# chunk, without their serial walk.


@triton.jit
def _load_q_dout(q, do, den, dden, c, T, offs_c, offs_k, offs_v, m_k, m_v, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BC: tl.constexpr, NORMALIZE: tl.constexpr):
    """Chunk c's queries, transposed [BK, BC], dO [BC, BV], den and dden [BC] as stored (den 1 and dden 0 without
    NORMALIZE, and outside [0, T)): the reverse pass's loads."""
    t = c * BC + offs_c
    m_t = (t >= 0) & (t < T)
    bqt = tl.load(q + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
    bdo = tl.load(do + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    if NORMALIZE:
        d = tl.load(den + t * H, mask=m_t, other=1.0)
        g = tl.load(dden + t * H, mask=m_t, other=0.0)
    else:
        d = tl.full([BC], 1.0, tl.float32)
        g = tl.zeros([BC], dtype=tl.float32)
    return bqt, bdo, d, g


@triton.jit
def _reverse_state_kernel(q, do, den, dden, ds, dzs, dhT, dzT, dh0, dz0, scale, T, NC, CPS,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          BC: tl.constexpr, NP: tl.constexpr, NS: tl.constexpr, USE_DHT: tl.constexpr,
                          STORE_DS: tl.constexpr, STORE_DH0: tl.constexpr, NORMALIZE: tl.constexpr,
                          DOT: tl.constexpr, PREFETCH: tl.constexpr, GATHER: tl.constexpr = False,
                          STAGES: tl.constexpr = 1):
    """Row part i_p of the reverse state of sequence i_bh, value block i_v, over segment i_s of NS: with STORE_DS,
    ds[i_bh, c] = dhT + Σ over the segment's chunks after c of (1, q_s, q_s⊗q_s as pairs) (dO/den)ᵀ (the fused dkv
    kernel's D0, D1, Dd, D2), dzs[i_bh, c] likewise with the denominator's gradient (d0, d1, d2 [BK, BK]; first V
    block only); with STORE_DH0, what the segment adds on top of dhT, in dh0. dhT/dzT, dh0/dz0: [B·H·NS, ...], one
    per segment (order 2 symmetrised; pair / padded Taylor-order layouts). PREFETCH: as in `_state_kernel` (the
    previous chunk's loads issued before this one is summed)."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_p, i_v, i_bs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_bh, i_s = i_bs // NS, i_bs % NS
    i_b, i_h = i_bh // H, i_bh % H
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
    JP: tl.constexpr = BK * (BK // 2) // NP
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    first = i_v == 0
    c0 = i_s * CPS
    c1 = tl.minimum(c0 + CPS, NC)
    q += i_b.to(tl.int64) * T * H * K + i_h * K
    do += i_b.to(tl.int64) * T * H * V + i_h * V
    if NORMALIZE:
        den += i_b.to(tl.int64) * T * H + i_h
        dden += i_b.to(tl.int64) * T * H + i_h
    ds += i_bh.to(tl.int64) * NC * R * V
    dzs += i_bh.to(tl.int64) * NC * ZR
    if PREFETCH:
        bqt, bdo, d, g = _load_q_dout(q, do, den, dden, c1 - 1, T, offs_c, offs_k, offs_v, m_k, m_v, H, K, V,
                                          BC, NORMALIZE)
    if i_p < NP:
        rows = 1 + 2 * BK + i_p * JP + tl.arange(0, JP)
        D = tl.zeros([JP, BV], dtype=tl.float32)
        if USE_DHT:
            D += tl.load(dhT + i_bs.to(tl.int64) * R * V + rows[:, None] * V + offs_v[None, :], mask=m_v[None, :],
                         other=0.0)
        for i in tl.range(0, c1 - c0, num_stages=STAGES):
            c = c1 - 1 - i
            if STORE_DS:
                tl.store(ds + c * R * V + rows[:, None] * V + offs_v[None, :], D.to(ds.dtype.element_ty),
                         mask=m_v[None, :])
            if PREFETCH:
                nqt, ndo, nd, ng = _load_q_dout(q, do, den, dden, c - 1, T, offs_c, offs_k, offs_v, m_k, m_v, H,
                                                    K, V, BC, NORMALIZE)
            else:
                bqt, bdo, d, g = _load_q_dout(q, do, den, dden, c, T, offs_c, offs_k, offs_v, m_k, m_v, H, K, V,
                                                  BC, NORMALIZE)
            dnum = bdo.to(tl.float32) / d[:, None]
            D += _mm(_pairs(bqt.to(tl.float32) * scale, BK, DOT, i_p, NP, True, GATHER), dnum, DOT)
            if PREFETCH:
                bqt, bdo, d, g = nqt, ndo, nd, ng
        if STORE_DH0:
            tl.store(dh0 + i_bs.to(tl.int64) * R * V + rows[:, None] * V + offs_v[None, :], D, mask=m_v[None, :])
    else:
        # the denominator's gradient state enters dk once, through the first V block
        D0, D1, Dd, d0, d1, d2 = _init_head(dhT, dzT, i_bs, USE_DHT, offs_k, offs_v, m_v, first, V, BK, BV)
        for i in tl.range(0, c1 - c0, num_stages=STAGES):
            c = c1 - 1 - i
            if STORE_DS:
                _store_head(ds + c * R * V, dzs + c * ZR, D0, D1, Dd, d0, d1, d2, offs_k, offs_v, m_v, first, V, BK)
            if PREFETCH:
                nqt, ndo, nd, ng = _load_q_dout(q, do, den, dden, c - 1, T, offs_c, offs_k, offs_v, m_k, m_v, H,
                                                    K, V, BC, NORMALIZE)
            else:
                bqt, bdo, d, g = _load_q_dout(q, do, den, dden, c, T, offs_c, offs_k, offs_v, m_k, m_v, H, K, V,
                                                  BC, NORMALIZE)
            qst = bqt.to(tl.float32) * scale  # [BK, BC]
            dnum = bdo.to(tl.float32) / d[:, None]
            D0 += tl.sum(dnum, 0)
            D1 += _mm(qst, dnum, DOT)
            Dd += _mm(qst * qst, dnum, DOT)
            if first:
                d0 += tl.sum(g, 0)
                d1 += tl.sum(qst * g[None, :], 1)
                if DOT == 0 or DOT == 3:  # fp32 inputs: q loaded again untransposed, as Z2 in `_state_kernel`
                    t = c * BC + offs_c
                    bq = tl.load(q + t[:, None] * H * K + offs_k[None, :], mask=(t < T)[:, None] & m_k[None, :],
                                 other=0.0)
                    d2 += _mm(qst, bq.to(tl.float32) * scale * g[:, None], 0)
                else:
                    d2 += _mm(qst, tl.trans(qst * g[None, :]), 0)
            if PREFETCH:
                bqt, bdo, d, g = nqt, ndo, nd, ng
        if STORE_DH0:
            _store_head(dh0 + i_bs.to(tl.int64) * R * V, dz0 + i_bs.to(tl.int64) * ZR, D0, D1, Dd, d0, d1, d2,
                        offs_k, offs_v, m_v, first, V, BK)


@triton.jit
def _pair_grad(y, x, h, offs_v, m_v, V: tl.constexpr, BK: tl.constexpr, OP: tl.constexpr, DOT: tl.constexpr):
    """Σ_b (y·S[a, b])·x_b for the symmetric order-2 state S held in the pair layout at h (the diagonal and the
    pair rows, read transposed): y [BC, BV], x [BC, BK] -> [BC, BK] (chunk.py's `_order2_contract`)."""
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
def _order2_of(x, h, offs_v, m_v, V: tl.constexpr, BK: tl.constexpr, OP: tl.constexpr, DOT: tl.constexpr,
               GATHER: tl.constexpr = False):
    """(x⊗x)·S for the order-2 state S in the pair layout at h: x [BC, BK] -> [BC, BV]."""
    JP: tl.constexpr = BK * (BK // 2) // OP
    offs_k = tl.arange(0, BK)
    offs_j = tl.arange(0, JP)
    Sd = tl.load(h + (1 + BK + offs_k)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
    o2 = _mm(x * x, Sd, DOT)
    for p in tl.static_range(OP):
        S2 = tl.load(h + (1 + 2 * BK + p * JP + offs_j)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
        o2 += _mm(_pairs(x, BK, DOT, p, OP, False, GATHER), S2, DOT)
    return o2


@triton.jit
def _dq_kernel(q, k, v, do, den, dden, dq, hs, zs, scale, T, NC,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               BC: tl.constexpr, OP: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
               G: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """dq of chunks i_g·G up to (i_g + 1)·G (partial over V blocks: dq [NV, B, T, H, K]) from the forward states
    entering them, one chunk after another (STAGES as in `_output_kernel`)."""
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
    for i_c in tl.range(i_g * G, tl.minimum(i_g * G + G, NC), num_stages=STAGES):
        _dq_chunk(q, k, v, do, den, dden, dq, hs, zs, scale, T, NC, i_c, i_bh, offs_c, offs_k, offs_v, m_k, m_v,
                  first, causal, H, K, V, BK, BV, BC, OP, NORMALIZE, DOT)


@triton.jit
def _dq_chunk(q, k, v, do, den, dden, dq, hs, zs, scale, T, NC, i_c, i_bh, offs_c, offs_k, offs_v, m_k, m_v, first,
              causal, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              BC: tl.constexpr, OP: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr):
    """`_dq_kernel`'s chunk i_c (pointers already at the sequence)."""
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
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
    if DOT == 4:
        # fp16 operands: dO/den and dd (and so ds) times u, the chunk's `_dout_scale`, and hs over max(n, 1)
        # (`_chain_kernel`); both come out of the fp32 results
        u = 1.0
        if NORMALIZE:
            u = _dout_scale(den, i_c, T, BC, H)
        dnum = dnum * u
        dp = _mm(dnum, bvt, DOT) + (dd * u)[:, None]
        ds = tl.where(causal, dp * (1.0 + s), 0.0)
        S1t = tl.load(h + (1 + offs_k)[None, :] * V + offs_v[:, None], mask=m_v[:, None], other=0.0)
        r = tl.maximum(tl.load(z), 1.0) / u
        dqs = _mm(ds, bk, DOT) * (1.0 / u) + _mm(dnum, S1t, DOT) * r
        dqs += _pair_grad(dnum, qs, h, offs_v, m_v, V, BK, OP, DOT) * r
    else:
        dp = _mm(dnum, bvt, DOT) + dd[:, None]
        ds = tl.where(causal, dp * (1.0 + s), 0.0)
        S1t = tl.load(h + (1 + offs_k)[None, :] * V + offs_v[:, None], mask=m_v[:, None], other=0.0)
        dqs = _mm(ds, bk, DOT) + _mm(dnum, S1t, DOT) + _pair_grad(dnum, qs, h, offs_v, m_v, V, BK, OP, DOT)
    if NORMALIZE:  # dd is zero past the first V block; no branch, so that a pipelined loop loads Z2 ahead
        Z2 = tl.load(z + 1 + BK + offs_k[:, None] * BK + offs_k[None, :])
        dqs += dd[:, None] * (tl.load(z + 1 + offs_k)[None, :] + _mm(qs, Z2, 0))
    tl.store(dq + t[:, None] * H * K + offs_k[None, :], (dqs * scale).to(dq.dtype.element_ty),
             mask=m_t[:, None] & m_k[None, :])


@triton.jit
def _dkv_kernel(q, k, v, do, den, dden, dk, dv, ds, dzs, scale, T, NC,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                BC: tl.constexpr, OP: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
                DV: tl.constexpr = True, DK: tl.constexpr = True, GATHER: tl.constexpr = False,
                G: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """dv (DV) and dk (DK; partial over V blocks: dk [NV, B, T, H, K]) of chunks i_g·G up to (i_g + 1)·G from the
    reverse states entering them, one chunk after another (STAGES as in `_output_kernel`); CONFIG["dkv_apart"]
    launches it twice, once for each, to halve what is live at a time."""
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
    for i_c in tl.range(i_g * G, tl.minimum(i_g * G + G, NC), num_stages=STAGES):
        _dkv_chunk(q, k, v, do, den, dden, dk, dv, ds, dzs, scale, T, NC, i_c, i_bh, offs_c, offs_k, offs_v, m_k,
                   m_v, first, causal_t, H, K, V, BK, BV, BC, OP, NORMALIZE, DOT, DV, DK, GATHER)


@triton.jit
def _dkv_chunk(q, k, v, do, den, dden, dk, dv, ds, dzs, scale, T, NC, i_c, i_bh, offs_c, offs_k, offs_v, m_k, m_v,
               first, causal_t, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, BC: tl.constexpr, OP: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
               DV: tl.constexpr, DK: tl.constexpr, GATHER: tl.constexpr):
    """`_dkv_kernel`'s chunk i_c (pointers already at the sequence)."""
    R: tl.constexpr = 1 + 2 * BK + BK * (BK // 2)
    ZR: tl.constexpr = 1 + BK + BK * BK
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
    # fp16 operands (DOT 4): dO/den and dd times u, the chunk's `_dout_scale`, divided out of the fp32 results (the
    # reverse states ds are stored unscaled, `_chain_kernel`)
    u = 1.0
    if DOT == 4 and NORMALIZE:
        u = _dout_scale(den, i_c, T, BC, H)

    st = _mm(bk, bqt, DOT) * scale  # [BC keys, BC queries]
    if DV:
        wt = tl.where(causal_t, 1.0 + st + 0.5 * st * st, 0.0)
        D0 = tl.load(h + offs_v, mask=m_v, other=0.0).to(tl.float32)
        D1 = tl.load(h + (1 + offs_k)[:, None] * V + offs_v[None, :], mask=m_v[None, :], other=0.0)
        if DOT == 4:
            bdv = _mm(wt, dnum * u, DOT) * (1.0 / u) + D0[None, :] + _mm(kf, D1, DOT)
        else:
            bdv = _mm(wt, dnum, DOT) + D0[None, :] + _mm(kf, D1, DOT)
        bdv += 0.5 * _order2_of(kf, h, offs_v, m_v, V, BK, OP, DOT, GATHER)
        tl.store(dv + t[:, None] * H * V + offs_v[None, :], bdv.to(dv.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
    if DK:
        # dO/den loaded again, transposed, rather than tl.trans(dnum) (with BV=32 Triton 3.6 compiled this kernel
        # into an out-of-bounds shared-memory read on the H200, compute-sanitizer, session 8; the load alone did not
        # remove it, so CONFIG keeps BV=64)
        dnumt = tl.load(do + t[None, :] * H * V + offs_v[:, None], mask=m_v[:, None] & m_t[None, :], other=0.0)
        dnumt = dnumt.to(tl.float32)
        if NORMALIZE:
            dnumt = dnumt / tl.load(den + t * H, mask=m_t, other=1.0)[None, :]
        # (the order of these lines matters on Triton 3.6: with the D1t load first this kernel read shared memory out
        # of bounds on the H200, compute-sanitizer, session 15)
        if DOT == 4:
            dpt = _mm(bv, dnumt * u, DOT) + (dd * u)[None, :]
            dst = tl.where(causal_t, dpt * (1.0 + st), 0.0)
            D1t = tl.load(h + (1 + offs_k)[None, :] * V + offs_v[:, None], mask=m_v[:, None], other=0.0)
            bdk = _mm(dst, qs, DOT) * (1.0 / u) + _mm(bv, D1t, DOT)
        else:
            dpt = _mm(bv, dnumt, DOT) + dd[None, :]
            dst = tl.where(causal_t, dpt * (1.0 + st), 0.0)
            D1t = tl.load(h + (1 + offs_k)[None, :] * V + offs_v[:, None], mask=m_v[:, None], other=0.0)
            bdk = _mm(dst, qs, DOT) + _mm(bv, D1t, DOT)
        bdk += _pair_grad(bv, kf, h, offs_v, m_v, V, BK, OP, DOT)
        # the denominator's reverse state, counted once (first V block), weighted by 0 or 1 rather than in a branch
        d2 = tl.load(z + 1 + BK + offs_k[:, None] * BK + offs_k[None, :])
        bdk += first.to(tl.float32) * (tl.load(z + 1 + offs_k)[None, :] + _mm(kf, d2, 0))
        tl.store(dk + t[:, None] * H * K + offs_k[None, :], bdk.to(dk.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])


def reverse_pass(q, do, den, dden, dhvT, dhzT, store_dh0: bool, scale: float, normalize: bool, dot: int, o=None):
    """The backward's reverse state pass: (ds [B·H, NC, R, V], dzs [B·H, NC, ZR], dh0, dz0), the reverse states
    entering every chunk in the pair / padded Taylor-order layouts, and with store_dh0 what is left at t = 0 (else
    None, None). dhvT/dhzT: the final state's gradient (Taylor-order layout, order 2 symmetrised) or None."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    BK = 16
    BC, BV, NV, NC = _blocks(T, V)
    NP = CONFIG["NP"]
    R, ZR = 1 + 2 * BK + BK * BK // 2, 1 + BK + BK * BK
    dev = q.device
    dhT = dzT = dh0 = dz0 = None
    if dhvT is not None:
        dhT = orders_to_pairs(dhvT.reshape(B * H, 1 + K + K * K, V), K, BK).contiguous()
        dzT = _pad_orders(dhzT.reshape(B * H, 1 + K + K * K), K, BK).contiguous()
    if CONFIG["features"]:
        # the query features, dden as the denominator sums' weights, and the walk over dO/den (stored in the dots'
        # operand dtype by the features kernel)
        if normalize:
            return _features_walk(q, dden, do, scale, dhT, dzT, store_dh0, True, dot, den=den, o=o)
        g = torch.zeros(B, T, H, device=dev, dtype=torch.float32)
        return _features_walk(q, g, do, scale, dhT, dzT, store_dh0, True, dot)
    ds = torch.empty(B * H, NC, R, V, device=dev, dtype=_state_dtype(dot))
    dzs = torch.empty(B * H, NC, ZR, device=dev, dtype=torch.float32)
    NS, CPS = _segments(NC)
    meta = dict(H=H, K=K, V=V, BK=BK, BV=BV, BC=BC, NP=NP, NS=NS, NORMALIZE=normalize, DOT=dot,
                PREFETCH=CONFIG["prefetch"], GATHER=CONFIG["gather"], num_warps=CONFIG["state_warps"],
                maxnreg=CONFIG["state_maxnreg"], STAGES=CONFIG["state_stages"])
    grid = (NP + 1, NV, B * H * NS)
    if CONFIG["scan"]:
        # as in state_pass: every chunk's own sum at once, then the exclusive prefix from the right, in place
        meta.update(NS=NC, PREFETCH=False)
        launch(_reverse_state_kernel, (NP + 1, NV, B * H * NC), q, do, den, dden, ds, dzs, None, None, ds, dzs,
               scale, T, NC, 1, USE_DHT=False, STORE_DS=False, STORE_DH0=True, **meta)
        return ds, dzs, _prefix(ds, dhT, True, store_dh0), _prefix(dzs, dzT, True, store_dh0)
    if NS == 1:
        if store_dh0:
            dh0 = torch.empty(B * H, R, V, device=dev, dtype=torch.float32)
            dz0 = torch.empty(B * H, ZR, device=dev, dtype=torch.float32)
        launch(_reverse_state_kernel, grid, q, do, den, dden, ds, dzs, dhT, dzT, dh0, dz0, scale, T, NC, CPS,
               USE_DHT=dhT is not None, STORE_DS=True, STORE_DH0=store_dh0, **meta)
        return ds, dzs, dh0, dz0
    # as in state_pass: each segment's sum, the states entering the segments from the right, then ds
    tot = torch.empty(B * H, NS, R, V, device=dev, dtype=torch.float32)
    ztot = torch.empty(B * H, NS, ZR, device=dev, dtype=torch.float32)
    launch(_reverse_state_kernel, grid, q, do, den, dden, ds, dzs, None, None, tot, ztot, scale, T, NC, CPS,
           USE_DHT=False, STORE_DS=False, STORE_DH0=True, **meta)
    carry, zcarry = _exclusive_carry(tot, dhT, True), _exclusive_carry(ztot, dzT, True)
    launch(_reverse_state_kernel, grid, q, do, den, dden, ds, dzs, carry, zcarry, None, None, scale, T, NC, CPS,
           USE_DHT=True, STORE_DS=True, STORE_DH0=False, **meta)
    if store_dh0:
        dh0, dz0 = carry[:, 0] + tot[:, 0], zcarry[:, 0] + ztot[:, 0]
    return ds, dzs, dh0, dz0


def chunk_grads(q, k, v, do, den, dden, hs, zs, ds, dzs, scale: float, normalize: bool, dot: int):
    """Every chunk's dq and dk and dv, at once, from the entering states of `state_pass` (hs, zs) and
    `reverse_pass` (ds, dzs). dq and dk come in q's dtype where one value block covers V (stored straight from the
    fp32 sums: no reduction or cast launched after), else as fp32 sums of the value blocks' parts."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BC, BV, NV, NC = _blocks(T, V)
    dev = q.device
    _, BVQ, NVQ, _ = _blocks(T, V, CONFIG["output_BV"])
    dq = torch.empty(NVQ, B, T, H, K, device=dev, dtype=q.dtype if NVQ == 1 else torch.float32)
    dk = torch.empty(NV, B, T, H, K, device=dev, dtype=q.dtype if NV == 1 else torch.float32)
    dv = torch.empty_like(v)
    meta = dict(H=H, K=K, V=V, BK=16, BC=BC, OP=CONFIG["OP"], NORMALIZE=normalize, DOT=dot,
                num_warps=CONFIG["output_warps"], maxnreg=CONFIG["grads_maxnreg"])
    G = CONFIG["dq_chunks"]
    launch(_dq_kernel, (cdiv(NC, G), NVQ, B * H), q, k, v, do, den, dden, dq, hs, zs, scale, T, NC, BV=BVQ, G=G,
           STAGES=CONFIG["dq_stages"], **meta)
    parts = (("dv", {"DV": True, "DK": False}), ("dk", {"DV": False, "DK": True})) if CONFIG["dkv_apart"] else \
        (("dk", {}),)
    for name, which in parts:
        G = CONFIG[f"{name}_chunks"]
        launch(_dkv_kernel, (cdiv(NC, G), NV, B * H), q, k, v, do, den, dden, dk, dv, ds, dzs, scale, T, NC, BV=BV,
               GATHER=CONFIG["gather"], G=G, STAGES=CONFIG[f"{name}_stages"],
               **meta, **which)
    return (dq[0] if NVQ == 1 else dq.sum(0)), (dk[0] if NV == 1 else dk.sum(0)), dv


def fuses_dden(normalize: bool) -> bool:
    """Whether `split_backward` computes dden itself (CONFIG["fuse_dden"], in the features reverse pass)."""
    return normalize and CONFIG["features"] and CONFIG["fuse_dden"]


def split_backward(q, k, v, do, den, dden, hv0, hz0, dhvT, dhzT, scale: float, normalize: bool, dot: int,
                   states=None, o=None):
    """dq, dk (as `chunk_grads` returns them), dv, and the initial state's gradient (dhv0, dhz0) in the Taylor-order
    layout (None without an initial state). dhvT/dhzT: the final state's gradient with order 2 symmetrised, or
    None. The arguments are those of chunk.py's backward; states: the forward's (hs, zs) from `split_forward`
    (at the same CONFIG), or None to compute them again; o: the forward's output where `fuses_dden()`, dden then
    an empty buffer the reverse pass fills. dot as in `split_forward`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dot = takes_fp16(dot)
    hs, zs = states if states is not None else state_pass(k, v, hv0, hz0, False, dot)[:2]
    ds, dzs, dh0, dz0 = reverse_pass(q, do, den, dden, dhvT, dhzT, hv0 is not None, scale, normalize, dot, o=o)
    dq, dk, dv = chunk_grads(q, k, v, do, den, dden, hs, zs, ds, dzs, scale, normalize, dot)
    dhv0 = dhz0 = None
    if hv0 is not None:
        # what is left at t = 0 is the initial state's gradient, order 2 halved (the fused kernel's convention)
        dhv0 = pairs_to_orders(dh0, K, 16)
        dhv0[:, 1 + K :] *= 0.5
        dhz0 = _unpad_orders(dz0, K, 16)
        dhz0[:, 1 + K :] *= 0.5
        dhv0 = dhv0.reshape(B, H, 1 + K + K * K, V).contiguous()
        dhz0 = dhz0.reshape(B, H, 1 + K + K * K).contiguous()
    return dq, dk, dv, dhv0, dhz0
