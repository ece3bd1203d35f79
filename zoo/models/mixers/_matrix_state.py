"""The shared frame of the mixers whose state is one matrix per head, S: [B, H, d_k, d_v] (GLA, DeltaNet,
Gated DeltaNet, RWKV-6), each written in its own file on top of `MatrixStateMixer`.

A subclass provides the projections (`_inputs`), the recurrence for one token written plainly
(`_naive_token`, the specification), the flash-linear-attention call (`_fla`, keyword arguments only) and
the output projection (`_output`). This frame runs `impl`:

- `naive` (default): the token loop of `_naive_token` in fp32 (fp64 for fp64 models), for forward and step.
- `chunk` (DeltaNet, Gated DeltaNet): `_chunk`, the same recurrence in chunks of 64 tokens in PyTorch (a loop
  over T/64 chunks, dense matrix products inside), same dtype as naive; `step` is the token update. It runs on
  any device and under torch.func.vmap, e.g. where FLA refuses a backward (Hopper with Triton < 3.7.1).
- `fla`: FLA's chunk op for `forward`, its fused recurrent op for `step`; initial and final states go in
  and out of the same [B, H, d_k, d_v] tensor. Needs CUDA tensors, or CPU ones under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from einops import rearrange
from torch import nn

from zoo.models.mixers._common import (
    check_choice,
    check_input,
    check_int,
    check_step_input,
    compute_dtype,
    default_num_heads,
    log_impl,
    module_device_dtype,
    require_triton_device,
)

IMPLS = ("naive", "fla")
CHUNK_IMPLS = ("naive", "chunk", "fla")  # DeltaNet and Gated DeltaNet also have the chunked PyTorch form


@dataclass
class ChunkedHeadsConfig:
    """Options of the delta-rule mixers (d_model comes from the model); a subclass names its mixer in `mixer`."""

    mixer: ClassVar[str] = ""
    num_heads: int | None = None  # None: default_num_heads(d_model); d_k = d_v = d_model // num_heads
    impl: str = "naive"  # naive | chunk | fla
    chunk_size: int = 64  # tokens per chunk of impl=chunk

    def validate(self, d_model: int) -> None:
        heads = self.heads(d_model)
        check_int(f"{self.mixer}: num_heads", heads, minimum=1)
        if d_model % heads:
            raise ValueError(f"{self.mixer}: d_model={d_model} must be divisible by num_heads={heads}")
        check_choice(f"{self.mixer}: impl", self.impl, CHUNK_IMPLS)
        check_int(f"{self.mixer}: chunk_size", self.chunk_size, minimum=1)

    def heads(self, d_model: int) -> int:
        return self.num_heads if self.num_heads is not None else default_num_heads(d_model)


def fla_ops(mixer: str, module: str, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The functions `names` of `fla.ops.<module>`; a clear ImportError when FLA or one of them is missing."""
    try:
        mod = importlib.import_module(f"fla.ops.{module}")
    except ImportError as err:
        raise ImportError(f"{mixer} impl='fla' needs flash-linear-attention (import failed: {err})") from err
    missing = [name for name in names if not hasattr(mod, name)]
    if missing:
        raise ImportError(f"{mixer} impl='fla' needs fla.ops.{module}.{', '.join(missing)}")
    return tuple(getattr(mod, name) for name in names)


