"""Based linear attention's public ops, `chunk_based` and `fused_recurrent_based`, and `choose_path`, the dispatch
rule behind `chunk_based` (kernels/based/README.md). The path is chosen on the host from the inputs' metadata, once
per call signature (`_plan`). Under torch.compile, and under torch.func.vmap (a pack of runs, zoo/steps.py), the
custom ops `zoo_based::chunk_fwd` / `chunk_bwd` run it; the forward's vmap rule folds the members into the batch."""

import math
import os
from dataclasses import dataclass

import torch

from kernels.based import fused
from kernels.based.decode import _decode_kernel
from kernels.based.naive import check_state, feature_dim, orders_to_state, state_to_orders
from kernels.launch import check_devices, grad_needed, launch, next_power_of_2
from kernels.vmap import members_first

try:  # Gluon came with Triton 3.5; without it the Triton forms serve every call
    from kernels.based import gluon, gluon_backward
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = gluon_backward = None

PATHS = ("auto", "gluon", "fused")
MIN_SEQUENCES = 32
MAX_SHORT_T = 4096


@dataclass(frozen=True)
class BasedConfig:
    """How `chunk_based` picks its kernels: path "auto" (the dispatch rule) or one of "gluon", "fused"."""

    path: str = "auto"

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"BasedConfig.path must be one of {', '.join(PATHS)}, got {self.path!r}")

    @classmethod
    def from_env(cls) -> "BasedConfig":
        """The config named by ZOO_BASED_PATH (default "auto")."""
        return cls(path=os.environ.get("ZOO_BASED_PATH", "auto"))


DEFAULT_CONFIG = BasedConfig.from_env()
_SM90: dict = {}
_PLANS: dict = {}  # the checked metadata of a call -> (path, scale): `_plan`, once per key


