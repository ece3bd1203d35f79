"""Based forward as a Gluon kernel for Hopper (sm_90): explicit layouts, shared memory and warpgroup MMAs.

Session 16. `chunk_based` runs it for forwards that no gradient follows (inference, prefill, torch.no_grad) in
bf16 at K = 16, V = 64 (`applies`). One program of 8 warps (two warpgroups, side by side along N) owns one (batch,
head) and all 64 value columns and walks the sequence in chunks of C = 64 tokens with the state in registers, as
`chunk._fwd_kernel` does; what differs is that every layout and shared-memory buffer is chosen here rather than
by Triton's layout passes: the features go straight from the MMA accumulators into the shared memory the next MMAs
read, the state is a set of MMA accumulators, and nothing spills (255 registers, sm_90a). H200, B=8, H=16, T=4096:
0.250 ms against 0.382 for `_fwd_kernel` (`experiments/LOG.md`, session 16).

Features (192 = 3 blocks of 64). Each is a product of two factors, each factor a dot of the chunk's extended inputs
x_ext = [x, 1, 0…] [C, 32] with a 0/1 matrix, so no register shuffles:

    block 0: x_a (16), x_a² (16), 1 (1), zeros (31)
    block 1, 2: the pairs x_a·x_b, b = (a + d) mod 16, d = 1..8 (row j = (d-1)·16 + a; `chunk._pair_cols`)

The query side (q_s = scale·q, rounded to bf16 as in the Triton kernels) weighs the diagonal and d = 8 by ½, so
Σ_f ψ_f(q) φ_f(k) = 1 + s + s²/2. The state is S_blk[f, v] = Σ φ_f(k) v (fp32 accumulators, 3 × [64, 64]) and
z_blk[f] = Σ φ_f(k) (fp32 accumulators [64, 8·warpgroups] with equal columns); the reads take S in bf16 (as the
Triton kernels do for bf16) and z as a bf16 head plus tail (≈ 16 bits, for the denominator).

Per chunk: the next chunk's loads go out; s = q_s kᵀ; ψ(q), φ(k) into shared memory; then one batch of
asynchronous MMAs: num = w v + Σ ψ S, den = Σ ψ z (+ Σ w), S += φ(k)ᵀ v, z += φ(k)ᵀ 1; the state is written back to
shared memory for the next chunk's reads, and o = num / den is stored. The initial and final states travel in this
kernel's row order (`feature_rows`), converted from and to the Taylor-order form in PyTorch.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

C_ = gl.constexpr(64)  # tokens per chunk
K_ = gl.constexpr(16)  # feature dim
V_ = gl.constexpr(64)  # value dim
X_ = gl.constexpr(32)  # extended input width [x, 1, 0...]
NB = gl.constexpr(3)  # feature blocks of 64


@gluon.jit
def _factor_mats(ra_q, ra_k, rb, BLK: gl.constexpr, L: gl.constexpr):
    """The 0/1 matrices [X_, 64] of feature block BLK: factor a (with the query's ½ weights in ra_q) and factor b."""
    r = gl.arange(0, X_, layout=gl.SliceLayout(1, L))[:, None]
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))[None, :]
    if BLK == 0:
        # cols 0-15: x_a · 1; 16-31: x_a · x_a (½ on the query side); 32: 1 · 1; rest zero
        a = gl.where(c < 16, c, gl.where(c < 32, c - 16, gl.where(c == 32, 16, -1)))
        b = gl.where(c < 16, 16, gl.where(c < 32, c - 16, gl.where(c == 32, 16, -1)))
        half = (c >= 16) & (c < 32)
    else:
        j = c + 64 * (BLK - 1)
        d = 1 + j // 16
        a = j % 16
        b = (a + d) % 16
        half = d == 8
    one_a = gl.where(r == a, 1.0, 0.0)
    ra_k.store(one_a.to(gl.bfloat16))
    ra_q.store((gl.where(half, 0.5, 1.0) * one_a).to(gl.bfloat16))
    rb.store(gl.where(r == b, 1.0, 0.0).to(gl.bfloat16))


