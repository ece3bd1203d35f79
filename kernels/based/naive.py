"""PyTorch references for Based linear attention: the specification the Triton kernels are tested against.

The feature map is the second-order Taylor expansion of exp(s), written so that
φ(q)·φ(k) = 1 + s + s²/2 with s = q·k/√f. Its feature order is the one of
`fla.modules.feature_map.TaylorFeatureMap(f)`, so that a state (kv, k_sum) can move between this library and
flash-linear-attention's linear-attention ops:

    φ(x) = [1, x/f^¼, x_i²/(√2·√f) for i, x_i·x_j/√f for i<j (row-major)]     E = 1 + f + f(f+1)/2
"""

import functools
import math

import torch


def feature_dim(f: int) -> int:
    """E, the number of Taylor features for key/query dim f: 1 + f + f(f+1)/2 (153 at f=16, 45 at f=8)."""
    return 1 + f + f * (f + 1) // 2


def taylor_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) for x: [..., f] -> [..., E], computed in x's dtype (callers cast to fp32 for states)."""
    f = x.shape[-1]
    i, j = torch.triu_indices(f, f, offset=1, device=x.device)
    diag = x * x / (math.sqrt(2.0) * math.sqrt(f))  # [..., f]
    # index_select, not x[..., i]: its backward is an index_add, where advanced indexing's is a sorting
    # index_put, slow on the GPU (experiments/LOG.md has the profile)
    off = x.index_select(-1, i) * x.index_select(-1, j) / math.sqrt(f)  # [..., f(f-1)/2]
    return torch.cat([torch.ones_like(x[..., :1]), x / f**0.25, diag, off], dim=-1)


def _query_features(q: torch.Tensor, scale: float) -> torch.Tensor:
    """φ(q') with q' = q·scale·√f, so that φ(q')·φ(k) = 1 + s + s²/2, s = scale·q·k, for any scale (the keys, and the
    state, use φ(k) unscaled)."""
    f = q.shape[-1]
    return taylor_feature_map(q * (scale * math.sqrt(f)))


def check_state(state, B: int, H: int, E: int, V: int):
    """state as (kv, k_sum), checked to be (kv [B, H, E, V], k_sum [B, H, E])."""
    kv0, ksum0 = state
    if tuple(kv0.shape) != (B, H, E, V) or tuple(ksum0.shape) != (B, H, E):
        raise ValueError(f"the state must be (kv [B,H,E,V], k_sum [B,H,E]) = ({(B, H, E, V)}, {(B, H, E)}), "
                         f"got ({tuple(kv0.shape)}, {tuple(ksum0.shape)})")
    return kv0, ksum0


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """States are kept in fp32 at least (fp64 when the inputs are fp64: the reference)."""
    return torch.promote_types(dtype, torch.float32)


def naive_parallel_based(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True):
    """The quadratic form, O(T²): y_i = Σ_{j≤i} w_ij v_j / Σ_{j≤i} w_ij, w_ij = 1 + s_ij + s_ij²/2.

    q, k: [B, T, H, f]; v: [B, T, H, V]; scale defaults to 1/√f; initial_state = (kv [B,H,E,V], k_sum [B,H,E]) adds
    φ(q')·kv and φ(q')·k_sum. Runs in the inputs' dtype (fp64: the reference; bf16/fp16: the tolerance rule's
    baseline). Returns (o [B, T, H, V] in the inputs' dtype, (kv, k_sum) in fp32 or fp64, or None)."""
    B, T, H, f = q.shape
    V = v.shape[-1]
    scale = f**-0.5 if scale is None else scale
    s = torch.einsum("bihf,bjhf->bhij", q, k) * scale  # [B, H, T, T]
    w = 1 + s + s * s / 2
    w = w.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), 0)
    num = torch.einsum("bhij,bjhv->bihv", w, v)  # [B, T, H, V]
    den = w.sum(-1).transpose(1, 2)  # [B, T, H]
    if initial_state is not None:
        kv0, ksum0 = check_state(initial_state, B, H, feature_dim(f), V)
        phi_q = _query_features(q, scale)  # [B, T, H, E]
        num = num + torch.einsum("bthe,bhev->bthv", phi_q, kv0.to(q.dtype))
        den = den + torch.einsum("bthe,bhe->bth", phi_q, ksum0.to(q.dtype))
    o = num / den[..., None] if normalize else num
    final_state = None
    if output_final_state:
        phi_k = taylor_feature_map(k)  # [B, T, H, E]
        sd = _state_dtype(q.dtype)
        kv = torch.einsum("bthe,bthv->bhev", phi_k, v).to(sd)
        k_sum = phi_k.sum(1).to(sd)  # [B, H, E]
        if initial_state is not None:
            kv, k_sum = kv + kv0.to(sd), k_sum + ksum0.to(sd)
        final_state = (kv, k_sum)
    return o, final_state