@torch.compiler.assume_constant_result  # torch.compile asks it while tracing and keeps the answer as a constant
def _is_sm90(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (sm_90), asked of the driver once per device."""
    if device not in _SM90:
        _SM90[device] = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    return _SM90[device]


def gluon_takes(sm90: bool, dtype: torch.dtype, B: int, T: int, H: int, K: int, V: int, normalize: bool) -> bool:
    """Whether the Gluon kernels can take the call (and the auto rule sends it there)."""
    return (gluon is not None and sm90 and dtype == torch.bfloat16 and K == 16 and V == 64 and normalize
            and (B * H >= MIN_SEQUENCES or T <= MAX_SHORT_T))


def choose_path(*, sm90: bool, dtype: torch.dtype, B: int, T: int, H: int, K: int, V: int, normalize: bool,
                forced: str = "auto") -> str:
    """The dispatch rule (kernels/based/README.md has it as a table), one path for a call's forward and backward;
    `forced` overrides it, checked. Gluon takes one program per sequence: few long sequences would leave the GPU idle,
    where the fused form's segments do better."""
    if forced == "gluon" and not gluon_takes(sm90, dtype, B, 0, H, K, V, normalize):
        raise ValueError("the Gluon path needs an sm_90 GPU, bf16, K=16, V=64 and normalize=True")
    if forced != "auto":
        return forced
    return "gluon" if gluon_takes(sm90, dtype, B, T, H, K, V, normalize) else "fused"


def _forward(q, k, v, hv0, hz0, scale: float, path: str, normalize: bool, output_final_state: bool, save: bool):
    """(o, den, hvT, hzT, hs, zs) from the path's kernels; den, hs, zs (what the backward reads) only with save."""
    if path == "gluon":
        o, den, hvT, hzT, hs, zs = gluon.forward(q, k, v, scale, hv0, hz0, output_final_state, store_states=save)
    else:
        o, den, hvT, hzT = fused.forward(q, k, v, hv0, hz0, scale, output_final_state, normalize)
        hs = zs = None
    if not save:
        den = hs = zs = None
    return o, den, hvT, hzT, hs, zs


def _backward(q, k, v, o, den, hs, zs, hv0, hz0, do, dhvT, dhzT, scale: float, path: str, normalize: bool):
    """(dq, dk, dv, dhv0, dhz0) from the path's kernels (dhv0, dhz0 None without an initial state)."""
    if do is None:  # only the final state reaches the loss
        do = torch.zeros_like(o)
    if (dhvT is None) != (dhzT is None):  # one part of the final state reaches the loss: the other's gradient is 0
        B, _, H, K = q.shape
        F = 1 + K + K * K
        dhvT = q.new_zeros(B, H, F, v.shape[-1], dtype=torch.float32) if dhvT is None else dhvT
        dhzT = q.new_zeros(B, H, F, dtype=torch.float32) if dhzT is None else dhzT
    if path == "gluon":
        return gluon_backward.backward(q, k, v, o, do, den, hs, zs, scale, dhvT, dhzT, need_dh0=hv0 is not None)
    return fused.backward(q, k, v, o, den, hv0, hz0, do, dhvT, dhzT, scale, normalize)


class _ChunkBased(torch.autograd.Function):
    """The eager training call: (q, k, v, hv0, hz0) -> (o, hvT, hzT), Taylor-order states."""

    @staticmethod
    def forward(ctx, q, k, v, hv0, hz0, scale, path, normalize, output_final_state):
        ctx.set_materialize_grads(False)
        o, den, hvT, hzT, hs, zs = _forward(q, k, v, hv0, hz0, scale, path, normalize, output_final_state, True)
        ctx.save_for_backward(q, k, v, o, den, hs, zs, hv0, hz0)
        ctx.args = scale, path, normalize
        return o, hvT, hzT

    @staticmethod
    def backward(ctx, do, dhvT, dhzT):
        dq, dk, dv, dhv0, dhz0 = _backward(*ctx.saved_tensors, do, dhvT, dhzT, *ctx.args)
        return dq, dk, dv, dhv0, dhz0, None, None, None, None


# The same two steps as custom ops, for torch.compile. Tensors a path does not produce come back empty ([0] fp32).
def _none_to_empty(xs, like):
    return tuple(torch.empty(0, device=like.device) if x is None else x for x in xs)


def _empty_to_none(x):
    return None if x is None or x.numel() == 0 else x


@torch.library.custom_op("zoo_based::chunk_fwd", mutates_args=())
def _chunk_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hv0: torch.Tensor | None,
                  hz0: torch.Tensor | None, scale: float, path: str, normalize: bool, output_final_state: bool,
                  save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor]:
    return _none_to_empty(_forward(q, k, v, hv0, hz0, scale, path, normalize, output_final_state, save), q)


