"""The decoding step of Based linear attention, one launch updating the state in place:

    kv += φ(k_t) v_tᵀ,  k_sum += φ(k_t),  o_t = φ(q'_t)·kv / φ(q'_t)·k_sum     (q' = q·scale·√K)

One program per (batch, head) streams kv through registers once: no allocation, no host wait, so it can be graphed.
kv is read and written in its storage dtype (fp32, or bf16 to halve the step's largest traffic) and updated in fp32;
o_t is read out of kv as stored, so it equals a readout of the state the step leaves. k_sum is always fp32."""

import triton
import triton.language as tl


@triton.jit
def _features(x_ptr, x_scale, e, K: tl.constexpr, E: tl.constexpr):
    """φ(x_scale·x)[e] for feature indices e: [1, x/K^¼, x_a²/(√2·√K), x_a·x_b/√K for a<b]."""
    # feature e is coef·x[ia]·x[ib], with a missing factor (index -1) read as 1
    is_lin = (e >= 1) & (e < 1 + K)
    is_diag = (e >= 1 + K) & (e < 1 + 2 * K)
    ia = tl.where(is_lin, e - 1, tl.where(is_diag, e - 1 - K, -1))
    ib = tl.where(is_diag, e - 1 - K, -1)
    p = e - (1 + 2 * K)  # index among the off-diagonal pairs, row-major over a < b
    for a in tl.static_range(K - 1):
        start = a * (K - 1) - a * (a - 1) // 2
        in_row = (p >= start) & (p < start + K - 1 - a)
        ia = tl.where(in_row, a, ia)
        ib = tl.where(in_row, a + 1 + p - start, ib)
    xa = tl.where(ia >= 0, tl.load(x_ptr + ia, mask=ia >= 0, other=0.0).to(tl.float32) * x_scale, 1.0)
    xb = tl.where(ib >= 0, tl.load(x_ptr + ib, mask=ib >= 0, other=0.0).to(tl.float32) * x_scale, 1.0)
    rk = 1.0 / tl.sqrt(K * 1.0)
    coef = tl.where(e == 0, 1.0, tl.where(is_lin, tl.sqrt(rk), tl.where(is_diag, rk / tl.sqrt(2.0), rk)))
    return tl.where(e < E, coef * xa * xb, 0.0)


@triton.jit
def _decode_kernel(q, k, v, kv, k_sum, o, q_scale,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, E: tl.constexpr,
                   BE: tl.constexpr, BV: tl.constexpr, NORMALIZE: tl.constexpr):
    i_bh = tl.program_id(0)
    e = tl.arange(0, BE)
    m_e = e < E
    phi_q = _features(q + i_bh * K, q_scale, e, K, E)  # [BE]
    phi_k = _features(k + i_bh * K, 1.0, e, K, E)  # [BE]
    k_sum += i_bh.to(tl.int64) * E
    z = tl.load(k_sum + e, mask=m_e, other=0.0) + phi_k
    tl.store(k_sum + e, z, mask=m_e)
    den = tl.sum(phi_q * z, 0)
    kv += i_bh.to(tl.int64) * E * V
    for v0 in tl.static_range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        m_v = offs_v < V
        bv = tl.load(v + i_bh * V + offs_v, mask=m_v, other=0.0).to(tl.float32)
        ptrs = kv + e[:, None] * V + offs_v[None, :]
        m = m_e[:, None] & m_v[None, :]
        s = tl.load(ptrs, mask=m, other=0.0).to(tl.float32) + phi_k[:, None] * bv[None, :]  # [BE, BV]
        s = s.to(kv.dtype.element_ty)  # rounded to the storage dtype (a no-op for fp32)
        tl.store(ptrs, s, mask=m)
        num = tl.sum(phi_q[:, None] * s.to(tl.float32), 0)
        if NORMALIZE:
            num = num / den
        tl.store(o + i_bh * V + offs_v, num.to(o.dtype.element_ty), mask=m_v)
