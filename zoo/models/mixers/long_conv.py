"""Gated long convolution: Zoology's BaseConv at `kernel_size=-1` (Arora et al., 2023, "Zoology", Fig. 2).

    y = (h ∗ u + u) ⊙ Linear(d → d)(u) + u         h: one causal filter per channel, as long as the sequence

The filter is implicit by default (`filter: implicit`): h[t, c] = MLP(z_t)[c], with z_t = [t / (max_seq_len - 1),
cos(2π f_b t / max_seq_len), -sin(2π f_b t / max_seq_len)] over `num_bands` frequencies
f_b = linspace(1e-4, num_bands - 1, num_bands) and the MLP Linear(1 + 2·num_bands → filter_hidden), ReLU,
Linear(filter_hidden → d). This is the Zoology Fig. 2 setting (d_emb 3, hidden 16): with one band of frequency
1e-4 the features are nearly [t, 1, 0], so the filter is a ReLU network of the position alone.
`filter: explicit` makes every tap h[t, c] a parameter of its own, drawn N(0, 1): Zoology's `LongConvolution`,
the filter its BaseConv used until commit 8486daf (2023-10-29), which the launch behind the published Fig. 2's
BaseConv points may have run (experiments/zoology_fig2/README.md); d·max_seq_len parameters instead of the MLP's.
The `+ u` inside the gate is the convolution's skip term with a fixed weight of 1, as in Zoology's FFT
convolution. The convolution runs through `causal_conv` (a Toeplitz matmul up to DIRECT_MAX_T positions, an FFT
of length 2T beyond).

With the sequence length of Zoology's configs (`max_seq_len` = L, its `l_max`) the filter spans every lag a
sequence can reach: a key L - 1 tokens back still reaches the query, which a k = 3 short convolution cannot.

What is unusual here (decoding a long convolution):
- A long convolution has no finite recurrent state, so `step` is exact by keeping every past input: the state
  holds u for every position in a buffer preallocated at `max_seq_len` rows (fixed shapes, CUDA-graph
  friendly), and each step sums h[pos - s] · u_s over the buffer with a mask.
- `state_size(seq_len)` is what the state holds: d·max_seq_len elements whatever seq_len (≤ max_seq_len) is,
  the element count of the buffer. At `max_seq_len` = L, the Zoology Fig. 2 setting, that is REFERENCE's
  "long conv: d·L". Sequences longer than max_seq_len raise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kernels.launch import is_capturing
from zoo.models.mixers._common import check_input, check_int, check_step_input, make_config, module_device_dtype
from zoo.models.mixers._long_conv import causal_conv


@dataclass
class LongConvConfig:
    """Options of `long_conv` (d_model comes from the model)."""

    max_seq_len: int = 2048  # filter length and rows of the decode buffer (Zoology's l_max)
    filter_hidden: int = 16  # width of the filter MLP (Zoology's d_hidden)
    num_bands: int = 1  # sin/cos pairs of the filter's position features (Zoology's (d_emb - 1) / 2)
    filter: str = "implicit"  # implicit: the position MLP above; explicit: one N(0, 1) parameter per tap

    def validate(self, d_model: int) -> None:
        check_int("long_conv: max_seq_len", self.max_seq_len, minimum=1)
        check_int("long_conv: filter_hidden", self.filter_hidden, minimum=1)
        check_int("long_conv: num_bands", self.num_bands, minimum=1)
        if self.filter not in ("implicit", "explicit"):
            raise ValueError(f"long_conv: filter must be implicit or explicit, got {self.filter!r}")


class PositionFilter(nn.Module):
    """h[t, c] for t = 0..T-1: a ReLU MLP of fixed sin/cos position features of the filter's own length."""

    def __init__(self, channels: int, config: LongConvConfig) -> None:
        super().__init__()
        L, bands = config.max_seq_len, config.num_bands
        t = torch.linspace(0, 1, L)[:, None]  # [L, 1]
        angle = 2 * math.pi * torch.arange(L, dtype=torch.float32)[:, None] / L  # [L, 1]
        freqs = torch.linspace(1e-4, bands - 1, bands)[None, :]  # [1, bands]
        feats = torch.cat([t, torch.cos(freqs * angle), -torch.sin(freqs * angle)], dim=-1)  # [L, 1 + 2·bands]
        self.register_buffer("features", feats, persistent=False)
        self.mlp = nn.Sequential(
            nn.Linear(1 + 2 * bands, config.filter_hidden), nn.ReLU(), nn.Linear(config.filter_hidden, channels)
        )

    def forward(self, length: int) -> torch.Tensor:
        """-> h: [length, channels] in the parameters' dtype (length <= max_seq_len)."""
        dtype = self.mlp[0].weight.dtype
        return self.mlp(self.features[:length].to(dtype))  # [T, C]