@gluon.jit
def _gluon_fwd_kernel(q, k, v, o, h0, z0, hT, zT, T, scale, H: gl.constexpr, W: gl.constexpr,
                      USE_H0: gl.constexpr, STORE_HT: gl.constexpr):
    """One program: sequence i_bh, all V columns. h0/hT: [B·H, 192, V] fp32 and z0/zT: [B·H, 192] fp32, the state in
    this kernel's feature order (`feature_rows`)."""
    gl.static_assert(gl.num_warps() == W)
    G: gl.constexpr = W // 4  # warpgroups, side by side along N
    ZW: gl.constexpr = 8 * G
    i_bh = gl.program_id(0)
    i_b = i_bh // H
    i_h = i_bh % H
    q += i_b.to(gl.int64) * T * H * K_ + i_h * K_
    k += i_b.to(gl.int64) * T * H * K_ + i_h * K_
    v += i_b.to(gl.int64) * T * H * V_ + i_h * V_
    o += i_b.to(gl.int64) * T * H * V_ + i_h * V_

    # register layouts: loads (16 B per thread along the row) and the MMA accumulators
    LX: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [W, 1], [1, 0])      # [64, 32] / [64, 16] tiles
    LV: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [W, 1], [1, 0])      # [64, 64] tiles
    A64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, G], instr_shape=[16, 64 // G, 16])
    A8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, G], instr_shape=[16, 8, 16])
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=A64, k_width=2)

    # shared memory
    sl16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C_, K_], gl.bfloat16)
    sl32: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C_, X_], gl.bfloat16)
    slr: gl.constexpr = gl.NVMMASharedLayout.get_default_for([X_, 64], gl.bfloat16)
    sl64: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    sl8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ZW, 64], gl.bfloat16)
    qs_s = gl.allocate_shared_memory(gl.bfloat16, [C_, K_], sl16)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [C_, K_], sl16)
    qx_s = gl.allocate_shared_memory(gl.bfloat16, [C_, X_], sl32)
    kx_s = gl.allocate_shared_memory(gl.bfloat16, [C_, X_], sl32)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [C_, V_], sl64)
    raq_s = gl.allocate_shared_memory(gl.bfloat16, [NB, X_, 64], slr)
    rak_s = gl.allocate_shared_memory(gl.bfloat16, [NB, X_, 64], slr)
    rb_s = gl.allocate_shared_memory(gl.bfloat16, [NB, X_, 64], slr)
    psi_s = gl.allocate_shared_memory(gl.bfloat16, [NB, C_, 64], sl64)
    phi_s = gl.allocate_shared_memory(gl.bfloat16, [NB, C_, 64], sl64)
    st_s = gl.allocate_shared_memory(gl.bfloat16, [NB, 64, V_], sl64)
    zt_s = gl.allocate_shared_memory(gl.bfloat16, [NB, ZW, 64], sl8)
    ones_s = gl.allocate_shared_memory(gl.bfloat16, [ZW, C_], sl8)

    LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])      # [32, 64]
    _factor_mats(raq_s.index(0), rak_s.index(0), rb_s.index(0), 0, LR)
    _factor_mats(raq_s.index(1), rak_s.index(1), rb_s.index(1), 1, LR)
    _factor_mats(raq_s.index(2), rak_s.index(2), rb_s.index(2), 2, LR)
    ones_s.store(gl.full([ZW, C_], 1.0, gl.bfloat16, LV))
    ra = gl.arange(0, C_, layout=gl.SliceLayout(1, A64))[:, None]
    ca = gl.arange(0, 64, layout=gl.SliceLayout(0, A64))[None, :]
    c8 = gl.arange(0, ZW, layout=gl.SliceLayout(0, A8))[None, :]
    r8 = gl.arange(0, 64, layout=gl.SliceLayout(1, A8))[:, None]
    if USE_H0:
        h0 += i_bh.to(gl.int64) * (NB * 64 * V_)
        z0 += i_bh.to(gl.int64) * (NB * 64)
        S0 = gl.load(h0 + ra * V_ + ca)
        S1 = gl.load(h0 + (64 + ra) * V_ + ca)
        S2 = gl.load(h0 + (128 + ra) * V_ + ca)
        Z0 = gl.load(z0 + r8 + c8 * 0)
        Z1 = gl.load(z0 + 64 + r8 + c8 * 0)
        Z2 = gl.load(z0 + 128 + r8 + c8 * 0)
    else:
        S0 = gl.zeros([64, V_], gl.float32, A64)
        S1 = gl.zeros([64, V_], gl.float32, A64)
        S2 = gl.zeros([64, V_], gl.float32, A64)
        Z0 = gl.zeros([64, ZW], gl.float32, A8)
        Z1 = gl.zeros([64, ZW], gl.float32, A8)
        Z2 = gl.zeros([64, ZW], gl.float32, A8)
    _publish(st_s, zt_s, S0, S1, S2, Z0, Z1, Z2, c8)

    rx = gl.arange(0, C_, layout=gl.SliceLayout(1, LX))[:, None]
    cx = gl.arange(0, X_, layout=gl.SliceLayout(0, LX))[None, :]
    L16: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [W, 1], [1, 0])
    r16 = gl.arange(0, C_, layout=gl.SliceLayout(1, L16))[:, None]
    c16 = gl.arange(0, K_, layout=gl.SliceLayout(0, L16))[None, :]
    rv = gl.arange(0, C_, layout=gl.SliceLayout(1, LV))[:, None]
    cv = gl.arange(0, V_, layout=gl.SliceLayout(0, LV))[None, :]

    nxt = _load_chunk(q, k, v, 0, T, H, rx, cx, rv, cv, r16, c16)
    for start in range(0, T, C_):
        xq, xk, bv, q16, k16 = nxt  # loaded during the previous chunk
        mx = (start + rx) < T
        qx_s.store((xq.to(gl.float32) * scale + gl.where(cx == K_, 1.0, 0.0)).to(gl.bfloat16))
        kx_s.store((xk.to(gl.float32) + gl.where((cx == K_) & mx, 1.0, 0.0)).to(gl.bfloat16))
        v_s.store(bv)
        qs_s.store((q16.to(gl.float32) * scale).to(gl.bfloat16))
        k_s.store(k16)
        nxt = _load_chunk(q, k, v, start + C_, T, H, rx, cx, rv, cv, r16, c16)
        fence_async_shared()

        for blk in gl.static_range(NB):
            z = gl.zeros([C_, 64], gl.float32, A64)
            fa = warpgroup_mma(qx_s, raq_s.index(blk), z, use_acc=False)
            fb = warpgroup_mma(qx_s, rb_s.index(blk), z, use_acc=False)
            psi_s.index(blk).store((fa * fb).to(gl.bfloat16))
            fa = warpgroup_mma(kx_s, rak_s.index(blk), z, use_acc=False)
            fb = warpgroup_mma(kx_s, rb_s.index(blk), z, use_acc=False)
            phi_s.index(blk).store((fa * fb).to(gl.bfloat16))
        s = warpgroup_mma(qs_s, k_s.permute((1, 0)), gl.zeros([C_, C_], gl.float32, A64), use_acc=False)
        w = gl.where(ra >= ca, 1.0 + s + 0.5 * s * s, 0.0)
        den = gl.sum(w, 1)
        fence_async_shared()

        num = warpgroup_mma(gl.convert_layout(w.to(gl.bfloat16), AOP), v_s, gl.zeros([C_, V_], gl.float32, A64),
                            use_acc=False, is_async=True)
        dd = warpgroup_mma(psi_s.index(0), zt_s.index(0).permute((1, 0)), gl.zeros([C_, ZW], gl.float32, A8),
                           use_acc=False, is_async=True)
        num = warpgroup_mma(psi_s.index(0), st_s.index(0), num, is_async=True)
        dd = warpgroup_mma(psi_s.index(1), zt_s.index(1).permute((1, 0)), dd, is_async=True)
        num = warpgroup_mma(psi_s.index(1), st_s.index(1), num, is_async=True)
        dd = warpgroup_mma(psi_s.index(2), zt_s.index(2).permute((1, 0)), dd, is_async=True)
        num = warpgroup_mma(psi_s.index(2), st_s.index(2), num, is_async=True)
        S0 = warpgroup_mma(phi_s.index(0).permute((1, 0)), v_s, S0, is_async=True)
        S1 = warpgroup_mma(phi_s.index(1).permute((1, 0)), v_s, S1, is_async=True)
        S2 = warpgroup_mma(phi_s.index(2).permute((1, 0)), v_s, S2, is_async=True)
        Z0 = warpgroup_mma(phi_s.index(0).permute((1, 0)), ones_s.permute((1, 0)), Z0, is_async=True)
        Z1 = warpgroup_mma(phi_s.index(1).permute((1, 0)), ones_s.permute((1, 0)), Z1, is_async=True)
        Z2 = warpgroup_mma(phi_s.index(2).permute((1, 0)), ones_s.permute((1, 0)), Z2, is_async=True)
        num, dd, S0, S1, S2, Z0, Z1, Z2 = warpgroup_mma_wait(0, deps=[num, dd, S0, S1, S2, Z0, Z1, Z2])

        _publish(st_s, zt_s, S0, S1, S2, Z0, Z1, Z2, c8)  # what the next chunk reads
        den = den + gl.convert_layout(gl.sum(gl.where(c8 < 2, dd, 0.0), 1), gl.SliceLayout(1, A64))
        out = num / den[:, None]
        tv = start + rv
        gl.store(o + tv * (H * V_) + cv, gl.convert_layout(out.to(gl.bfloat16), LV), mask=tv < T)

    if STORE_HT:
        hT += i_bh.to(gl.int64) * (NB * 64 * V_)
        zT += i_bh.to(gl.int64) * (NB * 64)
        gl.store(hT + ra * V_ + ca, S0)
        gl.store(hT + (64 + ra) * V_ + ca, S1)
        gl.store(hT + (128 + ra) * V_ + ca, S2)
        gl.store(zT + r8 + c8 * 0, Z0, mask=c8 == 0)
        gl.store(zT + 64 + r8 + c8 * 0, Z1, mask=c8 == 0)
        gl.store(zT + 128 + r8 + c8 * 0, Z2, mask=c8 == 0)