class MatrixStateMixer(nn.Module):
    """Frame of a matrix-state recurrent mixer; see the module docstring. Subclasses set `name`, `Config`,
    `num_heads`, `head_dim_k`, `head_dim_v`, `impl` and call `_check_impl()` at the end of `__init__`."""

    name = "matrix_state"
    FLA_MODULE = ""
    FLA_NAMES: tuple[str, ...] = ()

    def _check_impl(self) -> None:
        # Fail at build time, not at the first forward, when the asked-for path cannot be imported.
        if self.impl == "fla":
            fla_ops(self.name, self.FLA_MODULE, self.FLA_NAMES)
        log_impl(self.name, self.impl)

    def _inputs(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None) -> tuple[dict[str, torch.Tensor], Any]:
        """x: [B, T, d] -> per-token tensors [B, T, H, ...] for the recurrence, and what `_output` needs."""
        raise NotImplementedError

    def _naive_token(self, S: torch.Tensor, inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: inp holds [B, H, ...] tensors, S: [B, H, d_k, d_v] -> (o: [B, H, d_v], next S)."""
        raise NotImplementedError

    def _chunk(self, inp: dict[str, torch.Tensor], S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """impl=chunk (mixers listing it in their impls): the token loop's outputs [B, T, H, d_v] and final state,
        computed chunk by chunk in PyTorch."""
        raise NotImplementedError

    def _fla(self, inp: dict[str, torch.Tensor], S: torch.Tensor | None, recurrent: bool):
        """FLA call on [B, T, H, ...] inputs -> (o: [B, T, H, d_v], final state or None)."""
        raise NotImplementedError

    def _output(self, o: torch.Tensor, aux: Any) -> torch.Tensor:
        """o: [B, T, H, d_v] -> [B, T, d_model]."""
        raise NotImplementedError

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[B, T, H·D] -> [B, T, H, D]."""
        return rearrange(t, "b t (h d) -> b t h d", h=self.num_heads)

    def _extra_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {}

    def _extra_size(self) -> int:
        return 0

    def _run(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None, recurrent: bool) -> torch.Tensor:
        inp, aux = self._inputs(x, state)
        if self.impl == "fla":
            require_triton_device(x, self.name, self.impl)
            # Under autocast the projections come out bf16 but norms and sigmoids fp32; FLA's chunk kernels
            # dot tensors built from k and beta against v and need one dtype (gated DeltaNet's does not compile
            # with fp32 k and bf16 v). The log-decays (g, RWKV's w) keep theirs: FLA accumulates them in fp32.
            inp = {key: t if key in ("g", "w") else t.to(inp["v"].dtype) for key, t in inp.items()}
            initial = None if state is None else state["S"]
            o, final = self._fla(inp, initial, recurrent)
            if state is not None:
                state["S"].copy_(final)
            return self._output(o.to(x.dtype), aux)
        dtype = compute_dtype(x.dtype) if state is None else torch.promote_types(x.dtype, state["S"].dtype)
        B, T = x.shape[:2]
        with torch.autocast(device_type=x.device.type, enabled=False):
            if state is None:
                S = x.new_zeros(B, self.num_heads, self.head_dim_k, self.head_dim_v, dtype=dtype)
            else:
                S = state["S"].to(dtype)
            inp = {key: t.to(dtype) for key, t in inp.items()}
            if self.impl == "chunk" and not recurrent:
                o, S = self._chunk(inp, S)  # [B, T, H, d_v]
            else:
                outs = []
                for i in range(T):
                    o_t, S = self._naive_token(S, {key: t[:, i] for key, t in inp.items()})
                    outs.append(o_t)
                o = torch.stack(outs, dim=1)  # [B, T, H, d_v]
        if state is not None:
            state["S"].copy_(S)
        return self._output(o.to(x.dtype), aux)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: continues from it and updates it in place."""
        check_input(x, self.d_model, self.name)
        return self._run(x, state, recurrent=False)

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]; one recurrent update of the state, in place."""
        check_step_input(x_t, self.d_model, self.name)
        return self._run(x_t[:, None], state, recurrent=True)[:, 0]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed S [B, H, d_k, d_v] in fp32 (fp64 for fp64 models), plus the subclass's extra state."""
        device, dtype = module_device_dtype(self, device, dtype)
        shape = (batch_size, self.num_heads, self.head_dim_k, self.head_dim_v)
        return {"S": torch.zeros(shape, device=device, dtype=compute_dtype(dtype))} | self._extra_state(
            batch_size, device, dtype
        )

    def state_size(self, seq_len: int) -> int:
        """H·d_k·d_v (+ the subclass's extra state), constant in seq_len."""
        return self.num_heads * self.head_dim_k * self.head_dim_v + self._extra_size()
