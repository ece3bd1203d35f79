"""Chunked Based linear attention in Triton: forward and backward, with the recurrent state in and out.

The math is in `kernels/based/README.md` and `naive.naive_chunk_based` is its line-by-line twin. One program
owns one (batch, head, block of BV value columns) and walks the sequence in chunks of BC tokens (forward:
first to last, or one segment of it when there are too few programs to fill the GPU; backward for dk/dv: last
to first). Inside a chunk it uses the quadratic form on the BC×BC tile
of s = scale·q·kᵀ; across chunks it carries the three Taylor orders of the state in registers:

    order 0: S0 = Σ v [BV],         n  = Σ 1
    order 1: S1 = Σ k vᵀ [K, BV],   z1 = Σ k [K]
    order 2: S2 = Σ (k⊗k) vᵀ [K², BV], Z2 = Σ k kᵀ [K, K]

(order 2 in the default mode 5 as a diagonal block plus one row per unordered pair, in two halves: see FWD_EXPAND),
so the E = 153 Taylor features never touch HBM: q, k, v are read once and o is written once. The E-feature
state (kv [B,H,E,V], k_sum [B,H,E], FLA's TaylorFeatureMap order) is converted to and from these orders only at
the boundaries (`naive.state_to_orders`, `naive.orders_to_state`), in fp32.

Dot precision follows the input dtype: fp32 inputs use three tf32 products per dot ("tf32x3": each operand split
into a tf32 head and a tf32 tail, the tail·tail product dropped, ≈ fp32's accuracy on the tensor cores; `FP32_DOT`
= "ieee" gives exact fp32 dots on the vector units instead), bf16 inputs bf16 operands, fp16 inputs fp16 operands
(FP16_DOT) in the fused forward, which reads the state as S/n, and in the split kernels (`split.takes_fp16`), which
scale what they carry into fp16's range, and tf32 operands (fp16's 10-bit mantissa with fp32's range) in the fused
backward: the order-2 state and the normalised gradient dO/den leave fp16's range at long T unless scaled.
Accumulation is fp32 throughout.
"""

import math

import torch
import triton
import triton.language as tl

from kernels.based.naive import orders_to_state, state_to_orders
from kernels.launch import cdiv, check_devices, is_capturing, launch, next_power_of_2

DOT_IEEE, DOT_TF32, DOT_BF16, DOT_TF32X3, DOT_FP16 = 0, 1, 2, 3, 4
# The dots for fp16 inputs in the fused forward and the split kernels: "fp16" (the default) or "tf32". fp16 operands
# have tf32's 10-bit mantissa at half the operand bytes and twice the tensor-core rate, but not fp32's range: the
# state grows with the tokens summed, so the fused forward reads it at the scale of one token's terms (S/n times n,
# n = the tokens summed; `_fwd_kernel`), the split kernels store it so, and carry dO/den times each chunk's smallest
# den (`split._chain_kernel`). The fused backward keeps tf32 operands for fp16. H200, session 15, B=8, H=16, T=4096:
# fp16 forward+backward 1.320 ms against 3.479 with tf32 operands in the split backward (13.92 -> 5.16 ms at T=16384).
FP16_DOT = "fp16"
# The dots of fp32 inputs: "tf32x3" (the default) or "ieee". On the H200 (session 13, B=8, H=16, T=4096) an fp32
# forward+backward took 68.5 ms with "ieee" dots, 54× the bf16 one, because Triton runs ieee fp32 dots as FMAs on
# the vector units; "tf32x3" keeps the tensor cores at ≈ fp32 accuracy (14.0 ms; output within 3.5e-7 of the ieee
# one; the GPU tests hold it to fp32's rule).
FP32_DOT = "tf32x3"
# Order-2 modes: how the order-2 state is kept and q⊗q, k⊗k are formed. Mode 0 keeps K² rows and forms the
# features by broadcast and reshape; mode 1 keeps K² rows and forms them with dots against 0/1 matrices [K, K²]
# (faster than 0 on the H200 at K=16; at K=32 the matrices overflow shared memory, so K > 16 uses mode 0).
# Mode 2 keeps the order-2 state as [K, K, BV] and reads, updates and contracts it with batched dots over the
# first index: no 0/1 matrices, about half the matrix work at K=16. Mode 3 ("pairs") uses the symmetry of the
# order-2 state: a diagonal block [K, BV] plus one row per unordered pair {a, b}, a≠b, laid out cyclically
# (row (d, a) holds the pair (a, (a+d) mod BK), d = 1..BK/2: BK²/2 rows, a power of two) instead of K² rows:
# 144 rows instead of 256 at K=16, so 44% less order-2 matrix work and state registers; k and q enter the
# updates transposed straight from memory (no register transposes). Mode 5 is mode 3 with the pair rows in two
# halves (d = 1..4 and 5..8), each its own state tensor and dots, so the [BC, 64] pair features of one half are
# live at a time: compiled for sm_90a (kernels/based/sm90_report.py) the BC=64 forward spills 132 B instead of
# 534. FWD_EXPAND / BWD_EXPAND pick the mode for the forward / backward. Measured on the H200 (bf16, T=4096,
# BV=32, 4 warps, experiments/LOG.md session 4): mode 5 forward 0.386 ms (BC=64) and forward+backward 2.256 ms
# (backward BC=32), against 0.465 / 2.302 for mode 3, 0.684 / 3.01 for mode 1 and 0.981 / 3.09 for mode 2;
# mode 5 is the default. Mode 6 is mode 5 with the pair features gathered (`_pairs` GATHER: tl.gather along K
# instead of two dots with 0/1 matrices; not yet timed).
FWD_EXPAND = 5
BWD_EXPAND = 5
# bf16 forwards at K=16, V=64 on a Hopper GPU run the Gluon kernel (`kernels/based/gluon.py`: explicit layouts,
# warpgroup MMAs, warp specialisation; `gluon.applies` says where), with or without a gradient following. H200,
# session 16, B=8, H=16, T=4096: forward 0.153 ms against 0.382 for `_fwd_kernel`. Only under FORWARD = "auto";
# False keeps the Triton kernels everywhere.
GLUON_FORWARD = True
# Where the Gluon forward takes a training step, its backward is the Gluon pair (`kernels/based/gluon_backward.py`,
# session 17: dq chunk-parallel, dk/dv in a reverse walk with the reverse state on chip; only under BACKWARD =
# "auto"): forward+backward 0.750 ms at the shape above. False: the Gluon forward only where the split backward
# follows it, storing the states that backward reads (session 16: 1.166 ms).
GLUON_BACKWARD = True


def _expand_mode(BK: int, forward: bool) -> int:
    mode = FWD_EXPAND if forward else BWD_EXPAND
    return mode if BK <= 16 else 0


