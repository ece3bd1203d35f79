"""Based linear attention (Arora et al., 2024, "Simple linear attention language models balance the
recall-throughput tradeoff").

Per head: q, k ∈ R^f, v ∈ R^{d_v}, and the softmax kernel is replaced by its 2nd-order Taylor expansion

    y_i = Σ_{j≤i} κ(q_i, k_j) v_j / (Σ_{j≤i} κ(q_i, k_j) + eps),   κ = φ(q)·φ(k) = 1 + s + s²/2,  s = q·k/√f

with φ = `kernels.based.taylor_feature_map` (E = 1 + f + f(f+1)/2 features, FLA's order). κ ≥ ½, so the
denominator never vanishes. No positional encoding inside.

What is unusual here:
- The state {"kv": [B, H, E, d_v], "k_sum": [B, H, E]} is kept in fp32 (fp64 when asked for fp64) whatever
  the activations' dtype, because both sums grow with T; the accumulation runs with autocast disabled.
  `state_dtype="bf16"` stores kv in bf16 instead, an inference option: it halves the bytes a decode step reads
  and writes, and costs accuracy, since kv is rounded to bf16 (8 significant bits) after every update, so an
  update much smaller than the running sum is lost in part. Updates are still computed in fp32 and k_sum stays
  fp32: its first feature counts the tokens, which in bf16 would stop growing at 256. A prefill into the state
  computes in fp32 and rounds once when it writes kv back. experiments/bench/generation.py measures the cost
  (`--based-state-dtype bf16`: greedy tokens and logits against the fp32 state).
- `impl` picks the compute path and never falls back:
  - `naive` (default): PyTorch. Chunks of `chunk_size` use the quadratic form κ directly (C×C per chunk);
    the past enters through φ(q)·kv and φ(q)·k_sum, and the state advances by φ(k)ᵀv per chunk.
  - `fla`: flash-linear-attention. Without a state, `fla.ops.based.parallel_based`; with a state (prefill,
    decode), FLA's `TaylorFeatureMap` and `fused_recurrent_linear_attn(normalize=True)`, the only FLA op
    with state in and out that also runs under the Triton interpreter. FLA fixes its own eps (1e-6
    parallel, 1e-10 stateful); with denominators ≥ ½ per token the difference is below 2e-6 relative.
  - `triton`: this library's kernels, `kernels.based.chunk_based` (prefill) and
    `kernels.based.fused_recurrent_based` (decode), imported when the mixer is built. Packs of runs (zoo/steps.py)
    take it too: its custom op's vmap rule runs the whole pack as one launch over N·B sequences.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from kernels.based.naive import feature_dim, taylor_feature_map
from zoo.models.mixers._common import (
    check_choice,
    check_input,
    check_int,
    check_step_input,
    compute_dtype,
    log_impl,
    make_config,
    module_device_dtype,
    require_triton_device,
)

IMPLS = ("naive", "fla", "triton")
STATE_DTYPES = ("fp32", "bf16")


@dataclass
class BasedConfig:
    """Options of `based` (d_model comes from the model)."""

    feature_dim: int = 16  # f: width of q and k per head (E = 1 + f + f(f+1)/2 Taylor features)
    num_heads: int = 1
    head_dim_v: int | None = None  # d_v; None: d_model // num_heads
    impl: str = "naive"  # naive | fla | triton
    eps: float = 1e-6  # added to the denominator
    chunk_size: int = 64  # chunk length of the naive path
    state_dtype: str = "fp32"  # fp32 | bf16: the decode state's kv storage (k_sum stays fp32); see the module doc

    def validate(self, d_model: int) -> None:
        check_int("based: feature_dim", self.feature_dim, minimum=1)
        check_int("based: num_heads", self.num_heads, minimum=1)
        if self.head_dim_v is None:
            if d_model % self.num_heads:
                raise ValueError(f"based: d_model={d_model} must be divisible by num_heads={self.num_heads}")
        else:
            check_int("based: head_dim_v", self.head_dim_v, minimum=1)
        check_choice("based: impl", self.impl, IMPLS)
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps >= 0:
            raise ValueError(f"based: eps must be a float >= 0, got {self.eps!r}")
        check_int("based: chunk_size", self.chunk_size, minimum=1)
        check_choice("based: state_dtype", self.state_dtype, STATE_DTYPES)
        if self.impl == "fla" and self.feature_dim > 128:
            raise ValueError(f"based: impl='fla' supports feature_dim <= 128, got {self.feature_dim}")

    def value_dim(self, d_model: int) -> int:
        return self.head_dim_v if self.head_dim_v is not None else d_model // self.num_heads


def _triton_ops():
    """(chunk_based, fused_recurrent_based) from `kernels.based`; a clear ImportError names what is missing."""
    module = importlib.import_module("kernels.based")
    missing = [name for name in ("chunk_based", "fused_recurrent_based") if not hasattr(module, name)]
    if missing:
        raise ImportError(f"based impl='triton' needs kernels.based.{' and kernels.based.'.join(missing)}")
    return module.chunk_based, module.fused_recurrent_based


def _fla_ops():
    """(parallel_based, fused_recurrent_linear_attn, TaylorFeatureMap) from flash-linear-attention."""
    try:
        from fla.modules.feature_map import TaylorFeatureMap
        from fla.ops.based import parallel_based
        from fla.ops.linear_attn import fused_recurrent_linear_attn
    except ImportError as err:
        raise ImportError(f"based impl='fla' needs flash-linear-attention (import failed: {err})") from err
    return parallel_based, fused_recurrent_linear_attn, TaylorFeatureMap


class Based(nn.Module):
    """Based linear attention: [B, T, d_model] -> [B, T, d_model].

    State: {"kv": [B, H, E, d_v], "k_sum": [B, H, E]}, fp32 (fp64 for fp64 models); kv bf16 with state_dtype="bf16".
    """

    Config = BasedConfig
    name = "based"
    vmap_impls = ("naive", "triton")  # zoo/steps.py packs these

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        self.num_heads = self.config.num_heads
        self.feature_dim = self.config.feature_dim
        self.expanded_dim = feature_dim(self.feature_dim)
        self.head_dim_v = self.config.value_dim(d_model)
        self.impl = self.config.impl
        H, f, dv = self.num_heads, self.feature_dim, self.head_dim_v
        self.q_proj = nn.Linear(d_model, H * f, bias=False)
        self.k_proj = nn.Linear(d_model, H * f, bias=False)
        self.v_proj = nn.Linear(d_model, H * dv, bias=False)
        self.out = nn.Linear(H * dv, d_model, bias=False)
        # Fail at build time, not at the first forward, when the asked-for path cannot be imported.
        if self.impl == "fla":
            _fla_ops()
        elif self.impl == "triton":
            _triton_ops()
        log_impl(self.name, self.impl)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, d_model] -> q, k: [B, T, H, f], v: [B, T, H, d_v]."""
        q = rearrange(self.q_proj(x), "b t (h f) -> b t h f", h=self.num_heads)  # [B, T, H, f]
        k = rearrange(self.k_proj(x), "b t (h f) -> b t h f", h=self.num_heads)  # [B, T, H, f]
        v = rearrange(self.v_proj(x), "b t (h d) -> b t h d", h=self.num_heads)  # [B, T, H, d_v]
        return q, k, v

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: continues from it and updates it in place."""
        check_input(x, self.d_model, self.name)
        q, k, v = self._qkv(x)
        if self.impl == "naive":
            y = self._naive(q, k, v, state)
        elif self.impl == "fla":
            y = self._fla(q, k, v, state)
        else:
            y = self._triton(q, k, v, state)
        return self.out(rearrange(y.to(x.dtype), "b t h d -> b t (h d)"))  # [B, T, d_model]

    def _naive(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: dict[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """Chunked quadratic form. q, k: [B, T, H, f], v: [B, T, H, d_v] -> y: [B, T, H, d_v] (compute dtype)."""
        dtype = compute_dtype(q.dtype) if state is None else torch.promote_types(q.dtype, state["k_sum"].dtype)
        T, C, scale, eps = q.shape[1], self.config.chunk_size, self.feature_dim**-0.5, self.config.eps
        kv = k_sum = None
        with torch.autocast(device_type=q.device.type, enabled=False):
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            if state is not None:
                kv, k_sum = state["kv"].to(dtype), state["k_sum"].to(dtype)  # [B, H, E, d_v], [B, H, E]
            outs = []
            for start in range(0, T, C):
                qc, kc, vc = q[:, start : start + C], k[:, start : start + C], v[:, start : start + C]
                s = torch.einsum("bihf,bjhf->bhij", qc, kc) * scale  # [B, H, C, C]
                causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()  # [C, C]
                a = torch.where(causal, 1 + s + 0.5 * s * s, torch.zeros_like(s))  # [B, H, C, C]
                num = torch.einsum("bhij,bjhd->bihd", a, vc)  # [B, C, H, d_v]
                den = rearrange(a.sum(-1), "b h i -> b i h")  # [B, C, H]
                if kv is not None:
                    phi_q = taylor_feature_map(qc)  # [B, C, H, E]
                    num = num + torch.einsum("bihe,bhed->bihd", phi_q, kv)
                    den = den + torch.einsum("bihe,bhe->bih", phi_q, k_sum)
                outs.append(num / (den[..., None] + eps))
                if state is not None or start + C < T:
                    phi_k = taylor_feature_map(kc)  # [B, C, H, E]
                    kv_c = torch.einsum("bjhe,bjhd->bhed", phi_k, vc)  # [B, H, E, d_v]
                    kv = kv_c if kv is None else kv + kv_c
                    k_sum = phi_k.sum(1) if k_sum is None else k_sum + phi_k.sum(1)  # [B, H, E]
        if state is not None:
            state["kv"].copy_(kv)
            state["k_sum"].copy_(k_sum)
        return torch.cat(outs, dim=1)  # [B, T, H, d_v]

    def _fla(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: dict[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """FLA kernels, keyword arguments only. q, k: [B, T, H, f], v: [B, T, H, d_v] -> [B, T, H, d_v]."""
        require_triton_device(q, self.name, self.impl)
        parallel_based, fused_recurrent_linear_attn, TaylorFeatureMap = _fla_ops()
        if state is None:
            # FLA's scale multiplies q·k before 1 + s + s²/2: 1/√f makes s the same as in φ.
            return parallel_based(q=q, k=k, v=v, scale=self.feature_dim**-0.5, use_norm=True)
        feature_map = TaylorFeatureMap(self.feature_dim)
        dtype = state["k_sum"].dtype  # fp32 (fp64) whatever kv's storage
        with torch.autocast(device_type=q.device.type, enabled=False):
            phi_q = feature_map(q.to(dtype))  # [B, T, H, E]
            phi_k = feature_map(k.to(dtype))  # [B, T, H, E]
            y, (kv, z) = fused_recurrent_linear_attn(
                q=phi_q,
                k=phi_k,
                v=v.to(dtype),
                scale=1.0,
                initial_state=(state["kv"].to(dtype), rearrange(state["k_sum"], "b h e -> b 1 h e")),
                output_final_state=True,
                normalize=True,
            )
        state["kv"].copy_(kv)
        state["k_sum"].copy_(rearrange(z, "b 1 h e -> b h e"))
        return y

    def _triton(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: dict[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """kernels.based.chunk_based. q, k: [B, T, H, f], v: [B, T, H, d_v] -> [B, T, H, d_v]."""
        require_triton_device(q, self.name, self.impl)
        chunk_based, _ = _triton_ops()
        if state is None:
            y, _ = chunk_based(q=q, k=k, v=v, scale=None, initial_state=None, output_final_state=False, normalize=True)
            return y
        y, (kv, k_sum) = chunk_based(
            q=q,
            k=k,
            v=v,
            scale=None,
            initial_state=(state["kv"], state["k_sum"]),
            output_final_state=True,
            normalize=True,
        )
        state["kv"].copy_(kv)
        state["k_sum"].copy_(k_sum)
        return y

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]: one recurrent update, kv += φ(k)v^T and k_sum += φ(k), in place."""
        check_step_input(x_t, self.d_model, self.name)
        if self.impl == "fla":
            return self.forward(x_t[:, None], state)[:, 0]
        q, k, v = (t[:, 0] for t in self._qkv(x_t[:, None]))  # [B, H, f], [B, H, f], [B, H, d_v]
        if self.impl == "triton":
            require_triton_device(q, self.name, self.impl)
            _, fused_recurrent_based = _triton_ops()
            y = fused_recurrent_based(q, k, v, (state["kv"], state["k_sum"]))  # [B, H, d_v]
        else:
            y = self._naive_step(q, k, v, state)
        return self.out(rearrange(y.to(x_t.dtype), "b h d -> b (h d)"))  # [B, d_model]

    def _naive_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """q, k: [B, H, f], v: [B, H, d_v] -> y: [B, H, d_v]; the recurrent form, updating state in place. The
        update is computed in fp32 (fp64) and rounded once to kv's storage dtype; y is read from kv as stored."""
        kv, k_sum = state["kv"], state["k_sum"]
        dtype = torch.promote_types(q.dtype, k_sum.dtype)
        with torch.autocast(device_type=q.device.type, enabled=False):
            phi_q = taylor_feature_map(q.to(dtype))  # [B, H, E]
            phi_k = taylor_feature_map(k.to(dtype))  # [B, H, E]
            kv.copy_(kv.to(dtype) + torch.einsum("bhe,bhd->bhed", phi_k, v.to(dtype)))
            k_sum.add_(phi_k.to(k_sum.dtype))
            num = torch.einsum("bhe,bhed->bhd", phi_q, kv.to(dtype))  # [B, H, d_v]
            den = torch.einsum("bhe,bhe->bh", phi_q, k_sum.to(dtype))  # [B, H]
            return num / (den[..., None] + self.config.eps)

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed kv [B, H, E, d_v] and k_sum [B, H, E] on the module's device: fp32 (fp64 if dtype is fp64), kv in
        bf16 with state_dtype="bf16"."""
        device, dtype = module_device_dtype(self, device, dtype)
        dtype = compute_dtype(dtype)
        H, E, dv = self.num_heads, self.expanded_dim, self.head_dim_v
        return {
            "kv": torch.zeros(batch_size, H, E, dv, device=device, dtype=self._kv_dtype(dtype)),
            "k_sum": torch.zeros(batch_size, H, E, device=device, dtype=dtype),
        }

    def _kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """kv's storage dtype for a state whose sums are in `dtype` (fp32 or fp64)."""
        return torch.bfloat16 if self.config.state_dtype == "bf16" else dtype

    def state_size(self, seq_len: int) -> int:
        """H·(E·d_v + E) elements per sequence, constant in seq_len (as every mixer counts: elements, not bytes;
        `state_nbytes` has the bytes)."""
        return self.num_heads * (self.expanded_dim * self.head_dim_v + self.expanded_dim)

    def state_nbytes(self, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of one sequence's state as `init_state` allocates it for a `dtype` model: 4·H·(E·d_v + E) in fp32;
        with state_dtype="bf16", kv's H·E·d_v elements take 2 bytes each, about half of that."""
        dtype = compute_dtype(dtype)
        H, E, dv = self.num_heads, self.expanded_dim, self.head_dim_v
        return H * E * dv * self._kv_dtype(dtype).itemsize + H * E * dtype.itemsize
