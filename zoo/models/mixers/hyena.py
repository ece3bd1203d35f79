"""Hyena (Poli et al., 2023, "Hyena Hierarchy: Towards Larger Convolutional Language Models"), order 2.

    x1, x2, v = split(shortconv_3(Linear(d → 3d)(x)))        short depthwise causal conv, kernel k
    z = x1 ⊙ v
    y = Linear(d → d)(x2 ⊙ (h ∗ z + bias ⊙ z))               h: a long causal filter per channel

The long filter is implicit: h[t, c] = MLP(pos(t))[c] · exp(-α_c · t / max_seq_len), where pos(t) holds
t / max_seq_len and `num_freqs` sin/cos pairs (`positions="zoology"`: Zoology's learned features, and t / (L-1)
in both places), the MLP has sine activations (`filter_depth` hidden-to-hidden layers; with `learn_freq` one
learned frequency per hidden unit, shared by every activation, as in Zoology's Hyena), and the decay rates α_c
are spread over [decay_min, decay_max] across channels. The convolution runs
through `causal_conv` (a Toeplitz matmul up to DIRECT_MAX_T positions, an FFT of length 2T beyond), with the
bias term folded into the filter's lag 0.
`short_bias` gives the short conv a bias (Zoology's has one).

What is unusual here (decoding a long convolution):
- A long convolution has no finite recurrent state, so `step` is exact by keeping the whole history of z:
  the state holds z for every past token in a buffer of `max_seq_len` rows, like attention's KV buffer,
  and each step sums h[pos - s] · z_s over the buffer with a mask (fixed shapes, CUDA-graph friendly).
- `state_size(seq_len)` is what the state holds, whatever seq_len (≤ max_seq_len) is: d·max_seq_len for the z
  buffer + 3d·(k-1) for the short conv's inputs, the element count of the real state tensors. At
  max_seq_len = L (Zoology's `l_max=L`, its Fig. 2 setting) the buffer is REFERENCE's "long conv / Hyena: d·L".
  Sequences longer than max_seq_len raise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kernels.launch import is_capturing
from zoo.models.mixers._common import (
    check_input,
    check_int,
    check_step_input,
    make_config,
    module_device_dtype,
)
from zoo.models.mixers._long_conv import causal_conv, depthwise_causal_conv


@dataclass
class HyenaConfig:
    """Options of `hyena` (d_model comes from the model)."""

    max_seq_len: int = 2048  # rows of the decode history; filter positions are t / max_seq_len
    filter_hidden: int = 64  # width of the implicit filter's MLP
    num_freqs: int = 8  # sin/cos pairs of the filter's positional features
    short_kernel_size: int = 3
    decay_min: float = 0.5  # slowest channel decay rate α over t / max_seq_len
    decay_max: float = 20.0  # fastest
    filter_depth: int = 1  # hidden-to-hidden layers of the filter MLP (Zoology's Hyena: 2)
    learn_freq: bool = False  # learned sine frequencies (one per hidden unit, initialised at 1)
    short_bias: bool = False  # a bias on the short conv
    positions: str = "fixed"  # fixed | zoology (the filter's position features as Zoology's Hyena: see ImplicitFilter)

    def validate(self, d_model: int) -> None:
        check_int("hyena: max_seq_len", self.max_seq_len, minimum=1)
        check_int("hyena: filter_hidden", self.filter_hidden, minimum=1)
        check_int("hyena: num_freqs", self.num_freqs, minimum=0)
        check_int("hyena: short_kernel_size", self.short_kernel_size, minimum=1)
        check_int("hyena: filter_depth", self.filter_depth, minimum=0)
        if self.positions not in ("fixed", "zoology"):
            raise ValueError(f"hyena: positions must be fixed or zoology, got {self.positions!r}")
        if self.positions == "zoology" and self.num_freqs < 1:
            raise ValueError("hyena: positions=zoology needs num_freqs >= 1 (Zoology's emb_dim 3 is one band)")
        for name in ("learn_freq", "short_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"hyena: {name} must be true or false, got {getattr(self, name)!r}")
        for name in ("decay_min", "decay_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"hyena: {name} must be a number >= 0, got {value!r}")
        if self.decay_min > self.decay_max:
            raise ValueError(f"hyena: decay_min={self.decay_min} exceeds decay_max={self.decay_max}")


class ImplicitFilter(nn.Module):
    """h[t, c] for t = 0..T-1: a sine-activated MLP of positional features, times an exponential decay.

    Every sine activation shares one frequency vector ω (sin(ω ⊙ x), ω = 1 fixed or learned per unit), held here as
    one parameter rather than as one module reused between the layers: torch.compile over a vmapped pack does not
    compile a module that appears at several places of a Sequential (its batched parameter leaks out of the graph).
    """

    def __init__(self, channels: int, config: HyenaConfig) -> None:
        super().__init__()
        self.max_seq_len = config.max_seq_len
        self.num_freqs = config.num_freqs
        if config.positions == "zoology":
            # Zoology's PositionalEmbedding: z = [t, cos(f·w), -sin(f·w)] with t = linspace(0, 1, L) (position /
            # (L-1)), w = 2π·position / L and f = linspace(1e-4, F-1, F): a learned parameter (Zoology registers it
            # with lr 1e-5, which its trainer does not read). The decay reads the same t.
            L, F = config.max_seq_len, config.num_freqs
            t = torch.linspace(0, 1, L)[:, None]  # [L, 1]
            w = 2 * math.pi * torch.arange(L, dtype=torch.float32)[:, None] / L  # [L, 1]
            f = torch.linspace(1e-4, F - 1, F)[None, :]  # [1, F]
            self.z = nn.Parameter(torch.cat([t, torch.cos(f * w), -torch.sin(f * w)], dim=-1))  # [L, 1 + 2F]
            self.register_buffer("t", t, persistent=False)
        else:
            self.z = None
        width = config.filter_hidden
        widths = [1 + 2 * config.num_freqs] + [width] * (config.filter_depth + 1)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.freq = nn.Parameter(torch.ones(width)) if config.learn_freq else None
        self.head = nn.Linear(width, channels, bias=False)
        self.register_buffer("decay", torch.linspace(config.decay_min, config.decay_max, channels), persistent=False)

    def forward(self, length: int) -> torch.Tensor:
        """-> h: [length, channels] in the parameters' dtype."""
        dtype = self.head.weight.dtype
        if self.z is not None:
            t, x = self.t[:length].to(dtype), self.z[:length].to(dtype)  # [T, 1], [T, 1 + 2F]
        else:
            t = torch.arange(length, device=self.decay.device, dtype=dtype)[:, None] / self.max_seq_len  # [T, 1]
            freqs = torch.arange(1, self.num_freqs + 1, device=t.device, dtype=dtype)[None, :]  # [1, F]
            x = torch.cat([t, torch.sin(2 * math.pi * freqs * t), torch.cos(2 * math.pi * freqs * t)], dim=-1)
        for linear in self.hidden:
            x = linear(x)
            x = torch.sin(x if self.freq is None else self.freq.to(x.dtype) * x)
        return self.head(x) * torch.exp(-self.decay.to(dtype)[None, :] * t)  # [T, C]