def naive_recurrent_based(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True):
    """The recurrent form, a loop over T (what decoding does): kv += φ(k_t) v_tᵀ, k_sum += φ(k_t),
    y_t = φ(q'_t)·kv / φ(q'_t)·k_sum. Same arguments and returns as `naive_parallel_based`; the state is
    accumulated in fp32 (fp64 for fp64 inputs)."""
    B, T, H, f = q.shape
    V = v.shape[-1]
    E = feature_dim(f)
    scale = f**-0.5 if scale is None else scale
    sd = _state_dtype(q.dtype)
    if initial_state is None:
        kv, k_sum = q.new_zeros(B, H, E, V, dtype=sd), q.new_zeros(B, H, E, dtype=sd)
    else:
        kv0, ksum0 = check_state(initial_state, B, H, E, V)
        kv, k_sum = kv0.to(sd), ksum0.to(sd)
    phi_q = _query_features(q, scale).to(sd)  # [B, T, H, E]
    phi_k = taylor_feature_map(k).to(sd)  # [B, T, H, E]
    outs = []
    for t in range(T):
        kv = kv + phi_k[:, t, :, :, None] * v[:, t, :, None, :].to(sd)  # [B, H, E, V]
        k_sum = k_sum + phi_k[:, t]  # [B, H, E]
        num = torch.einsum("bhe,bhev->bhv", phi_q[:, t], kv)
        den = torch.einsum("bhe,bhe->bh", phi_q[:, t], k_sum)
        outs.append(num / den[..., None] if normalize else num)
    o = torch.stack(outs, dim=1).to(v.dtype) if T > 0 else v.new_zeros(B, 0, H, V)  # [B, T, H, V]
    return o, ((kv, k_sum) if output_final_state else None)


def naive_chunk_based(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                      chunk_size=64):
    """The chunked form the kernels implement, with the three Taylor orders kept apart (s = scale·q·k, q_s = scale·q):
    within a chunk the quadratic form; across chunks the states S0 = Σ v, n = Σ 1 (order 0), S1 = Σ k vᵀ, z1 = Σ k
    (order 1), S2 = Σ (k⊗k) vᵀ, Z2 = Σ k kᵀ (order 2), read as S0 + q_s·S1 + ½(q_s⊗q_s)·S2 and likewise for the
    denominator. Same arguments and returns as `naive_parallel_based`."""
    B, T, H, f = q.shape
    V = v.shape[-1]
    E = feature_dim(f)
    scale = f**-0.5 if scale is None else scale
    sd = _state_dtype(q.dtype)
    if initial_state is None:
        initial_state = (q.new_zeros(B, H, E, V, dtype=sd), q.new_zeros(B, H, E, dtype=sd))
    kv0, ksum0 = check_state(initial_state, B, H, E, V)
    hv, hz = state_to_orders(kv0.to(sd), ksum0.to(sd))  # [B, H, 1+f+f², V], [B, H, 1+f+f²]
    outs = []
    for start in range(0, T, chunk_size):
        qc, kc, vc = (x[:, start:start + chunk_size].to(sd) for x in (q, k, v))  # [B, C, H, *]
        C = qc.shape[1]
        qs = qc * scale
        s = torch.einsum("bihf,bjhf->bhij", qs, kc)  # [B, H, C, C]
        w = (1 + s + s * s / 2).masked_fill(~torch.ones(C, C, dtype=torch.bool, device=q.device).tril(), 0)
        qq = (qs[..., :, None] * qs[..., None, :]).flatten(-2)  # [B, C, H, f²]
        phi = torch.cat([torch.ones_like(qs[..., :1]), qs, qq / 2], dim=-1)  # [B, C, H, 1+f+f²]
        num = torch.einsum("bhij,bjhv->bihv", w, vc) + torch.einsum("bihe,bhev->bihv", phi, hv)
        den = w.sum(-1).transpose(1, 2) + torch.einsum("bihe,bhe->bih", phi, hz)  # [B, C, H]
        outs.append(num / den[..., None] if normalize else num)
        kk = (kc[..., :, None] * kc[..., None, :]).flatten(-2)  # [B, C, H, f²]
        psi = torch.cat([torch.ones_like(kc[..., :1]), kc, kk], dim=-1)  # [B, C, H, 1+f+f²]
        hv = hv + torch.einsum("bjhe,bjhv->bhev", psi, vc)
        hz = hz + psi.sum(1)
    o = torch.cat(outs, dim=1).to(v.dtype) if T > 0 else v.new_zeros(B, 0, H, V)  # [B, T, H, V]
    return o, (orders_to_state(hv, hz) if output_final_state else None)


