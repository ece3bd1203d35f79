"""Gated short convolution: Zoology's BaseConv at a positive `kernel_size` (Arora et al., 2023, "Zoology").

    y = conv_k(u) ⊙ Linear(d → d)(u) + u          conv_k: causal depthwise convolution of k taps, with bias

This is the "BaseConv(k=3)" layer of the Zoology and Based Fig. 2 configs: layer 0 of Zoology's BaseConv model
(`kernel_size=[3, -1]`, then `long_conv`) and of every `Hybrid[BaseConv, X]` model. It is not the `base_conv`
mixer, which is the Based LM's layer (Linear d → 4d, SiLU(conv) ⊙ other half, Linear 2d → d): here there is no
expansion, no activation, and the input is added back after the gate.

What is unusual here: the state is exactly the last k − 1 inputs [B, k − 1, d], so state_size = d·(k − 1).
REFERENCE's "short conv: d·k" (Zoology's own count) also counts the current token, which decoding never stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zoo.models.mixers._common import check_input, check_int, check_step_input, make_config, module_device_dtype
from zoo.models.mixers._long_conv import depthwise_causal_conv


@dataclass
class ShortConvConfig:
    """Options of `short_conv` (d_model comes from the model)."""

    kernel_size: int = 3

    def validate(self, d_model: int) -> None:
        check_int("short_conv: kernel_size", self.kernel_size, minimum=1)


class ShortConv(nn.Module):
    """Gated causal depthwise short conv: [B, T, d_model] -> [B, T, d_model].

    State: {"conv": [B, kernel_size - 1, d]}, the last inputs (zeros before the first token).
    """

    Config = ShortConvConfig
    name = "short_conv"

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        self.kernel_size = self.config.kernel_size
        self.projection = nn.Linear(d_model, d_model)
        self.conv = nn.Conv1d(d_model, d_model, self.kernel_size, groups=d_model, bias=True)

    def _conv(self, u: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """u: [B, T, d], history: [B, k-1, d] -> [B, T, d]."""
        weight, bias = self.conv.weight[:, 0].to(u.dtype), self.conv.bias.to(u.dtype)  # [d, k], [d]
        return depthwise_causal_conv(u, weight, history) + bias

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: the conv sees the stored inputs first."""
        check_input(x, self.d_model, self.name)
        k = self.kernel_size
        history = x.new_zeros(x.shape[0], k - 1, self.d_model) if state is None else state["conv"]
        y = self._conv(x, history) * self.projection(x) + x
        if state is not None:
            u_full = torch.cat([history.to(x.dtype), x], dim=1)  # [B, T + k - 1, d]
            state["conv"].copy_(u_full[:, u_full.shape[1] - (k - 1) :])
        return y  # [B, T, d_model]

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]; shifts the stored inputs in place."""
        check_step_input(x_t, self.d_model, self.name)
        return self.forward(x_t[:, None], state)[:, 0]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed history [B, kernel_size - 1, d] on the module's device and dtype by default."""
        device, dtype = module_device_dtype(self, device, dtype)
        return {"conv": torch.zeros(batch_size, self.kernel_size - 1, self.d_model, device=device, dtype=dtype)}

    def state_size(self, seq_len: int) -> int:
        """d·(kernel_size - 1) per sequence, constant in seq_len."""
        return self.d_model * (self.kernel_size - 1)