def _dot_mode(dtype: torch.dtype, K: int = 16) -> int:
    """The kernels' DOT for inputs of `dtype` with feature dim K (see the module docstring and FP32_DOT)."""
    if dtype == torch.float32:
        if FP32_DOT not in ("tf32x3", "ieee"):
            raise ValueError(f"chunk.FP32_DOT must be 'tf32x3' or 'ieee', got {FP32_DOT!r}")
        # K > 16 (order-2 mode 0, BK = 32): the split operands of tf32x3 need ≈ 275-279 KB of shared memory per
        # program (compiled for sm_90a, kernels/based/sm90_report.py), over the H200's 227 KB; ieee fits
        return DOT_TF32X3 if FP32_DOT == "tf32x3" and K <= 16 else DOT_IEEE
    if dtype == torch.float16:
        return DOT_TF32
    if dtype == torch.bfloat16:
        return DOT_BF16
    raise TypeError(f"chunk_based supports fp32, fp16 and bf16 inputs, got {dtype}")


def _fused_forward_dot(dtype: torch.dtype, K: int = 16) -> int:
    """The fused forward's and the split kernels' DOT: `_dot_mode`'s, except fp16 operands for fp16 inputs under
    FP16_DOT = "fp16" (the split kernels take them where `split.takes_fp16` allows)."""
    if FP16_DOT not in ("fp16", "tf32"):
        raise ValueError(f"chunk.FP16_DOT must be 'fp16' or 'tf32', got {FP16_DOT!r}")
    return DOT_FP16 if dtype == torch.float16 and FP16_DOT == "fp16" else _dot_mode(dtype, K)