class Hyena(nn.Module):
    """Order-2 Hyena operator: [B, T, d_model] -> [B, T, d_model].

    State: {"short": [B, k-1, 3d] short-conv inputs, "z": [B, max_seq_len, d] long-conv inputs,
    "pos": [] int64 tokens seen}.
    """

    Config = HyenaConfig
    name = "hyena"
    slot_state = ("z",)  # [B, slots, d]: a step reads the filled slots and writes one (step_state_nbytes)

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        self.k = self.config.short_kernel_size
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.short_weight = nn.Parameter(torch.randn(3 * d_model, self.k) / math.sqrt(self.k))
        self.short_bias = nn.Parameter(torch.zeros(3 * d_model)) if self.config.short_bias else None
        self.filter = ImplicitFilter(d_model, self.config)
        self.bias = nn.Parameter(torch.randn(d_model))
        self.out = nn.Linear(d_model, d_model)

    @torch.no_grad()
    def zoology_init(self, layer_idx: int) -> None:
        """Zoology's short filter is an nn.Conv1d (groups = 3d) at PyTorch's init: weight and bias U(±1/√k)."""
        bound = 1 / math.sqrt(self.k)
        self.short_weight.uniform_(-bound, bound)
        if self.short_bias is not None:
            self.short_bias.uniform_(-bound, bound)

    def _gates(self, x: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, d], history: [B, k-1, 3d] -> x2, z: [B, T, d] and the new short history [B, k-1, 3d]."""
        u = self.in_proj(x)  # [B, T, 3d]
        u_conv = depthwise_causal_conv(u, self.short_weight, history)  # [B, T, 3d]
        if self.short_bias is not None:
            u_conv = u_conv + self.short_bias.to(u_conv.dtype)
        new_history = torch.cat([history.to(u.dtype), u], dim=1)[:, u.shape[1] :]  # [B, k-1, 3d]
        x1, x2, v = u_conv.chunk(3, dim=-1)  # [B, T, d] each
        return x2, x1 * v, new_history

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: the filter also reaches the stored z history."""
        check_input(x, self.d_model, self.name)
        B, T, _ = x.shape
        history = x.new_zeros(B, self.k - 1, 3 * self.d_model) if state is None else state["short"]
        x2, z, new_history = self._gates(x, history)
        pos = 0 if state is None else int(state["pos"])
        if pos + T > self.config.max_seq_len:
            raise ValueError(f"hyena: {pos} + {T} tokens exceed max_seq_len={self.config.max_seq_len}")
        z_full = z if state is None else torch.cat([state["z"][:, :pos].to(z.dtype), z], dim=1)  # [B, pos+T, d]
        h = self.filter(pos + T)  # [pos+T, d]
        # bias ⊙ z is the filter's lag 0: h ∗ z + bias ⊙ z = (h + bias·δ_0) ∗ z, no pass over [B, T, d] for it.
        h = torch.cat([h[:1] + self.bias.to(h.dtype), h[1:]])
        conv = causal_conv(z_full, h)[:, pos:]  # [B, T, d]
        if state is not None:
            state["short"].copy_(new_history)
            state["z"][:, pos : pos + T] = z.to(state["z"].dtype)
            state["pos"].add_(T)
        return self.out(x2 * conv)  # [B, T, d_model]

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]; appends z_t to the history, then sums h[pos-s]·z_s over it."""
        check_step_input(x_t, self.d_model, self.name)
        pos = state["pos"]
        if not is_capturing(x_t) and int(pos) >= self.config.max_seq_len:
            raise ValueError(f"hyena: {int(pos)} + 1 tokens exceed max_seq_len={self.config.max_seq_len}")
        x2, z, new_history = self._gates(x_t[:, None], state["short"])
        state["short"].copy_(new_history)
        state["z"].index_copy_(1, pos[None], z.to(state["z"].dtype))
        S = self.config.max_seq_len
        h = self.filter(S)  # [S, d], h[lag]
        lags = pos - torch.arange(S, device=x_t.device)  # [S]: lag of each buffer row
        h_rows = torch.where((lags >= 0)[:, None], h[lags.clamp(min=0)], 0.0)  # [S, d]
        conv = torch.einsum("bsd,sd->bd", state["z"].to(h.dtype), h_rows)  # [B, d]
        pos.add_(1)
        return self.out(x2[:, 0] * (conv.to(z.dtype) + self.bias * z[:, 0]))  # [B, d_model]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed short-conv inputs [B, k-1, 3d], z history [B, max_seq_len, d] and pos = 0."""
        device, dtype = module_device_dtype(self, device, dtype)
        d = self.d_model
        return {
            "short": torch.zeros(batch_size, self.k - 1, 3 * d, device=device, dtype=dtype),
            "z": torch.zeros(batch_size, self.config.max_seq_len, d, device=device, dtype=dtype),
            "pos": torch.zeros((), device=device, dtype=torch.int64),
        }

    def state_size(self, seq_len: int) -> int:
        """d·max_seq_len (the z buffer, held whatever seq_len is) + 3d·(k-1) (short-conv inputs)."""
        return self.d_model * self.config.max_seq_len + 3 * self.d_model * (self.k - 1)