class FreeFilter(nn.Module):
    """h[t, c] for t = 0..T-1: a parameter per tap, [max_seq_len, channels] drawn N(0, 1) as Zoology's
    `LongConvolution` draws its [channels, l_max] filter (the model's init leaves it alone: it is no Linear)."""

    def __init__(self, channels: int, config: LongConvConfig) -> None:
        super().__init__()
        self.taps = nn.Parameter(torch.randn(config.max_seq_len, channels))

    def forward(self, length: int) -> torch.Tensor:
        """-> h: [length, channels] in the parameters' dtype (length <= max_seq_len)."""
        return self.taps[:length]


class LongConv(nn.Module):
    """Gated long convolution: [B, T, d_model] -> [B, T, d_model].

    State: {"u": [B, max_seq_len, d] every past input of the convolution, "pos": [] int64 tokens seen}.
    """

    Config = LongConvConfig
    name = "long_conv"
    slot_state = ("u",)  # [B, slots, d]: a step reads the filled slots and writes one (step_state_nbytes)

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        self.projection = nn.Linear(d_model, d_model)
        self.filter = (PositionFilter if self.config.filter == "implicit" else FreeFilter)(d_model, self.config)

    def _gate(self, u: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        """(conv + u) ⊙ projection(u) + u on [..., d]."""
        return (conv.to(u.dtype) + u) * self.projection(u) + u

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: the filter also reaches the stored inputs."""
        check_input(x, self.d_model, self.name)
        T = x.shape[1]
        if state is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"long_conv: T={T} exceeds max_seq_len={self.config.max_seq_len}")
            return self._gate(x, causal_conv(x, self.filter(T)))  # [B, T, d_model]
        pos = int(state["pos"])
        if pos + T > self.config.max_seq_len:
            raise ValueError(f"long_conv: {pos} + {T} tokens exceed max_seq_len={self.config.max_seq_len}")
        u_full = torch.cat([state["u"][:, :pos].to(x.dtype), x], dim=1)  # [B, pos + T, d]
        conv = causal_conv(u_full, self.filter(pos + T))[:, pos:]  # [B, T, d]
        state["u"][:, pos : pos + T] = x.to(state["u"].dtype)
        state["pos"].add_(T)
        return self._gate(x, conv)

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]; stores x_t, then sums h[pos - s] · u_s over the buffer."""
        check_step_input(x_t, self.d_model, self.name)
        pos, S = state["pos"], self.config.max_seq_len
        if not is_capturing(x_t) and int(pos) >= S:
            raise ValueError(f"long_conv: {int(pos)} + 1 tokens exceed max_seq_len={S}")
        state["u"].index_copy_(1, pos[None], x_t[:, None].to(state["u"].dtype))
        h = self.filter(S)  # [S, d], h[lag]
        lags = pos - torch.arange(S, device=x_t.device)  # [S]: the lag of each buffer row
        h_rows = torch.where((lags >= 0)[:, None], h[lags.clamp(min=0)], 0.0)  # [S, d]
        conv = torch.einsum("bsd,sd->bd", state["u"].to(h.dtype), h_rows)  # [B, d]
        pos.add_(1)
        return self._gate(x_t, conv)

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed input buffer [B, max_seq_len, d] and pos = 0 (module's device and dtype by default)."""
        device, dtype = module_device_dtype(self, device, dtype)
        return {
            "u": torch.zeros(batch_size, self.config.max_seq_len, self.d_model, device=device, dtype=dtype),
            "pos": torch.zeros((), device=device, dtype=torch.int64),
        }

    def state_size(self, seq_len: int) -> int:
        """d·max_seq_len: the input buffer the decode state holds (d·L at max_seq_len = L), for any seq_len."""
        return self.d_model * self.config.max_seq_len
