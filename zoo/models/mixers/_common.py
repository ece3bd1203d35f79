"""Pieces shared by the mixers: option checking, the impl log, rotary embeddings, the default head count.

Nothing here is a mixer; the registry is `MIXERS` in `zoo/models/mixers/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from kernels.launch import triton_runs_on

logger = logging.getLogger("zoo.models.mixers")

_LOGGED_IMPLS: set[tuple[str, str]] = set()


def make_config(mixer: str, config_cls: type, d_model: int, options: dict[str, Any]) -> Any:
    """Build and validate `config_cls(**options)`; unknown options and impossible values raise ValueError."""
    known = [f.name for f in dataclasses.fields(config_cls)]
    for key in options:
        if key not in known:
            raise ValueError(f"mixer {mixer!r} has no option {key!r} (options: {', '.join(known)})")
    check_int(f"{mixer}: d_model", d_model, minimum=1)
    config = config_cls(**options)
    config.validate(d_model)
    return config


def check_int(what: str, value: Any, minimum: int) -> None:
    """Raise ValueError unless `value` is an int (not a bool) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")


# The impls written in PyTorch, which torch.func.vmap can batch: the token loops and the chunked forms. zoo/steps.py
# packs a mixer whose impl is in its class's `vmap_impls` (these by default): `fla` calls kernels with no vmap rule,
# and a Triton impl packs where its custom op has one (Mamba's selective scan, RWKV-4's WKV, Based's chunk_based).
PYTORCH_IMPLS = ("naive", "chunk")


def check_choice(what: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{what} must be one of {'|'.join(choices)}, got {value!r}")


def default_num_heads(d_model: int) -> int:
    """Heads of width about 64: the largest divisor of d_model that is <= d_model // 64 (1 below d_model=128)."""
    heads = max(1, d_model // 64)
    while d_model % heads:
        heads -= 1
    return heads


def log_impl(mixer: str, impl: str) -> None:
    """Log the chosen compute path once per process and (mixer, impl)."""
    if (mixer, impl) not in _LOGGED_IMPLS:
        _LOGGED_IMPLS.add((mixer, impl))
        logger.info("mixer %s uses impl=%r", mixer, impl)


def require_triton_device(x: torch.Tensor, mixer: str, impl: str) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under the interpreter (TRITON_INTERPRET=1)."""
    if not triton_runs_on(x.device):
        raise RuntimeError(
            f"mixer {mixer!r} impl={impl!r} runs Triton kernels: needs CUDA tensors or TRITON_INTERPRET=1 "
            f"(got a {x.device.type} tensor); use impl='naive' on CPU"
        )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32: bf16/fp16 activations are upcast for accumulations, fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def rotary_inv_freq(dim: int, device: torch.device, dtype: torch.dtype, base: float = 10000.0) -> torch.Tensor:
    """The rotary frequencies base^(-2i/dim), i = 0 .. dim/2 - 1: [dim/2] in dtype."""
    return base ** (-torch.arange(0, dim, 2, device=device, dtype=dtype) / dim)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al., 2021), half-split convention (rotate_half).

    x: [B, T, H, D] with D even; positions: [T] integer absolute positions. Angles are computed in at least
    fp32 and the result is cast back to x's dtype.
    """
    dtype = compute_dtype(x.dtype)
    inv_freq = rotary_inv_freq(x.shape[-1], x.device, dtype, base)  # [D/2]
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = angles.cos()[None, :, None, :]  # [1, T, 1, D/2]
    sin = angles.sin()[None, :, None, :]  # [1, T, 1, D/2]
    x1, x2 = x.to(dtype).chunk(2, dim=-1)  # [B, T, H, D/2] each
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [B, T, H, D]
    return rotated.to(x.dtype)


def check_input(x: torch.Tensor, d_model: int, mixer: str) -> None:
    """Raise ValueError unless x is [B, T, d_model] with T >= 1."""
    if x.dim() != 3 or x.shape[-1] != d_model or x.shape[1] < 1:
        raise ValueError(f"mixer {mixer!r} expects x of shape [B, T>=1, {d_model}], got {list(x.shape)}")


def check_step_input(x_t: torch.Tensor, d_model: int, mixer: str) -> None:
    """Raise ValueError unless x_t is [B, d_model]."""
    if x_t.dim() != 2 or x_t.shape[-1] != d_model:
        raise ValueError(f"mixer {mixer!r} step expects x_t of shape [B, {d_model}], got {list(x_t.shape)}")


def module_device_dtype(
    module: torch.nn.Module, device: torch.device | str | None, dtype: torch.dtype | None
) -> tuple[torch.device, torch.dtype]:
    """Defaults for init_state: the device and dtype of the module's first parameter."""
    param = next(module.parameters())
    return (torch.device(device) if device is not None else param.device), (dtype or param.dtype)


def zoology_mamba_block_init(
    projections: tuple[torch.nn.Linear, ...], conv_weight: torch.Tensor, conv_bias: torch.Tensor, n_layers: int
) -> None:
    """Zoology's init for its Mamba blocks, which the LanguageModel's generic one would otherwise replace: each
    projection keeps nn.Linear's own U(±1/√fan_in), the last one (out_proj) further divided by √n_layers (GPT-2's
    residual scaling), and the depthwise conv [channels, k] takes nn.Conv1d's U(±1/√k) for weight and bias."""
    for linear in projections:
        linear.reset_parameters()
    with torch.no_grad():
        projections[-1].weight /= math.sqrt(n_layers)
        bound = 1 / math.sqrt(conv_weight.shape[-1])
        conv_weight.uniform_(-bound, bound)
        conv_bias.uniform_(-bound, bound)