@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """a @ b with fp32 accumulation; DOT picks the operand precision (see the module docstring)."""
    if DOT == 2:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif DOT == 4:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    elif DOT == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    elif DOT == 3:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _expanders(BK: tl.constexpr):
    """0/1 matrices [BK, BK²]: x @ rep_a puts x_a at column a·BK + b, x @ rep_b puts x_b there."""
    cols = tl.arange(0, BK * BK)
    rows = tl.arange(0, BK)
    rep_a = (rows[:, None] == cols[None, :] // BK).to(tl.float32)
    rep_b = (rows[:, None] == cols[None, :] % BK).to(tl.float32)
    return rep_a, rep_b


@triton.jit
def _outer(x, rep_a, rep_b, BC: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, EXPAND: tl.constexpr):
    """Row-wise outer product x⊗x: [BC, BK] -> [BC, BK·BK], column a·BK + b.

    EXPAND=1 builds it from two dots with 0/1 matrices (exact: one nonzero term each; x is first rounded to the
    dot's operand dtype, the single rounding the big dot would apply anyway), keeping every tensor in the
    matrix units' layouts; EXPAND=0 broadcasts and reshapes."""
    if EXPAND == 1:
        if DOT == 2:
            x = x.to(tl.bfloat16)
        return _mm(x, rep_a, DOT) * _mm(x, rep_b, DOT)
    else:
        if DOT == 2:
            x = x.to(tl.bfloat16)
        return tl.reshape(x[:, :, None] * x[:, None, :], (BC, BK * BK))


@triton.jit
def _contract(m, x, rep_a, rep_b, BC: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, EXPAND: tl.constexpr):
    """Σ_b m[:, a·BK + b]·x[:, b] for m: [BC, BK²], x: [BC, BK] -> [BC, BK]."""
    if EXPAND == 1:
        xb = _mm(x, rep_b, DOT)  # [BC, BK²]
        # the sum over b is a dot with rep_aᵀ; tf32 operands in bf16 mode keep the products' precision
        return _mm(m * xb, tl.trans(rep_a), 1 if DOT == 2 else DOT)
    else:
        return tl.sum(tl.reshape(m, (BC, BK, BK)) * x[:, None, :], 2)


@triton.jit
def _o2_offsets(offs_k, offs_v, K: tl.constexpr, V: tl.constexpr):
    """Offsets [BK, BK, BV] of the order-2 rows (a, b) in a Taylor-order state [F, V], and their mask."""
    a3, b3, v3 = offs_k[:, None, None], offs_k[None, :, None], offs_v[None, None, :]
    return (1 + K + a3 * K + b3) * V + v3, (a3 < K) & (b3 < K) & (v3 < V)


@triton.jit
def _o2_read(qs, S2, BC: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
    """(q⊗q)·S2 for S2 kept as [BK, BK, BV], without forming q⊗q: Σ_a q_a (q·S2[a]), one batched dot over a.

    qs [BC, BK] -> [BC, BV]."""
    if DOT == 2:
        qs = qs.to(tl.bfloat16).to(tl.float32)  # the operand rounding the big dot would apply
    x = _mm(tl.broadcast_to(qs[None, :, :], (BK, BC, BK)), S2, DOT)  # [BK (a), BC, BV]
    return tl.sum(tl.trans(qs)[:, :, None] * x, 0)


@triton.jit
def _o2_update(kf, bv, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """Σ_c (k_c⊗k_c) v_cᵀ as [BK, BK, BV]: for each a, (k·k_a)ᵀ v, one batched dot over a."""
    if DOT == 2:
        kf = kf.to(tl.bfloat16).to(tl.float32)
    kt = tl.trans(kf)  # [BK, BC]
    a = kt[:, None, :] * kt[None, :, :]  # [BK (a), BK (b), BC]: k_a·k_b, exact in fp32
    return _mm(a, tl.broadcast_to(bv[None, :, :], (BK, BC, BV)), DOT)


@triton.jit
def _o2_contract(g, S2, x, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """out[c, a] = Σ_b (Σ_v S2[a, b, v]·g[c, v])·x[c, b] for S2 [BK, BK, BV], g [BC, BV], x [BC, BK] -> [BC, BK]:
    one batched dot over a, then the sum over b on the vector units."""
    y = _mm(tl.broadcast_to(g[None, :, :], (BK, BC, BV)), tl.permute(S2, (0, 2, 1)), DOT)  # [BK (a), BC, BK (b)]
    return tl.trans(tl.sum(y * x[None, :, :], 2))


@triton.jit
def _pair_cols(BK: tl.constexpr, P: tl.constexpr, NP: tl.constexpr):
    """The pair layout's rows j = (d-1)·BK + a, d = 1..BK/2: the pair (a_j, b_j = (a_j + d) mod BK) and its
    weight w_j, the number of ordered pairs (a, b), a≠b, it stands for (2, or 1 at d = BK/2, where (a, a+BK/2)
    and (a+BK/2, a) both have rows). So Σ_{a≠b} x_a x_b S_ab = Σ_j w_j x_{a_j} x_{b_j} S_{a_j b_j} for symmetric S."""
    j = P * (BK * (BK // 2) // NP) + tl.arange(0, BK * (BK // 2) // NP)  # part P of NP (mode 5: two halves)
    d = 1 + j // BK
    a = j % BK
    b = (a + d) % BK
    w = tl.where(d < BK // 2, 2.0, 1.0)
    return a, b, w


@triton.jit
def _pair_reps(BK: tl.constexpr, TRANSPOSED: tl.constexpr, WEIGHTED: tl.constexpr, P: tl.constexpr,
               NP: tl.constexpr):
    """0/1 matrices selecting a_j and b_j: [BK, J] (x @ rep puts x_{a_j} at column j), or [J, BK] transposed;
    WEIGHTED puts w_j instead of 1 in the a_j matrix (exact: 1 or 2)."""
    a, b, w = _pair_cols(BK, P, NP)
    rows = tl.arange(0, BK)
    if TRANSPOSED:
        rep_a = (a[:, None] == rows[None, :]).to(tl.float32)
        rep_b = (b[:, None] == rows[None, :]).to(tl.float32)
        if WEIGHTED:
            rep_a = rep_a * w[:, None]
    else:
        rep_a = (rows[:, None] == a[None, :]).to(tl.float32)
        rep_b = (rows[:, None] == b[None, :]).to(tl.float32)
        if WEIGHTED:
            rep_a = rep_a * w[None, :]
    return rep_a, rep_b


@triton.jit
def _pairs(x, BK: tl.constexpr, DOT: tl.constexpr, P: tl.constexpr, NP: tl.constexpr, TRANSPOSED: tl.constexpr,
           GATHER: tl.constexpr = False):
    """The pair features of part P of NP: x [BC, BK] -> [BC, J] with x_{a_j}·x_{b_j} (the reads' form), or with
    TRANSPOSED x [BK, BC] -> [J, BC] with w_j·x_{a_j}·x_{b_j} (the updates' form, weights included). x is first
    rounded to the dot's operand dtype, as in `_outer`. The two factors come from dots with 0/1 matrices, or with
    GATHER from `tl.gather` along the K axis: the same values (one nonzero term per dot), without the dots."""
    if DOT == 2:
        x = x.to(tl.bfloat16)
    if GATHER:
        a, b, w = _pair_cols(BK, P, NP)
        x = x.to(tl.float32)
        J: tl.constexpr = a.shape[0]
        if TRANSPOSED:
            C: tl.constexpr = x.shape[1]
            xa = tl.gather(x, tl.broadcast_to(a[:, None], (J, C)), 0)
            xb = tl.gather(x, tl.broadcast_to(b[:, None], (J, C)), 0)
            return xa * xb * w[:, None]
        else:
            C: tl.constexpr = x.shape[0]
            xa = tl.gather(x, tl.broadcast_to(a[None, :], (C, J)), 1)
            xb = tl.gather(x, tl.broadcast_to(b[None, :], (C, J)), 1)
            return xa * xb
    rep_a, rep_b = _pair_reps(BK, TRANSPOSED, TRANSPOSED, P, NP)
    if TRANSPOSED:
        return _mm(rep_a, x, DOT) * _mm(rep_b, x, DOT)
    else:
        return _mm(x, rep_a, DOT) * _mm(x, rep_b, DOT)


@triton.jit
def _pair_contract(g, x, BK: tl.constexpr, DOT: tl.constexpr, P: tl.constexpr, NP: tl.constexpr):
    """½ ∂/∂x_r of Σ_j g_j x_{a_j} x_{b_j}, per row: g [BC, J], x [BC, BK] -> [BC, BK]. With g_j = w_j·(G_{a_j b_j})
    for a symmetric G this is Σ_{b≠r} G_rb x_b, the off-diagonal part of `_contract`."""
    rep_a, rep_b = _pair_reps(BK, False, False, P, NP)
    rep_at, rep_bt = _pair_reps(BK, True, False, P, NP)
    xa = _mm(x, rep_a, DOT)
    xb = _mm(x, rep_b, DOT)
    # tf32 operands keep the products' precision in bf16 mode, and their range in fp16 mode (g·x_b is the state times
    # dO/den times a key: past fp16's 65504 for large inputs, where dq and dk themselves are not)
    PREC: tl.constexpr = 1 if DOT == 2 or DOT == 4 else DOT
    return 0.5 * (_mm(g * xb, rep_at, PREC) + _mm(g * xa, rep_bt, PREC))


@triton.jit
def _pair_state_load(h, offs_k, offs_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, P: tl.constexpr,
                     NP: tl.constexpr):
    """From a Taylor-order state h [F, V] (order 2 as K² rows (a, b)): the diagonal block [BK, BV] and the pair
    rows [J, BV], row j = h_(a,b) + h_(b,a) where w_j = 2 and h_(a,b) where w_j = 1 (its mirror has its own row),
    so that the pair form computes what the K² form computes from h, symmetric or not."""
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
                 BV: tl.constexpr, EXPAND: tl.constexpr):
    """The order-2 state in the mode's layout, (Sd, S2, S2b): zero, or with LOAD read from the order-2 rows of a
    Taylor-order state h [F, V] (h already at the sequence). S2 is [K², BV] (modes 0, 1), [BK, BK, BV] (mode 2)
    or the pair rows (mode 3; their first half in modes 5 and 6, S2b the second); Sd is the diagonal of modes 3, 5
    and 6."""
    NP: tl.constexpr = 2 if EXPAND >= 5 else 1
    Sd = tl.zeros([BK, BV], dtype=tl.float32)
    S2b = tl.zeros([BK * (BK // 2) // 2, BV], dtype=tl.float32)
    if EXPAND == 2:
        S2 = tl.zeros([BK, BK, BV], dtype=tl.float32)
        if LOAD:
            off3, m3 = _o2_offsets(offs_k, offs_v, K, V)
            S2 += tl.load(h + off3, mask=m3, other=0.0)
    elif EXPAND >= 3:
        S2 = tl.zeros([BK * (BK // 2) // NP, BV], dtype=tl.float32)
        if LOAD:
            hd, hp = _pair_state_load(h, offs_k, offs_v, K, V, BK, 0, NP)
            Sd += hd
            S2 += hp
            if NP == 2:
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
                  EXPAND: tl.constexpr):
    """c·(the order-2 state of `_order2_init`'s layout) into the order-2 rows of a Taylor-order state h [F, V]."""
    if EXPAND == 2:
        off3, m3 = _o2_offsets(offs_k, offs_v, K, V)
        tl.store(h + off3, c * S2, mask=m3)
    elif EXPAND >= 3:
        NP: tl.constexpr = 2 if EXPAND >= 5 else 1
        _pair_state_store(h, Sd, S2, c, offs_k, offs_v, K, V, BK, 0, NP)
        if NP == 2:
            _pair_state_store(h, Sd, S2b, c, offs_k, offs_v, K, V, BK, 1, 2)
    else:
        offs_kk = tl.arange(0, BK * BK)
        row_kk = 1 + K + (offs_kk // BK) * K + offs_kk % BK
        m_kk = ((offs_kk // BK) < K) & ((offs_kk % BK) < K)
        tl.store(h + row_kk[:, None] * V + offs_v[None, :], c * S2, mask=m_kk[:, None] & (offs_v < V)[None, :])


@triton.jit
def _order2_read(x, Sd, S2, S2b, rep_a, rep_b, BC: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                 EXPAND: tl.constexpr):
    """(x⊗x)·S for the order-2 state (Sd, S2, S2b) in `_order2_init`'s layout: x [BC, BK] -> [BC, BV]."""
    NP: tl.constexpr = 2 if EXPAND >= 5 else 1
    if EXPAND == 2:
        return _o2_read(x, S2, BC, BK, DOT)
    elif EXPAND >= 3:
        o2 = _mm(x * x, Sd, DOT) + _mm(_pairs(x, BK, DOT, 0, NP, False, EXPAND == 6), S2, DOT)
        if EXPAND >= 5:
            o2 += _mm(_pairs(x, BK, DOT, 1, 2, False, EXPAND == 6), S2b, DOT)
        return o2
    else:
        return _mm(_outer(x, rep_a, rep_b, BC, BK, DOT, EXPAND), S2, DOT)  # (x⊗x) [BC, K²] · S2


@triton.jit
def _order2_update(x, xt, y, Sd, S2, S2b, rep_a, rep_b, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   DOT: tl.constexpr, EXPAND: tl.constexpr):
    """(Sd, S2, S2b) + Σ_c (x_c⊗x_c) y_cᵀ in `_order2_init`'s layout: x [BC, BK], xt = xᵀ, y [BC, BV]."""
    NP: tl.constexpr = 2 if EXPAND >= 5 else 1
    if EXPAND == 2:
        S2 += _o2_update(x, y, BC, BK, BV, DOT)
    elif EXPAND >= 3:
        Sd += _mm(xt * xt, y, DOT)
        S2 += _mm(_pairs(xt, BK, DOT, 0, NP, True, EXPAND == 6), y, DOT)
        if EXPAND >= 5:
            S2b += _mm(_pairs(xt, BK, DOT, 1, 2, True, EXPAND == 6), y, DOT)
    else:
        S2 += _mm(tl.trans(_outer(x, rep_a, rep_b, BC, BK, DOT, EXPAND)), y, DOT)
    return Sd, S2, S2b


@triton.jit
def _order2_contract(y, x, Sd, S2, S2b, rep_a, rep_b, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     DOT: tl.constexpr, EXPAND: tl.constexpr):
    """Σ_b (y·S[a, b])·x_b for the symmetric order-2 state S in `_order2_init`'s layout: y [BC, BV], x [BC, BK]
    -> [BC, BK]; the order-2 part of the gradient of (x⊗x)·S·y / 2 with respect to x."""
    NP: tl.constexpr = 2 if EXPAND >= 5 else 1
    if EXPAND == 2:
        return _o2_contract(y, S2, x, BC, BK, BV, DOT)
    elif EXPAND >= 3:
        g = x * _mm(y, tl.trans(Sd), DOT) + _pair_contract(_mm(y, tl.trans(S2), DOT), x, BK, DOT, 0, NP)
        if EXPAND >= 5:
            g += _pair_contract(_mm(y, tl.trans(S2b), DOT), x, BK, DOT, 1, 2)
        return g
    else:
        return _contract(_mm(y, tl.trans(S2), DOT), x, rep_a, rep_b, BC, BK, DOT, EXPAND)


@triton.jit
def _fwd_load(q, k, v, start, seg_end, offs_c, offs_k, offs_v, m_k, m_v, H: tl.constexpr, K: tl.constexpr,
              V: tl.constexpr, EXPAND: tl.constexpr, STATE_ONLY: tl.constexpr):
    """The forward's loads of the chunk at `start` (zeros past seg_end): k [BC, BK], v [BC, BV], kᵀ [BK, BC]
    (mode ≥ 3 loads it transposed from memory; the others transpose in registers) and q [BC, BK] (k again under
    STATE_ONLY, which reads no queries)."""
    t = start + offs_c
    m_t = t < seg_end
    bk = tl.load(k + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    bv = tl.load(v + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    if EXPAND >= 3:
        bkt = tl.load(k + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
    else:
        bkt = tl.trans(bk)
    if STATE_ONLY:
        bq = bk
    else:
        bq = tl.load(q + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    return bk, bv, bkt, bq


@triton.jit
def _fwd_kernel(q, k, v, o, den, hv0, hz0, hvT, hzT, scale, T, SEG,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                USE_H0: tl.constexpr, STORE_HT: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
                EXPAND: tl.constexpr, STATE_ONLY: tl.constexpr):
    """One program: value block i_v, segment i_s (SEG tokens, a multiple of BC) of sequence i_bh.

    hv0/hz0 and hvT/hzT are indexed per (sequence, segment): [B·H, NS, F, V] and [B·H, NS, F]. STATE_ONLY
    skips the output and only sums the segment's state (the first pass of the segmented forward)."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_v, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NS = tl.num_programs(1)
    i_b, i_h = i_bh // H, i_bh % H
    F: tl.constexpr = 1 + K + K * K
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    causal = offs_c[:, None] >= offs_c[None, :]
    rep_a, rep_b = _expanders(BK)

    q += i_b.to(tl.int64) * T * H * K + i_h * K
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    o += i_b.to(tl.int64) * T * H * V + i_h * V
    if NORMALIZE:
        den += i_b.to(tl.int64) * T * H + i_h

    S0 = tl.zeros([BV], dtype=tl.float32)
    S1 = tl.zeros([BK, BV], dtype=tl.float32)
    n = 0.0
    z1 = tl.zeros([BK], dtype=tl.float32)
    Z2 = tl.zeros([BK, BK], dtype=tl.float32)
    if USE_H0:
        hv0 += (i_bh * NS + i_s).to(tl.int64) * F * V
        hz0 += (i_bh * NS + i_s).to(tl.int64) * F
        S0 += tl.load(hv0 + offs_v, mask=m_v, other=0.0)
        S1 += tl.load(hv0 + (1 + offs_k[:, None]) * V + offs_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        n += tl.load(hz0)
        z1 += tl.load(hz0 + 1 + offs_k, mask=m_k, other=0.0)
        Z2 += tl.load(hz0 + 1 + K + offs_k[:, None] * K + offs_k[None, :], mask=m_k[:, None] & m_k[None, :],
                      other=0.0)

    Sd, S2, S2b = _order2_init(hv0, USE_H0, offs_k, offs_v, K, V, BK, BV, EXPAND)

    seg_end = tl.minimum(T, (i_s + 1) * SEG)
    for start in range(i_s * SEG, seg_end, BC):
        t = start + offs_c
        m_t = t < seg_end
        bk, bv, bkt, bq = _fwd_load(q, k, v, start, seg_end, offs_c, offs_k, offs_v, m_k, m_v, H, K, V, EXPAND,
                                    STATE_ONLY)
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
                o2 = _order2_read(qs, Sd * r, S2 * r, S2b * r, rep_a, rep_b, BC, BK, DOT, EXPAND) * nn
                o1 = _mm(qs, S1 * r, DOT) * nn
            else:
                o2 = _order2_read(qs, Sd, S2, S2b, rep_a, rep_b, BC, BK, DOT, EXPAND)
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
        Sd, S2, S2b = _order2_update(kf, kft, bv, Sd, S2, S2b, rep_a, rep_b, BC, BK, BV, DOT, EXPAND)
        n += tl.sum(m_t.to(tl.float32), 0)
        z1 += tl.sum(kf, 0)
        Z2 += _mm(kft, kf, 0)

    if STORE_HT:
        hvT += (i_bh * NS + i_s).to(tl.int64) * F * V
        hzT += (i_bh * NS + i_s).to(tl.int64) * F
        tl.store(hvT + offs_v, S0, mask=m_v)
        tl.store(hvT + (1 + offs_k[:, None]) * V + offs_v[None, :], S1, mask=m_k[:, None] & m_v[None, :])
        _order2_store(hvT, Sd, S2, S2b, 1.0, offs_k, offs_v, K, V, BK, EXPAND)
        if i_v == 0:
            tl.store(hzT, n)
            tl.store(hzT + 1 + offs_k, z1, mask=m_k)
            tl.store(hzT + 1 + K + offs_k[:, None] * K + offs_k[None, :], Z2, mask=m_k[:, None] & m_k[None, :])


@triton.jit
def _dden_kernel(do, o, den, dden, R, V: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr):
    """dden = -Σ_v dO·o / den over rows of [B·T·H, V]: the gradient that reaches the denominator."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, BV)
    m = (r[:, None] < R) & (c[None, :] < V)
    bdo = tl.load(do + r[:, None].to(tl.int64) * V + c[None, :], mask=m, other=0.0).to(tl.float32)
    bo = tl.load(o + r[:, None].to(tl.int64) * V + c[None, :], mask=m, other=0.0).to(tl.float32)
    d = tl.load(den + r, mask=r < R, other=1.0)
    tl.store(dden + r, -tl.sum(bdo * bo, 1) / d, mask=r < R)


@triton.jit
def _load_dout(do, den, dden, t, m_t, offs_v, m_v, first, H: tl.constexpr, V: tl.constexpr, BC: tl.constexpr,
               NORMALIZE: tl.constexpr):
    """The gradients reaching the numerator, dO/den [BC, BV], and the denominator [BC]; the latter only in the
    first V block (zero elsewhere), so that sums over V blocks count it once."""
    dnum = tl.load(do + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    dnum = dnum.to(tl.float32)
    if NORMALIZE:
        d = tl.load(den + t * H, mask=m_t, other=1.0)
        dnum = dnum / d[:, None]
        dd = tl.where(first, tl.load(dden + t * H, mask=m_t, other=0.0), 0.0)
    else:
        dd = tl.zeros([BC], dtype=tl.float32)
    return dnum, dd


@triton.jit
def _bwd_dq_kernel(q, k, v, do, den, dden, dq, hv0, hz0, scale, T,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                   USE_H0: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr, EXPAND: tl.constexpr):
    """dq, first chunk to last, recomputing the forward state. dq: [NV, B, T, H, K] partial sums over V blocks."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    F: tl.constexpr = 1 + K + K * K
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    causal = offs_c[:, None] >= offs_c[None, :]
    rep_a, rep_b = _expanders(BK)
    first = i_v == 0

    q += i_b.to(tl.int64) * T * H * K + i_h * K
    k += i_b.to(tl.int64) * T * H * K + i_h * K
    dq += (i_v * (tl.num_programs(1) // H) + i_b).to(tl.int64) * T * H * K + i_h * K
    v += i_b.to(tl.int64) * T * H * V + i_h * V
    do += i_b.to(tl.int64) * T * H * V + i_h * V
    if NORMALIZE:
        den += i_b.to(tl.int64) * T * H + i_h
        dden += i_b.to(tl.int64) * T * H + i_h

    S1 = tl.zeros([BK, BV], dtype=tl.float32)
    z1 = tl.zeros([BK], dtype=tl.float32)
    Z2 = tl.zeros([BK, BK], dtype=tl.float32)
    if USE_H0:
        hv0 += i_bh.to(tl.int64) * F * V
        hz0 += i_bh.to(tl.int64) * F
        S1 += tl.load(hv0 + (1 + offs_k[:, None]) * V + offs_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        z1 += tl.load(hz0 + 1 + offs_k, mask=m_k, other=0.0)
        Z2 += tl.load(hz0 + 1 + K + offs_k[:, None] * K + offs_k[None, :], mask=m_k[:, None] & m_k[None, :],
                      other=0.0)

    Sd, S2, S2b = _order2_init(hv0, USE_H0, offs_k, offs_v, K, V, BK, BV, EXPAND)

    for start in range(0, T, BC):
        t = start + offs_c
        m_t = t < T
        bq = tl.load(q + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bk = tl.load(k + t[:, None] * H * K + offs_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        bv = tl.load(v + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        dnum, dd = _load_dout(do, den, dden, t, m_t, offs_v, m_v, first, H, V, BC, NORMALIZE)
        qs = bq.to(tl.float32) * scale
        kf = bk.to(tl.float32)
        if EXPAND >= 3:
            bkt = tl.load(k + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        else:
            bkt = tl.trans(bk)
        kft = bkt.to(tl.float32)

        s = _mm(bq, bkt, DOT) * scale  # [BC, BC]
        dp = _mm(dnum, tl.trans(bv), DOT) + dd[:, None]
        ds = tl.where(causal, dp * (1.0 + s), 0.0)
        dqs = _mm(ds, bk, DOT) + _mm(dnum, tl.trans(S1), DOT)
        dqs += _order2_contract(dnum, qs, Sd, S2, S2b, rep_a, rep_b, BC, BK, BV, DOT, EXPAND)
        if NORMALIZE:
            dqs += dd[:, None] * (z1[None, :] + _mm(qs, Z2, 0))
        tl.store(dq + t[:, None] * H * K + offs_k[None, :], dqs * scale, mask=m_t[:, None] & m_k[None, :])

        S1 += _mm(kft, bv, DOT)
        Sd, S2, S2b = _order2_update(kf, kft, bv, Sd, S2, S2b, rep_a, rep_b, BC, BK, BV, DOT, EXPAND)
        z1 += tl.sum(kf, 0)
        Z2 += _mm(kft, kf, 0)


@triton.jit
def _bwd_dkv_kernel(q, k, v, do, den, dden, dk, dv, dhvT, dhzT, dhv0, dhz0, scale, T,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr,
                    EXPAND: tl.constexpr):
    """dk (partial over V blocks, [NV, B, T, H, K]) and dv, last chunk to first, carrying the reverse states
    D0 = Σ dnum, D1 = Σ q_s dnumᵀ, D2 = Σ (q_s⊗q_s) dnumᵀ and d0, d1, d2 likewise with the denominator's
    gradient. What is left at t = 0 is the gradient of the initial state (order 2 halved)."""
    scale = tl.cast(scale, tl.float32)  # a no-op for the fp32 Triton passes; torch.compile passes fp64
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    F: tl.constexpr = 1 + K + K * K
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = offs_k < K, offs_v < V
    causal_t = offs_c[:, None] <= offs_c[None, :]  # [key j, query i]: j ≤ i
    rep_a, rep_b = _expanders(BK)
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

    D0 = tl.zeros([BV], dtype=tl.float32)
    D1 = tl.zeros([BK, BV], dtype=tl.float32)
    d0 = 0.0
    d1 = tl.zeros([BK], dtype=tl.float32)
    d2 = tl.zeros([BK, BK], dtype=tl.float32)
    if USE_DHT:
        # dhvT/dhzT hold the final state's gradient with order 2 already symmetrised (G + Gᵀ)
        dhvT += i_bh.to(tl.int64) * F * V
        dhzT += i_bh.to(tl.int64) * F
        D0 += tl.load(dhvT + offs_v, mask=m_v, other=0.0)
        D1 += tl.load(dhvT + (1 + offs_k[:, None]) * V + offs_v[None, :], mask=m_k[:, None] & m_v[None, :],
                      other=0.0)
        if i_v == 0:
            # the denominator's state enters dk once, through the first V block
            d0 += tl.load(dhzT)
            d1 += tl.load(dhzT + 1 + offs_k, mask=m_k, other=0.0)
            d2 += tl.load(dhzT + 1 + K + offs_k[:, None] * K + offs_k[None, :], mask=m_k[:, None] & m_k[None, :],
                          other=0.0)

    Dd, D2, D2b = _order2_init(dhvT, USE_DHT, offs_k, offs_v, K, V, BK, BV, EXPAND)

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
        if EXPAND >= 3:
            bqt = tl.load(q + t[None, :] * H * K + offs_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        else:
            bqt = tl.trans(bq)
        qst = bqt.to(tl.float32) * scale

        st = _mm(bk, bqt, DOT) * scale  # [BC keys, BC queries]
        wt = tl.where(causal_t, 1.0 + st + 0.5 * st * st, 0.0)
        o2 = _order2_read(kf, Dd, D2, D2b, rep_a, rep_b, BC, BK, DOT, EXPAND)
        bdv = _mm(wt, dnum, DOT) + D0[None, :] + _mm(kf, D1, DOT) + 0.5 * o2
        tl.store(dv + t[:, None] * H * V + offs_v[None, :], bdv.to(dv.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])

        dpt = _mm(bv, tl.trans(dnum), DOT) + dd[None, :]
        dst = tl.where(causal_t, dpt * (1.0 + st), 0.0)
        bdk = _mm(dst, qs, DOT) + _mm(bv, tl.trans(D1), DOT)
        bdk += _order2_contract(bv, kf, Dd, D2, D2b, rep_a, rep_b, BC, BK, BV, DOT, EXPAND)
        # d1, d2 hold dO's share through the denominator and the final k_sum's gradient, normalised or not
        bdk += d1[None, :] + _mm(kf, d2, 0)
        tl.store(dk + t[:, None] * H * K + offs_k[None, :], bdk, mask=m_t[:, None] & m_k[None, :])

        D0 += tl.sum(dnum, 0)
        D1 += _mm(qst, dnum, DOT)
        Dd, D2, D2b = _order2_update(qs, qst, dnum, Dd, D2, D2b, rep_a, rep_b, BC, BK, BV, DOT, EXPAND)
        d0 += tl.sum(dd, 0)
        d1 += tl.sum(qs * dd[:, None], 0)
        d2 += _mm(qst, qs * dd[:, None], 0)

    if STORE_DH0:
        dhv0 += i_bh.to(tl.int64) * F * V
        dhz0 += i_bh.to(tl.int64) * F
        tl.store(dhv0 + offs_v, D0, mask=m_v)
        tl.store(dhv0 + (1 + offs_k[:, None]) * V + offs_v[None, :], D1, mask=m_k[:, None] & m_v[None, :])
        _order2_store(dhv0, Dd, D2, D2b, 0.5, offs_k, offs_v, K, V, BK, EXPAND)
        if i_v == 0:
            tl.store(dhz0, d0)
            tl.store(dhz0 + 1 + offs_k, d1, mask=m_k)
            tl.store(dhz0 + 1 + K + offs_k[:, None] * K + offs_k[None, :], 0.5 * d2,
                     mask=m_k[:, None] & m_k[None, :])


def _config(K: int, V: int, dtype: torch.dtype, kind: str):
    """Block sizes and launch shape for kind "fwd" or "bwd": (BK, BV, BC, num_warps, num_stages).

    Measured on an H200 at B=8, H=16, K=16, V=64, bf16 (experiments/LOG.md, session 3: 20 mode x config
    variants): in mode 3, BV=32 with 4 warps was the fastest for both passes, the forward at BC=64 (0.462 ms at
    T=4096, against 0.504 at BC=32) and the backward at BC=32. In v0, BC=64 with bf16 operands made the
    backward fault (illegal address) on Triton 3.6 in some configurations, so the backward keeps BC=32; the
    fp32 forward keeps it too (BC=64 not timed there), the fp16 one where it takes tf32 operands (FP16_DOT).
    """
    BK = max(16, next_power_of_2(K))
    BV = min(32, max(16, next_power_of_2(V)))
    # BC=64 only in mode 3 (BK ≤ 16): at K=32 (the reshape mode) it needs 237,568 B of shared memory, over the
    # H200's 232,448 (OutOfResources in the GPU tests). fp16 with fp16 operands (FP16_DOT) as bf16: on the H200
    # (session 14, T=4096) its fused forward took 0.410 ms at BC=64 against 0.515 at 32 (tf32 operands: 0.585 / 0.746).
    half = dtype == torch.bfloat16 or (dtype == torch.float16 and FP16_DOT == "fp16")
    BC = 64 if kind == "fwd" and half and BK <= 16 else 32
    return BK, BV, BC, 4, 2


# The forward splits the sequence into segments that run in parallel when the (V block, sequence) programs
# alone are fewer than TARGET_PROGRAMS, keeping at least MIN_SEGMENT_CHUNKS chunks per segment. Measured on the
# H200 at B=8, H=16, K=16, V=64, bf16 (256 programs; experiments/LOG.md): any split was slower (0.38-0.65x: the
# extra state pass and the prefix sum cost more than the shorter chains gain), so segments start only below one
# program per SM (132 SMs), e.g. prefill of one sequence. SEGMENT_TOKENS, when set, forces the segment length
# (tests; a multiple of the chunk).
TARGET_PROGRAMS = 132
# "fused": `_fwd_kernel` above. "split": kernels/based/split.py, a state pass that stores the state entering every
# chunk, then every chunk's output at once (K ≤ 16). On the H200 (session 8, B=8, H=16, T=4096, bf16) the split
# forward took 0.50 ms against the fused 0.385; session 11, with the stored features, 0.371 against 0.384, for 338
# MB of temporaries at that shape (the features and the states), so inference stays fused. "auto" (the default):
# split where a gradient will follow and the backward is split (`split_backward_applies`), fused otherwise. The
# split backward then reuses the entering states the split forward stored instead of recomputing them (its state
# pass, 0.23 ms at that shape), at the cost of keeping them from forward to backward: B·H·⌈T/64⌉·(161·V·2 + 273·4)
# bytes in bf16 (178 MB at that shape, against 168 MB for q, k, v, o); `SAVE_STATES = False` recomputes them.
FORWARD = "auto"
SAVE_STATES = True
# The same choice for the backward: "split" recomputes the split forward's states, runs a reverse state pass and
# then every chunk's dq and dk, dv at once (K ≤ 16). "auto" (the default) takes it where it was measured faster
# and checked on the H200: bf16 and fp16 inputs, K ≤ 16 and 32 < V ≤ 128 (value blocks of 64; `split_backward_
# applies`); forward+backward 1.74 ms against 2.25 ms fused at the benchmark shape (session 8; 1.59 ms with the
# split forward's states kept, FORWARD above, session 9; 1.54 ms with dv pipelined, session 10; 1.27 ms with the
# stored features and fewer launches, session 11). fp32 stays fused. "auto" also leaves small problems fused
# (B·H·T < SPLIT_MIN_WORK), except under CUDA-graph capture or torch.compile: eagerly the host's launch cost
# decides, and the split forward+backward launches 8 Triton kernels against the fused one's 4 (9 before
# split.CONFIG["fuse_dden"]). Session 12 (H200, B·H = 128, bf16, eager, iterations back to back, ms): T=512 split
# 1.12 / fused 0.64, T=1024 1.28 / 0.76, T=2048 1.13 / 1.18, T=4096 1.35 / 2.32, while on the device alone (the
# host hidden) the split is faster at every T (0.39 / 0.60 at T=1024).
BACKWARD = "auto"
SPLIT_MIN_WORK = 1 << 18


def split_backward_applies(K: int, V: int, dtype: torch.dtype, work: int, capturing: bool = False) -> bool:
    """Whether the backward runs kernels/based/split.py's kernels under BACKWARD (see above); work = B·H·T,
    capturing: whether the call is being captured into a CUDA graph (or traced by torch.compile)."""
    if BACKWARD == "split":
        return K <= 16
    if BACKWARD == "auto":
        return (K <= 16 and 32 < V <= 128 and dtype in (torch.bfloat16, torch.float16)
                and (work >= SPLIT_MIN_WORK or capturing))
    return False
MIN_SEGMENT_CHUNKS = 8
SEGMENT_TOKENS: int | None = None


def _segment_tokens(T: int, programs: int, BC: int) -> int:
    """Tokens per segment of the forward (a multiple of BC; ≥ T means one segment)."""
    if SEGMENT_TOKENS is not None:
        if SEGMENT_TOKENS % BC:
            raise ValueError(f"SEGMENT_TOKENS must be a multiple of the chunk ({BC}), got {SEGMENT_TOKENS}")
        return SEGMENT_TOKENS
    n_chunks = cdiv(T, BC)
    segments = min(cdiv(TARGET_PROGRAMS, programs), n_chunks // MIN_SEGMENT_CHUNKS)
    if segments <= 1:
        return n_chunks * BC
    return cdiv(n_chunks, segments) * BC


def _symmetrise_order2(hv: torch.Tensor, K: int) -> torch.Tensor:
    """G + Gᵀ on the order-2 rows of a Taylor-order tensor [B, H, 1+K+K², *] (orders 0 and 1 unchanged)."""
    head, o2 = hv[:, :, : 1 + K], hv[:, :, 1 + K:]
    o2 = o2.reshape(*o2.shape[:2], K, K, *o2.shape[3:])
    return torch.cat([head, (o2 + o2.transpose(2, 3)).flatten(2, 3)], dim=2)


class ChunkBasedFunction(torch.autograd.Function):
    """(q, k, v, hv0, hz0) -> (o, hvT, hzT) with the state in Taylor-order form; see `chunk_based`."""

    @staticmethod
    def forward(ctx, q, k, v, hv0, hz0, scale, output_final_state, normalize, grad_follows):
        B, T, H, K = q.shape
        V = v.shape[-1]
        F = 1 + K + K * K
        BK, BV, BC, num_warps, num_stages = _config(K, V, q.dtype, "fwd")
        NV = cdiv(V, BV)
        o = torch.empty_like(v)
        den = torch.empty(B, T, H, device=q.device, dtype=torch.float32) if normalize else None
        dot = _dot_mode(q.dtype, K)  # the fused backward's (ctx.dot)
        split_dot = _fused_forward_dot(q.dtype, K)  # the split kernels' (fp16 operands for fp16 inputs)
        meta = dict(H=H, K=K, V=V, BK=BK, BV=BV, BC=BC, NORMALIZE=normalize, DOT=split_dot,
                    EXPAND=_expand_mode(BK, forward=True), num_warps=num_warps,
                    num_stages=num_stages)
        SEG = _segment_tokens(T, NV * B * H, BC)
        NS = cdiv(T, SEG)
        # torch.compile counts as capture: its graphs often replay under CUDA graphs (mode="reduce-overhead"), and
        # compiled eagerly the two paths tie at small T (session 13, H200, bf16, B·H = 128, compiled forward+backward
        # in a loop: T=1024 split 0.800 ms / fused 0.796; T=4096 1.341 / 2.255). Both pass the GPU compile test.
        capturing = torch.compiler.is_compiling() or is_capturing(q)
        split_bwd = grad_follows and split_backward_applies(K, V, q.dtype, B * H * T, capturing)
        states = None
        # auto: where the split kernels cannot take fp16 operands (`split.takes_fp16`: settings other than the
        # default stored features), fp16 inputs keep the fused forward (fp16 operands) even where the split backward
        # follows, which then computes the states again (H200, session 14, B·H = 128, forward+backward: T=4096 3.479
        # ms against 3.982 with the split forward's tf32 operands). With fp16 operands in the split kernels (session
        # 15), fp16 takes the split forward as bf16 does: T=4096 1.324 ms against 1.599 with the fused forward.
        fused_fp16 = False
        if split_dot == DOT_FP16:
            from kernels.based import split

            fused_fp16 = split.takes_fp16(split_dot) != DOT_FP16
        # the Gluon forward where it applies and the split backward follows (GLUON_BACKWARD = False), storing every
        # chunk's state as the split forward does (session 16). With the Gluon backward after it (the default),
        # `chunk_based` takes `gluon_backward.GluonBasedFunction` instead of this class.
        gluon = _gluon_for(q, v, normalize) if grad_follows and split_bwd and SAVE_STATES else None
        if gluon is not None:
            o, den, hvT, hzT, states = gluon.gluon_forward(q, k, v, scale, hv0, hz0, output_final_state,
                                                           store_states="pairs")
        elif (FORWARD == "split" and K <= 16) or (FORWARD == "auto" and split_bwd and not fused_fp16):
            from kernels.based.split import split_forward

            o, den, hvT, hzT, states = split_forward(q, k, v, hv0, hz0, scale, output_final_state, normalize,
                                                     split_dot, return_states=True)
            if not (split_bwd and SAVE_STATES):
                states = None
        elif NS == 1:
            hvT = torch.empty(B, H, F, V, device=q.device, dtype=torch.float32) if output_final_state else None
            hzT = torch.empty(B, H, F, device=q.device, dtype=torch.float32) if output_final_state else None
            launch(_fwd_kernel, (NV, 1, B * H), q, k, v, o, den, hv0, hz0, hvT, hzT, scale, T, SEG,
                   USE_H0=hv0 is not None, STORE_HT=output_final_state, STATE_ONLY=False, **meta)
        else:
            # Pass 1: each segment's own state sums, all segments in parallel. Then the state entering segment
            # s is h0 + Σ_{s' < s} (an exclusive prefix sum over segments), and pass 2 runs the segments in
            # parallel from those states: NS× more programs, chains NS× shorter.
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
        ctx.save_for_backward(q, k, v, o, den, hv0, hz0, *(states or (None, None)))
        ctx.scale, ctx.normalize, ctx.split_bwd, ctx.dot, ctx.split_dot = scale, normalize, split_bwd, dot, split_dot
        return o, hvT, hzT

    @staticmethod
    def backward(ctx, do, dhvT, dhzT):
        q, k, v, o, den, hv0, hz0, hs, zs = ctx.saved_tensors
        B, T, H, K = q.shape
        V = v.shape[-1]
        F = 1 + K + K * K
        BK, BV, BC, num_warps, num_stages = _config(K, V, q.dtype, "bwd")
        NV = cdiv(V, BV)
        do = do.contiguous()
        dden = None
        split_dden = False
        if ctx.split_bwd:
            from kernels.based.split import fuses_dden

            split_dden = fuses_dden(ctx.normalize)
        if ctx.normalize:
            dden = torch.empty_like(den)
            R = B * T * H
            BR = 32
            if not split_dden:
                launch(_dden_kernel, (cdiv(R, BR),), do, o, den, dden, R, V=V, BR=BR, BV=next_power_of_2(V))
        use_dht = dhvT is not None or dhzT is not None
        if use_dht:
            dhvT = torch.zeros(B, H, F, V, device=q.device, dtype=torch.float32) if dhvT is None else dhvT
            dhzT = torch.zeros(B, H, F, device=q.device, dtype=torch.float32) if dhzT is None else dhzT
            dhvT = _symmetrise_order2(dhvT.float(), K).contiguous()
            dhzT = _symmetrise_order2(dhzT.float(), K).contiguous()
        if ctx.split_bwd:  # the forward's choice, which kept its states for it
            from kernels.based.split import split_backward

            dq, dk, dv, dhv0, dhz0 = split_backward(q, k, v, do, den, dden, hv0, hz0, dhvT if use_dht else None,
                                                    dhzT if use_dht else None, ctx.scale, ctx.normalize,
                                                    ctx.split_dot, states=None if hs is None else (hs, zs),
                                                    o=o if split_dden else None)
            return dq.to(q.dtype), dk.to(k.dtype), dv, dhv0, dhz0, None, None, None, None
        store_dh0 = hv0 is not None
        dhv0 = torch.empty_like(hv0) if store_dh0 else None
        dhz0 = torch.empty_like(hz0) if store_dh0 else None
        dq = torch.empty(NV, B, T, H, K, device=q.device, dtype=torch.float32)
        dk = torch.empty(NV, B, T, H, K, device=q.device, dtype=torch.float32)
        dv = torch.empty_like(v)
        meta = dict(H=H, K=K, V=V, BK=BK, BV=BV, BC=BC, NORMALIZE=ctx.normalize, DOT=ctx.dot,
                    EXPAND=_expand_mode(BK, forward=False), num_warps=num_warps, num_stages=num_stages)
        launch(_bwd_dq_kernel, (NV, B * H), q, k, v, do, den, dden, dq, hv0, hz0, ctx.scale, T, USE_H0=hv0 is not None,
               **meta)
        launch(_bwd_dkv_kernel, (NV, B * H), q, k, v, do, den, dden, dk, dv, dhvT, dhzT, dhv0, dhz0, ctx.scale, T,
               USE_DHT=use_dht, STORE_DH0=store_dh0, **meta)
        dq = dq.sum(0).to(q.dtype)
        dk = dk.sum(0).to(k.dtype)
        return dq, dk, dv, dhv0, dhz0, None, None, None, None


def _gluon_for(q: torch.Tensor, v: torch.Tensor, normalize: bool):
    """kernels.based.gluon where its forward takes this call (GLUON_FORWARD, FORWARD = "auto" and `gluon.applies`),
    else None, as where this Triton has no Gluon (it came with Triton 3.5). The caller checks what follows."""
    if not (GLUON_FORWARD and FORWARD == "auto" and q.is_cuda):
        return None
    try:
        from kernels.based import gluon
    except ImportError:
        return None
    return gluon if gluon.applies(q, v, normalize) else None


def chunk_based(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                initial_state: tuple[torch.Tensor, torch.Tensor] | None = None, output_final_state: bool = False,
                normalize: bool = True):
    """Based linear attention, chunked, in Triton: o_i = Σ_{j≤i} w_ij v_j / Σ_{j≤i} w_ij, w = 1 + s + s²/2.

    Args:
        q, k: [B, T, H, K], K ≤ 32 (16 in the released models). v: [B, T, H, V], V ≤ 128. fp32, fp16 or bf16.
        scale: s = scale·q·k; defaults to 1/√K.
        initial_state: (kv [B, H, E, V], k_sum [B, H, E]) in fp32, E = 1 + K + K(K+1)/2, FLA TaylorFeatureMap
            order (kv = Σ φ(k) vᵀ, k_sum = Σ φ(k)). Gradients reach it.
        output_final_state: also return the state after the last token, same layout, fp32.
        normalize: divide by the denominator; False returns the numerator alone.
    Returns:
        o [B, T, H, V] in v's dtype, and (kv, k_sum) or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, H, V]; got {q.shape}, {k.shape}, {v.shape}")
    if K > 32 or V > 128:
        raise ValueError(f"chunk_based supports K ≤ 32 and V ≤ 128, got K={K}, V={V}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_devices("chunk_based", q, k, v, *(initial_state or ()))
    scale = K**-0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    hv0 = hz0 = None
    if initial_state is not None:
        hv0, hz0 = state_to_orders(initial_state[0].float(), initial_state[1].float())
        hv0, hz0 = hv0.contiguous(), hz0.contiguous()
    grad_follows = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, *(initial_state or ())))
    gluon = _gluon_for(q, v, normalize)
    if gluon is not None and not grad_follows:
        o, hvT, hzT = gluon.gluon_forward(q, k, v, scale, hv0, hz0, output_final_state)
        return o, (orders_to_state(hvT, hzT) if output_final_state else None)
    if gluon is not None and GLUON_BACKWARD and BACKWARD == "auto":  # Gluon forward and backward, lean on the host
        from kernels.based.gluon_backward import GluonBasedFunction

        o, hvT, hzT = GluonBasedFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), hv0, hz0, scale,
                                               output_final_state)
        return o, (orders_to_state(hvT, hzT) if output_final_state else None)
    o, hvT, hzT = ChunkBasedFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), hv0, hz0, scale,
                                           output_final_state, normalize, grad_follows)
    final_state = orders_to_state(hvT, hzT) if output_final_state else None
    return o, final_state
