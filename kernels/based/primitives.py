"""What the Based Triton forms share: the dots' operand precision (DOT_*, `_mm`; fp32 accumulation), the pair
layout of the symmetric order-2 state (kernels/based/README.md, "Three Taylor orders"; each pair feature x_a·x_b is
a product of two dots with 0/1 matrices) and the row maps between state layouts (`gather_rows`)."""

import functools

import torch
import triton
import triton.language as tl

DOT_IEEE, DOT_TF32, DOT_BF16, DOT_TF32X3, DOT_FP16 = 0, 1, 2, 3, 4


def backward_dot(dtype: torch.dtype, K: int = 16) -> int:
    """The fused backward's DOT: fp32 tf32x3 (≈ fp32's accuracy on the tensor cores; ieee at K > 16, where its split
    operands overflow shared memory), fp16 tf32 (fp32's range: the state and dO/den leave fp16's), bf16 bf16."""
    if dtype == torch.float32:
        return DOT_TF32X3 if K <= 16 else DOT_IEEE
    if dtype == torch.float16:
        return DOT_TF32
    if dtype == torch.bfloat16:
        return DOT_BF16
    raise TypeError(f"chunk_based supports fp32, fp16 and bf16 inputs, got {dtype}")


def forward_dot(dtype: torch.dtype, K: int = 16) -> int:
    """The fused forward's DOT: `backward_dot`'s, except fp16 operands for fp16 (the forward keeps what it carries in
    fp16's range)."""
    return DOT_FP16 if dtype == torch.float16 else backward_dot(dtype, K)