@_chunk_fwd_op.register_fake
def _chunk_fwd_fake(q, k, v, hv0, hz0, scale, path, normalize, output_final_state, save):
    B, T, H, K = q.shape
    V, F = v.shape[-1], 1 + K + K * K
    f32 = dict(device=q.device, dtype=torch.float32)

    def empty():  # a new tensor each: outputs must not alias each other
        return torch.empty(0, **f32)

    den = torch.empty(B, T, H, **f32) if save and normalize else empty()
    hvT = torch.empty(B, H, F, V, **f32) if output_final_state else empty()
    hzT = torch.empty(B, H, F, **f32) if output_final_state else empty()
    hs, zs = empty(), empty()
    if save and path == "gluon":  # every second chunk's entering state (`gluon.forward`)
        hs = torch.empty(B * H, -(-T // 128), V, 192, device=q.device, dtype=torch.bfloat16)
        zs = torch.empty(B * H, -(-T // 128), 192, **f32)
    return torch.empty_like(v), den, hvT, hzT, hs, zs


@torch.library.custom_op("zoo_based::chunk_bwd", mutates_args=())
def _chunk_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, den: torch.Tensor,
                  hs: torch.Tensor, zs: torch.Tensor, hv0: torch.Tensor | None, hz0: torch.Tensor | None,
                  do: torch.Tensor, dhvT: torch.Tensor | None, dhzT: torch.Tensor | None, scale: float, path: str,
                  normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _backward(q, k, v, o, _empty_to_none(den), _empty_to_none(hs), _empty_to_none(zs), hv0, hz0, do, dhvT,
                      dhzT, scale, path, normalize)
    return _none_to_empty(grads, q)


@_chunk_bwd_op.register_fake
def _chunk_bwd_fake(q, k, v, o, den, hs, zs, hv0, hz0, do, dhvT, dhzT, scale, path, normalize):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty(0, device=q.device) if hv0 is None else torch.empty_like(hv0),
            torch.empty(0, device=q.device) if hz0 is None else torch.empty_like(hz0))


def _chunk_setup(ctx, inputs, output):
    q, k, v, hv0, hz0, scale, path, normalize, _, _ = inputs
    o, den, _, _, hs, zs = output
    ctx.save_for_backward(q, k, v, o, den, hs, zs, hv0, hz0)
    ctx.args = scale, path, normalize, hv0 is not None


def _chunk_grad(ctx, do, dden, dhvT, dhzT, dhs, dzs):
    q, k, v, o, den, hs, zs, hv0, hz0 = ctx.saved_tensors
    scale, path, normalize, has_h0 = ctx.args
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, dhv0, dhz0 = torch.ops.zoo_based.chunk_bwd(q, k, v, o, den, hs, zs, hv0, hz0, do,
                                                           _empty_to_none(dhvT), _empty_to_none(dhzT), scale, path,
                                                           normalize)
    return dq, dk, dv, dhv0 if has_h0 else None, dhz0 if has_h0 else None, None, None, None, None, None


_chunk_fwd_op.register_autograd(_chunk_grad, setup_context=_chunk_setup)


@_chunk_fwd_op.register_vmap
def _chunk_fwd_vmap(info, in_dims, q, k, v, hv0, hz0, scale, path, normalize, output_final_state, save):
    """Members as more sequences, [N, B, ...] -> [N·B, ...] (each sequence's recurrence is its own): one launch for
    the whole pack, on the path planned for one member's shapes. Outputs come back [N, B, ...]; one a path does not
    produce stays empty and unbatched."""
    n = info.batch_size
    q, k, v, hv0, hz0 = (None if t is None else members_first(n, t, dim).flatten(0, 1).contiguous()
                         for t, dim in zip((q, k, v, hv0, hz0), in_dims))
    save = save or grad_needed(q, k, v, hv0, hz0)  # the caller saw batched tensors (see grad_needed)
    outs = torch.ops.zoo_based.chunk_fwd(q, k, v, hv0, hz0, scale, path, normalize, output_final_state, save)
    # o, den, hvT, hzT lead with the sequences; Gluon's hs, zs with sequence·head rows, member-major as well
    outs = tuple(x if x.numel() == 0 else x.unflatten(0, (n, -1)) for x in outs)
    return outs, tuple(None if x.numel() == 0 else 0 for x in outs)


def _plan(q, k, v, scale, initial_state, normalize: bool, config: BasedConfig):
    """Check a call's arguments and choose its path: (path, scale as a float). Reads metadata only, so `chunk_based`
    runs it once per (shapes, dtypes, devices, scale, flags)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, H, V]; got {q.shape}, {k.shape}, {v.shape}")
    if K > 32 or V > 128:
        raise ValueError(f"chunk_based supports K ≤ 32 and V ≤ 128, got K={K}, V={V}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"chunk_based supports fp32, fp16 and bf16 inputs, got {q.dtype}")
    if initial_state is not None:
        check_state(initial_state, B, H, feature_dim(K), V)
    scale = K**-0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    path = choose_path(sm90=_is_sm90(q.device), dtype=q.dtype, B=B, T=T, H=H, K=K, V=V, normalize=normalize,
                       forced=config.path)
    return path, scale


def chunk_based(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                initial_state: tuple[torch.Tensor, torch.Tensor] | None = None, output_final_state: bool = False,
                normalize: bool = True, *, config: BasedConfig | None = None):
    """Based linear attention, chunked: o_i = Σ_{j≤i} w_ij v_j / Σ_{j≤i} w_ij, w = 1 + s + s²/2, s = scale·q_i·k_j.

    q, k: [B, T, H, K], K ≤ 32; v: [B, T, H, V], V ≤ 128; fp32, fp16 or bf16 on CUDA (or the CPU under
    TRITON_INTERPRET=1). scale defaults to 1/√K. initial_state: (kv [B, H, E, V], k_sum [B, H, E]) fp32, E = 1 + K +
    K(K+1)/2, FLA TaylorFeatureMap order; gradients reach it. output_final_state: also return the state after the last
    token, same layout, fp32 and contiguous (it feeds `fused_recurrent_based`). normalize=False: the numerator alone.
    config: force a path (`BasedConfig`; default the dispatch rule, or ZOO_BASED_PATH). Returns o [B, T, H, V] in v's
    dtype and (kv, k_sum) or None.
    """
    check_devices("chunk_based", q, k, v, *(initial_state or ()))
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
        initial_state is not None and (initial_state[0].requires_grad or initial_state[1].requires_grad)))
    if scale is not None and not isinstance(scale, (int, float)):
        scale = float(scale)
    config = config or DEFAULT_CONFIG
    compiling = torch.compiler.is_compiling()
    # inside torch.func.vmap (a pack of runs): the custom op, whose vmap rule folds the members into the batch
    batched = torch._C._functorch.is_batchedtensor
    vmapped = batched(q) or batched(k) or batched(v)
    if compiling:  # planned while tracing (the graph keeps the result)
        path, scale = _plan(q, k, v, scale, initial_state, normalize, config)
    else:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, scale, normalize, config,
               None if initial_state is None else (initial_state[0].shape, initial_state[1].shape))
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = _plan(q, k, v, scale, initial_state, normalize, config)
        path, scale = plan
    hv0 = hz0 = None
    if initial_state is not None:
        hv0, hz0 = state_to_orders(initial_state[0].float(), initial_state[1].float())
        hv0, hz0 = hv0.contiguous(), hz0.contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if compiling or vmapped:
        o, _, hvT, hzT, _, _ = torch.ops.zoo_based.chunk_fwd(q, k, v, hv0, hz0, scale, path, normalize,
                                                             output_final_state, grad)
    elif grad:
        o, hvT, hzT = _ChunkBased.apply(q, k, v, hv0, hz0, scale, path, normalize, output_final_state)
    else:
        o, _, hvT, hzT, _, _ = _forward(q, k, v, hv0, hz0, scale, path, normalize, output_final_state, False)
    return o, (orders_to_state(hvT, hzT) if output_final_state else None)


def fused_recurrent_based(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                          state: tuple[torch.Tensor, torch.Tensor], scale: float | None = None,
                          normalize: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """`chunk_based` over one token (`decode.py`'s kernel): q_t, k_t [B, H, K], v_t [B, H, V] -> o_t [B, H, V] in
    v_t's dtype (into `out` if given), updating state = (kv [B, H, E, V], k_sum [B, H, E]) in place, both contiguous:
    k_sum fp32, kv fp32 (as `chunk_based(..., output_final_state=True)` returns it) or bf16, the storage that halves
    a step's state traffic (updated in fp32 and rounded to nearest once per step; o_t is read from the rounded kv)."""
    kv, k_sum = state
    B, H, K = q_t.shape
    V = v_t.shape[-1]
    E = feature_dim(K)
    if k_t.shape != q_t.shape or v_t.shape[:2] != (B, H):
        raise ValueError(f"q_t, k_t must be [B, H, K] and v_t [B, H, V]; got {q_t.shape}, {k_t.shape}, {v_t.shape}")
    check_state(state, B, H, E, V)
    if kv.dtype not in (torch.float32, torch.bfloat16) or k_sum.dtype != torch.float32 or not (
            kv.is_contiguous() and k_sum.is_contiguous()):
        raise ValueError(f"the state must be contiguous tensors, kv fp32 or bf16 and k_sum fp32 (it is updated in "
                         f"place), got kv {kv.dtype}, k_sum {k_sum.dtype}")
    check_devices("fused_recurrent_based", q_t, k_t, v_t, kv, k_sum, out)
    scale = K**-0.5 if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(v_t)
    launch(_decode_kernel, (B * H,), q_t.contiguous(), k_t.contiguous(), v_t.contiguous(), kv, k_sum, out,
           scale * math.sqrt(K), H=H, K=K, V=V, E=E, BE=next_power_of_2(E),
           BV=min(32, next_power_of_2(V)), NORMALIZE=normalize, num_warps=4)
    return out
