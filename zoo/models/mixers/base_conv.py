"""BaseConv: a gated short convolution (Arora et al., 2023, "Zoology"; used by Based, Arora et al., 2024).

    u, g = split(Linear(d → 2·expand·d)(x))         two halves of `channels = expand·d` each
    y = Linear(channels → d)(SiLU(causal depthwise conv_k(u)) ⊙ g)

With the defaults (expand 2, k 3) this is the Based layer: Linear d→4d, split, SiLU(conv) × other half,
Linear 2d→d.

What is unusual here: the state is exactly the last kernel_size−1 conv inputs [B, kernel_size−1, channels],
so state_size = channels·(kernel_size−1). REFERENCE's table entry "short conv: d·k" is the generic order of
magnitude; this is the exact count of what decoding keeps.

`impl="triton"` runs the decoding step's convolution, SiLU, gate and history shift as one kernel
(kernels/base_conv) between the two projections; training and chunked prefill stay the PyTorch forward.
`impl="naive"` (the default) is PyTorch throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from zoo.models.mixers._common import (
    check_choice,
    check_input,
    check_int,
    check_step_input,
    log_impl,
    make_config,
    module_device_dtype,
    require_triton_device,
)


@dataclass
class BaseConvConfig:
    """Options of `base_conv` (d_model comes from the model)."""

    kernel_size: int = 3
    expand: int = 2  # channels = expand·d_model
    impl: str = "naive"  # naive | triton (the decoding step between the projections as one kernel, kernels/base_conv)

    def validate(self, d_model: int) -> None:
        check_int("base_conv: kernel_size", self.kernel_size, minimum=1)
        check_int("base_conv: expand", self.expand, minimum=1)
        check_choice("base_conv: impl", self.impl, ("naive", "triton"))


class BaseConv(nn.Module):
    """Gated causal depthwise short conv: [B, T, d_model] -> [B, T, d_model].

    State: {"conv": [B, kernel_size-1, channels]}, the last conv inputs (zeros before the first token).
    """

    Config = BaseConvConfig
    name = "base_conv"
    vmap_impls = ("naive", "triton")  # training is the PyTorch forward under either: zoo/steps.py packs both

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        self.kernel_size = self.config.kernel_size
        self.channels = self.config.expand * d_model
        self.in_proj = nn.Linear(d_model, 2 * self.channels, bias=False)
        self.conv = nn.Conv1d(self.channels, self.channels, self.kernel_size, groups=self.channels, bias=True)
        self.out = nn.Linear(self.channels, d_model, bias=False)
        self.impl = self.config.impl
        if self.impl == "triton":
            from kernels.base_conv.decode import conv_decode

            self._conv_decode = conv_decode
            log_impl(self.name, self.impl)

    def _conv_valid(self, u: torch.Tensor) -> torch.Tensor:
        """u: [B, T + k - 1, C] (history first) -> [B, T, C]: the unpadded depthwise conv."""
        # weight and bias in u's dtype: autocast casts them for a plain conv1d but not for vmap's batched one
        # (zoo/steps.py under bf16 autocast), where an fp32 bias beside bf16 inputs is an error
        w, b = self.conv.weight.to(u.dtype), self.conv.bias.to(u.dtype)
        y = F.conv1d(rearrange(u, "b t c -> b c t"), w, b, groups=self.channels)
        return rearrange(y, "b c t -> b t c")  # [B, T, C]

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: the conv sees the stored inputs first."""
        check_input(x, self.d_model, self.name)
        u, g = self.in_proj(x).chunk(2, dim=-1)  # [B, T, C] each
        k = self.kernel_size
        if state is None:
            history = u.new_zeros(u.shape[0], k - 1, self.channels)  # [B, k-1, C]
        else:
            history = state["conv"].to(u.dtype)  # [B, k-1, C]
        u_full = torch.cat([history, u], dim=1)  # [B, T + k - 1, C]
        if state is not None:
            state["conv"].copy_(u_full[:, u_full.shape[1] - (k - 1) :])
        return self.out(F.silu(self._conv_valid(u_full)) * g)  # [B, T, d_model]

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]; shifts the stored conv inputs in place."""
        check_step_input(x_t, self.d_model, self.name)
        if self.impl == "triton":
            require_triton_device(x_t, self.name, self.impl)
            return self.out(self._conv_decode(self.in_proj(x_t), state["conv"], self.conv.weight, self.conv.bias))
        u, g = self.in_proj(x_t).chunk(2, dim=-1)  # [B, C] each
        # k multiply-adds on [B, C] and a shift of the history in place: no [B, k, C] window is built (its
        # concatenation and the batched GEMV over it were ~8% of a Based-1B decode step at batch 1,024)
        history, k = state["conv"], self.kernel_size  # [B, k-1, C]
        weight = self.conv.weight[:, 0].to(u.dtype)  # [C, k]
        conv = torch.addcmul(self.conv.bias.to(u.dtype), u, weight[:, k - 1])  # [B, C]
        for i in range(k - 1):
            conv = torch.addcmul(conv, history[:, i].to(u.dtype), weight[:, i])
        for i in range(k - 2):
            history[:, i].copy_(history[:, i + 1])
        if k > 1:
            history[:, k - 2].copy_(u)
        return self.out(F.silu(conv) * g)  # [B, d_model]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed conv history [B, kernel_size-1, channels] on the module's device and dtype by default."""
        device, dtype = module_device_dtype(self, device, dtype)
        return {"conv": torch.zeros(batch_size, self.kernel_size - 1, self.channels, device=device, dtype=dtype)}

    def state_size(self, seq_len: int) -> int:
        """channels·(kernel_size-1) per sequence, constant in seq_len."""
        return self.channels * (self.kernel_size - 1)