@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """a @ b with fp32 accumulation; DOT picks the operand precision (DOT_*: bf16, fp16, tf32, tf32x3 or ieee)."""
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
def _pair_cols(BK: tl.constexpr, P: tl.constexpr, NP: tl.constexpr):
    """Part P of NP of the pair rows: a_j, b_j = (a_j + d) mod BK and the weight w_j, so that for symmetric S
    Σ_{a≠b} x_a x_b S_ab = Σ_j w_j x_{a_j} x_{b_j} S_{a_j b_j}."""
    j = P * (BK * (BK // 2) // NP) + tl.arange(0, BK * (BK // 2) // NP)  # part P of NP (NP = 2: the two halves)
    d = 1 + j // BK
    a = j % BK
    b = (a + d) % BK
    w = tl.where(d < BK // 2, 2.0, 1.0)
    return a, b, w


@triton.jit
def _pair_reps(BK: tl.constexpr, TRANSPOSED: tl.constexpr, WEIGHTED: tl.constexpr, P: tl.constexpr,
               NP: tl.constexpr):
    """0/1 matrices selecting a_j and b_j: [BK, J] (x @ rep puts x_{a_j} in column j), or [J, BK] transposed;
    WEIGHTED puts w_j in the a_j matrix."""
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
def _pairs(x, BK: tl.constexpr, DOT: tl.constexpr, P: tl.constexpr, NP: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The pair features of part P: x [BC, BK] -> [BC, J], x_{a_j}·x_{b_j} (reads), or TRANSPOSED x [BK, BC] -> [J, BC]
    with w_j (updates); x rounded to the operand dtype first, each factor a dot with a 0/1 matrix (exact)."""
    if DOT == 2:
        x = x.to(tl.bfloat16)
    rep_a, rep_b = _pair_reps(BK, TRANSPOSED, TRANSPOSED, P, NP)
    if TRANSPOSED:
        return _mm(rep_a, x, DOT) * _mm(rep_b, x, DOT)
    else:
        return _mm(x, rep_a, DOT) * _mm(x, rep_b, DOT)


@triton.jit
def _pair_contract(g, x, BK: tl.constexpr, DOT: tl.constexpr, P: tl.constexpr, NP: tl.constexpr):
    """½ ∂/∂x_r of Σ_j g_j x_{a_j} x_{b_j}: g [BC, J], x [BC, BK] -> [BC, BK]; with g_j = w_j·G_{a_j b_j}, G symmetric,
    Σ_{b≠r} G_rb x_b."""
    rep_a, rep_b = _pair_reps(BK, False, False, P, NP)
    rep_at, rep_bt = _pair_reps(BK, True, False, P, NP)
    xa = _mm(x, rep_a, DOT)
    xb = _mm(x, rep_b, DOT)
    # tf32 operands keep the products' precision in bf16 mode, and their range in fp16 mode (g·x_b is the state times
    # dO/den times a key: past fp16's 65504 for large inputs, where dq and dk themselves are not)
    PREC: tl.constexpr = 1 if DOT == 2 or DOT == 4 else DOT
    return 0.5 * (_mm(g * xb, rep_at, PREC) + _mm(g * xa, rep_bt, PREC))


@triton.jit
def _load_dout(do, den, dden, t, m_t, offs_v, m_v, first, H: tl.constexpr, V: tl.constexpr, BC: tl.constexpr,
               NORMALIZE: tl.constexpr):
    """dO/den [BC, BV] and the denominator's gradient [BC], the latter in the first V block only (so that sums over
    V blocks count it once)."""
    dnum = tl.load(do + t[:, None] * H * V + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    dnum = dnum.to(tl.float32)
    if NORMALIZE:
        d = tl.load(den + t * H, mask=m_t, other=1.0)
        dnum = dnum / d[:, None]
        dd = tl.where(first, tl.load(dden + t * H, mask=m_t, other=0.0), 0.0)
    else:
        dd = tl.zeros([BC], dtype=tl.float32)
    return dnum, dd


@functools.cache
def invert_rows(rows: tuple[int, ...], K: int) -> tuple[int, ...]:
    """For each row of the Taylor-order form [1 + K + K²], the first of `rows` that holds it, or else its mirror
    (b, a): order 2 is symmetric."""
    where: dict = {}
    for r, t in enumerate(rows):
        where.setdefault(t, r)
    out = []
    for t in range(1 + K + K * K):
        a, b = divmod(t - 1 - K, K)
        out.append(where[t] if t in where else where[1 + K + b * K + a])
    return tuple(out)


@functools.cache
def _tensor(values: tuple, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, made once, so that calls under CUDA-graph capture copy nothing."""
    return torch.tensor(values, device=device)


def gather_rows(x: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """x [N, F, *] -> [N, len(rows), *], contiguous: row r = x[:, rows[r]], zero where rows[r] = -1."""
    return torch.cat([x, x.new_zeros(x.shape[0], 1, *x.shape[2:])], 1)[:, _tensor(rows, x.device)].contiguous()


@functools.cache
def _scatter_index(rows: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `rows` that hold a row (not -1) and the rows they hold, on `device`, made once."""
    keep = [r for r, t in enumerate(rows) if t >= 0]
    return torch.tensor(keep, device=device), torch.tensor([rows[r] for r in keep], device=device)


def scatter_rows(x: torch.Tensor, rows: tuple[int, ...], n: int) -> torch.Tensor:
    """The transpose of `gather_rows` (weights 1): x [N, len(rows), *] -> [N, n, *], out[:, rows[r]] += x[:, r]."""
    keep, into = _scatter_index(rows, x.device)
    return x.new_zeros(x.shape[0], n, *x.shape[2:]).index_add_(1, into, x[:, keep])


def symmetrise_order2(hv: torch.Tensor, K: int) -> torch.Tensor:
    """G + Gᵀ on the order-2 rows of a Taylor-order tensor [B, H, 1+K+K², *] in fp32 (orders 0 and 1 unchanged)."""
    hv = hv.float()
    head, o2 = hv[:, :, : 1 + K], hv[:, :, 1 + K:]
    o2 = o2.reshape(*o2.shape[:2], K, K, *o2.shape[3:])
    return torch.cat([head, (o2 + o2.transpose(2, 3)).flatten(2, 3)], dim=2).contiguous()