@gluon.jit
def _publish(st_s, zt_s, S0, S1, S2, Z0, Z1, Z2, c8):
    """The state as the reads take it: S in bf16, z as a bf16 head and tail."""
    st_s.index(0).store(S0.to(gl.bfloat16))
    st_s.index(1).store(S1.to(gl.bfloat16))
    st_s.index(2).store(S2.to(gl.bfloat16))
    zt_s.index(0).store(gl.permute(_head_tail(Z0, c8), (1, 0)))
    zt_s.index(1).store(gl.permute(_head_tail(Z1, c8), (1, 0)))
    zt_s.index(2).store(gl.permute(_head_tail(Z2, c8), (1, 0)))


@gluon.jit
def _load_chunk(q, k, v, start, T, H: gl.constexpr, rx, cx, rv, cv, r16, c16):
    """The chunk at `start` (zeros past T): q, k as [C, X] tiles (the first K columns), v [C, V], and q, k again as
    plain [C, K] tiles for s = q_s kᵀ (the second read is an L1 hit)."""
    tx = start + rx
    mx = tx < T
    xq = gl.load(q + tx * (H * K_) + cx, mask=mx & (cx < K_), other=0.0)
    xk = gl.load(k + tx * (H * K_) + cx, mask=mx & (cx < K_), other=0.0)
    tv = start + rv
    bv = gl.load(v + tv * (H * V_) + cv, mask=tv < T, other=0.0)
    t16 = start + r16
    q16 = gl.load(q + t16 * (H * K_) + c16, mask=t16 < T, other=0.0)
    k16 = gl.load(k + t16 * (H * K_) + c16, mask=t16 < T, other=0.0)
    return xq, xk, bv, q16, k16