@functools.cache
def _order_maps(f: int, device: torch.device, dtype: torch.dtype):
    """Linear maps between the E-feature state and the Taylor-order state (rows 1 + f + f², f² row-major), made once per
    (f, device, dtype) so that conversions run under CUDA-graph capture. to_orders [1+f+f², E]: order 0 = kv[0],
    order 1 = f^¼·kv[1:1+f], (a,a) = √2·√f·kv[diag a], (a,b) and (b,a) = √f·kv[off a<b]; to_state reads them back."""
    E, F = feature_dim(f), 1 + f + f * f
    to_orders = torch.zeros(F, E, device=device, dtype=dtype)
    to_state = torch.zeros(E, F, device=device, dtype=dtype)
    to_orders[0, 0] = to_state[0, 0] = 1.0
    for a in range(f):
        to_orders[1 + a, 1 + a] = f**0.25
        to_state[1 + a, 1 + a] = f**-0.25
    diag = 1 + f + torch.arange(f)
    to_orders[1 + f + torch.arange(f) * (f + 1), diag] = math.sqrt(2.0) * math.sqrt(f)
    to_state[diag, 1 + f + torch.arange(f) * (f + 1)] = 1 / (math.sqrt(2.0) * math.sqrt(f))
    i, j = torch.triu_indices(f, f, offset=1)
    off = 1 + f + f + torch.arange(i.numel())
    to_orders[1 + f + i * f + j, off] = math.sqrt(f)
    to_orders[1 + f + j * f + i, off] = math.sqrt(f)
    to_state[off, 1 + f + i * f + j] = 1 / math.sqrt(f)
    return to_orders, to_state


def state_to_orders(kv: torch.Tensor, k_sum: torch.Tensor):
    """(kv [B,H,E,V], k_sum [B,H,E]) -> (hv [B,H,1+f+f²,V], hz [B,H,1+f+f²]): Σ[1, k, k⊗k] v_jᵀ and Σ[1, k, k⊗k].

    Differentiable (a fixed linear map), so gradients reach the E-feature state."""
    E = kv.shape[-2]
    f = int(round((math.sqrt(8 * E + 1) - 3) / 2))
    if feature_dim(f) != E:
        raise ValueError(f"E={E} is not 1 + f + f(f+1)/2 for any f")
    to_orders, _ = _order_maps(f, kv.device, kv.dtype)
    return torch.einsum("fe,bhev->bhfv", to_orders, kv), torch.einsum("fe,bhe->bhf", to_orders, k_sum)


def orders_to_state(hv: torch.Tensor, hz: torch.Tensor):
    """Inverse of `state_to_orders` on symmetric order-2 states: (hv, hz) -> (kv [B,H,E,V], k_sum [B,H,E])."""
    F = hv.shape[-2]
    f = int(round(math.sqrt(F - 0.75) - 0.5))
    if 1 + f + f * f != F:
        raise ValueError(f"{F} rows is not 1 + f + f² for any f")
    _, to_state = _order_maps(f, hv.device, hv.dtype)
    kv = torch.einsum("ef,bhfv->bhev", to_state, hv).contiguous()  # contiguous: what decoding updates in place
    return kv, torch.einsum("ef,bhf->bhe", to_state, hz).contiguous()