@gluon.jit
def _head_tail(Z, c8):
    """[64, 8] with equal columns z -> bf16 [z_hi, z_lo, 0, …] (z_hi + z_lo ≈ z to 16 bits)."""
    hi = Z.to(gl.bfloat16)
    lo = (Z - hi.to(gl.float32)).to(gl.bfloat16)
    return gl.where(c8 == 0, hi, gl.where(c8 == 1, lo, gl.zeros_like(hi)))


def feature_rows(K: int = 16) -> list[int]:
    """For each of the kernel's 192 state rows, the row of the Taylor-order form (`naive.state_to_orders`: 1 + K + K²
    rows [1, k, k⊗k]) it holds, or -1 for the zero rows of block 0."""
    rows = [1 + c if c < 16 else 1 + K + (c - 16) * (K + 1) if c < 32 else 0 if c == 32 else -1 for c in range(64)]
    for j in range(128):
        a, d = j % 16, 1 + j // 16
        rows.append(1 + K + a * K + (a + d) % 16)
    return rows


def order_rows(K: int = 16) -> list[int]:
    """For each row of the Taylor-order form, the kernel's state row holding it (order 2 is symmetric: (a, b) and
    (b, a) read the same pair row)."""
    out = [32] + list(range(16))
    for a in range(K):
        for b in range(K):
            if a == b:
                out.append(16 + a)
            elif 1 <= (b - a) % 16 <= 8:
                out.append(64 + ((b - a) % 16 - 1) * 16 + a)
            else:
                out.append(64 + ((a - b) % 16 - 1) * 16 + b)
    return out


def _index(K: int, device, inverse: bool) -> torch.Tensor:
    return torch.tensor(order_rows(K) if inverse else feature_rows(K), device=device)


def to_kernel_rows(hv: torch.Tensor, hz: torch.Tensor):
    """Taylor-order state (hv [B, H, 1+K+K², V], hz [B, H, 1+K+K²]) -> this kernel's rows [B·H, 192, V], [B·H, 192]."""
    B, H, F, V = hv.shape
    idx = _index(16, hv.device, False)
    hv = torch.cat([hv, hv.new_zeros(B, H, 1, V)], 2)[:, :, idx]  # row -1: the zero row appended
    hz = torch.cat([hz, hz.new_zeros(B, H, 1)], 2)[:, :, idx]
    return hv.reshape(B * H, 3 * 64, V).contiguous(), hz.reshape(B * H, 3 * 64).contiguous()


def from_kernel_rows(h: torch.Tensor, z: torch.Tensor, B: int, H: int):
    """Inverse of `to_kernel_rows` (symmetric order 2): -> (hv [B, H, 1+K+K², V], hz [B, H, 1+K+K²])."""
    idx = _index(16, h.device, True)
    return h[:, idx].reshape(B, H, len(idx), h.shape[-1]), z[:, idx].reshape(B, H, len(idx))


# Where `applies` sends a forward: one program per sequence, so the kernel wants many sequences or short ones. H200,
# session 16, bf16, ms against `chunk._fwd_kernel` (which walks few sequences in parallel segments):
# B·H = 16: T=1024 0.068 / 0.189, T=4096 0.256 / 0.177; B·H = 32: T=4096 0.254 / 0.245; B·H = 64: T=4096 0.250 /
# 0.341; B·H = 128: T=1024 0.069 / 0.101, T=4096 0.248 / 0.383; B·H = 256: T=4096 0.488 / 0.750.
MIN_SEQUENCES = 64
MAX_SHORT_T = 2048  # below MIN_SEQUENCES sequences, up to this length


def applies(q: torch.Tensor, v: torch.Tensor, normalize: bool) -> bool:
    """This kernel's case: bf16 on a Hopper GPU (sm_90), K = 16, V = 64, normalised, at least MIN_SEQUENCES
    sequences or at most MAX_SHORT_T tokens, and not inside torch.compile's tracing. The caller checks that no
    gradient follows (the kernel keeps no states for a backward)."""
    B, T, H, K = q.shape
    return (q.is_cuda and q.dtype == torch.bfloat16 and K == 16 and v.shape[-1] == 64 and normalize
            and (B * H >= MIN_SEQUENCES or T <= MAX_SHORT_T) and not torch.compiler.is_compiling()
            and torch.cuda.get_device_capability(q.device) == (9, 0))


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  hv0: torch.Tensor | None = None, hz0: torch.Tensor | None = None, output_final_state: bool = False):
    """Normalised Based attention, bf16, K = 16, V = 64, no gradient. hv0/hz0: the initial state in Taylor-order form
    (`naive.state_to_orders`) or None. Returns o [B, T, H, V] and the final state in Taylor-order form (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K != 16 or V != 64 or q.dtype != torch.bfloat16:
        raise ValueError(f"gluon_forward takes bf16 inputs with K=16 and V=64, got K={K}, V={V}, {q.dtype}")
    scale = K ** -0.5 if scale is None else scale
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(v)
    h0 = z0 = hT = zT = o  # placeholders where unused
    if hv0 is not None:
        h0, z0 = to_kernel_rows(hv0.float(), hz0.float())
    if output_final_state:
        hT = torch.empty(B * H, 3 * 64, V, device=q.device, dtype=torch.float32)
        zT = torch.empty(B * H, 3 * 64, device=q.device, dtype=torch.float32)
    _gluon_fwd_kernel[(B * H,)](q, k, v, o, h0, z0, hT, zT, T, scale, H, W=8, USE_H0=hv0 is not None,
                                STORE_HT=output_final_state, num_warps=8)
    if not output_final_state:
        return o, None, None
    hvT, hzT = from_kernel_rows(hT, zT, B, H)
    return o, hvT, hzT
