"""Mamba-2 (Dao & Gu, 2024, "Transformers are SSMs"), a pure PyTorch reference of SSD.

    z, xBC, dt = split(Linear(d → 2·d_inner + 2N + H)(input))       d_inner = expand·d, H = d_inner / head_dim
    x, B, C = split(SiLU(causal depthwise conv_k(xBC)))              x: [H, P], B, C: [N] (one group)
    h_t = exp(Δ_t a_h) h_{t-1} + Δ_t x_t B_tᵀ                        h: [H, P, N], a_h = -exp(A_log_h) scalar
    y_t = h_t C_t + D_h x_t;   out = Linear(d_inner → d)(RMSNorm(y ⊙ SiLU(z)))

What is unusual here:
- `forward` is the chunked SSD form: inside a chunk of `chunk_size` tokens the quadratic form
  y_i = Σ_{j≤i} exp(Λ_i - Λ_j) (C_i·B_j) Δ_j x_j (Λ = cumulative log decay), across chunks the state h.
  `step` is the recurrence above; both are checked against each other in the tests.
- State: {"conv": [B, k-1, d_inner + 2N], "ssm": [B, H, P, N]} (SSM part in fp32);
  state_size = d_inner·N + (d_inner + 2N)·(k-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from zoo.models.mixers._common import (
    check_input,
    check_int,
    check_step_input,
    compute_dtype,
    make_config,
    module_device_dtype,
    zoology_mamba_block_init,
)
from zoo.models.mixers._long_conv import depthwise_causal_conv


@dataclass
class Mamba2Config:
    """Options of `mamba2` (d_model comes from the model)."""

    d_state: int = 64  # N
    expand: int = 2
    head_dim: int = 32  # P; heads H = expand·d_model / head_dim
    conv_size: int = 4
    chunk_size: int = 64
    dt_min: float = 1e-3
    dt_max: float = 1e-1

    def validate(self, d_model: int) -> None:
        for name in ("d_state", "expand", "head_dim", "conv_size", "chunk_size"):
            check_int(f"mamba2: {name}", getattr(self, name), minimum=1)
        if (self.expand * d_model) % self.head_dim:
            raise ValueError(f"mamba2: d_inner={self.expand * d_model} must be divisible by head_dim={self.head_dim}")
        if not (0 < self.dt_min <= self.dt_max):
            raise ValueError(f"mamba2: need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")


class Mamba2(nn.Module):
    """SSD block: [B, T, d_model] -> [B, T, d_model].

    State: {"conv": [B, conv_size-1, d_inner + 2N] past conv inputs, "ssm": [B, H, P, N] (fp32)}.
    """

    Config = Mamba2Config
    name = "mamba2"

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        c = self.config
        self.d_inner = c.expand * d_model
        self.num_heads = self.d_inner // c.head_dim
        self.conv_dim = self.d_inner + 2 * c.d_state
        H = self.num_heads
        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + H, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(self.conv_dim, c.conv_size) / math.sqrt(c.conv_size))
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim))
        dt = torch.exp(torch.rand(H) * (math.log(c.dt_max) - math.log(c.dt_min)) + math.log(c.dt_min))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt at init
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = nn.RMSNorm(self.d_inner, eps=1e-5)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def init_weights(self, n_layers: int) -> None:
        """Zoology's init for its Mamba blocks (`zoology_mamba_block_init`), run by the LanguageModel after its
        generic one; Δ, A and D keep the SSM init above."""
        zoology_mamba_block_init((self.in_proj, self.out_proj), self.conv_weight, self.conv_bias, n_layers)

    def _prepare(self, x: torch.Tensor, history: torch.Tensor):
        """x: [B, T, d] -> z [B, T, di], xh [B, T, H, P], Bm, Cm [B, T, N], dt [B, T, H], new conv history."""
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        conv = F.silu(depthwise_causal_conv(xBC, self.conv_weight, history) + self.conv_bias)  # [B, T, conv_dim]
        new_history = torch.cat([history.to(xBC.dtype), xBC], dim=1)[:, xBC.shape[1] :]
        N = self.config.d_state
        xs, Bm, Cm = conv.split([self.d_inner, N, N], dim=-1)
        xh = rearrange(xs, "b t (h p) -> b t h p", h=self.num_heads)  # [B, T, H, P]
        return z, xh, Bm, Cm, F.softplus(dt + self.dt_bias), new_history

    def _finish(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y: [B, T, H, P], z: [B, T, di] -> [B, T, d_model]."""
        y = rearrange(y, "b t h p -> b t (h p)").to(z.dtype)
        return self.out_proj(self.norm(y * F.silu(z)))

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. Chunked SSD; with a state it continues from it."""
        check_input(x, self.d_model, self.name)
        Bsz, T, _ = x.shape
        history = x.new_zeros(Bsz, self.config.conv_size - 1, self.conv_dim) if state is None else state["conv"]
        z, xh, Bm, Cm, dt, new_history = self._prepare(x, history)
        dtype = compute_dtype(x.dtype) if state is None else torch.promote_types(x.dtype, state["ssm"].dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            xh, Bm, Cm, dt = (t.to(dtype) for t in (xh, Bm, Cm, dt))
            log_a = dt * -torch.exp(self.A_log.to(dtype))  # [B, T, H]
            h = (
                xh.new_zeros(Bsz, self.num_heads, self.config.head_dim, self.config.d_state)
                if state is None
                else state["ssm"].to(dtype)
            )
            outs = []
            for s in range(0, T, self.config.chunk_size):
                c = slice(s, s + self.config.chunk_size)
                y_c, h = self._chunk(xh[:, c], Bm[:, c], Cm[:, c], dt[:, c], log_a[:, c], h)
                outs.append(y_c)
            y = torch.cat(outs, dim=1) + self.D.to(dtype)[:, None] * xh  # [B, T, H, P]
        if state is not None:
            state["conv"].copy_(new_history)
            state["ssm"].copy_(h)
        return self._finish(y, z)

    @staticmethod
    def _chunk(xh, Bm, Cm, dt, log_a, h):
        """One SSD chunk of C tokens. xh: [B, C, H, P], Bm, Cm: [B, C, N], dt, log_a: [B, C, H], h: [B, H, P, N]
        -> y: [B, C, H, P] (without the D skip) and the state after the chunk."""
        cum = torch.cumsum(log_a, dim=1)  # [B, C, H]: Λ_i
        C_len = xh.shape[1]
        causal = torch.ones(C_len, C_len, dtype=torch.bool, device=xh.device).tril()
        diff = rearrange(cum, "b i h -> b h i 1") - rearrange(cum, "b j h -> b h 1 j")  # [B, H, C, C]
        L = torch.where(causal, torch.exp(diff.masked_fill(~causal, 0.0)), 0.0)  # [B, H, C, C]
        scores = torch.einsum("bin,bjn->bij", Cm, Bm)[:, None] * L  # [B, H, C, C]
        y = torch.einsum("bhij,bjh,bjhp->bihp", scores, dt, xh)  # [B, C, H, P]
        y = y + torch.einsum("bih,bhpn,bin->bihp", torch.exp(cum), h, Cm)
        to_end = torch.exp(cum[:, -1:] - cum)  # [B, C, H]: decay from token j to the chunk's end
        h_new = torch.exp(cum[:, -1])[:, :, None, None] * h + torch.einsum("bjh,bjh,bjhp,bjn->bhpn", to_end, dt, xh, Bm)
        return y, h_new

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]: h = exp(Δa) h + Δ x Bᵀ, y = h C + D x, in place."""
        check_step_input(x_t, self.d_model, self.name)
        z, xh, Bm, Cm, dt, new_history = self._prepare(x_t[:, None], state["conv"])
        state["conv"].copy_(new_history)
        h = state["ssm"]
        dtype = torch.promote_types(x_t.dtype, h.dtype)
        with torch.autocast(device_type=x_t.device.type, enabled=False):
            xh, Bm, Cm, dt = (t[:, 0].to(dtype) for t in (xh, Bm, Cm, dt))  # [B, H, P], [B, N], [B, N], [B, H]
            decay = torch.exp(dt * -torch.exp(self.A_log.to(dtype)))  # [B, H]
            h_new = decay[:, :, None, None] * h.to(dtype) + torch.einsum("bh,bhp,bn->bhpn", dt, xh, Bm)
            h.copy_(h_new)
            y = torch.einsum("bhpn,bn->bhp", h_new, Cm) + self.D.to(dtype)[:, None] * xh  # [B, H, P]
        return self._finish(y[:, None], z)[:, 0]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed conv inputs [B, k-1, d_inner + 2N] (module dtype) and SSM state [B, H, P, N] (fp32+)."""
        device, dtype = module_device_dtype(self, device, dtype)
        c = self.config
        return {
            "conv": torch.zeros(batch_size, c.conv_size - 1, self.conv_dim, device=device, dtype=dtype),
            "ssm": torch.zeros(
                batch_size, self.num_heads, c.head_dim, c.d_state, device=device, dtype=compute_dtype(dtype)
            ),
        }

    def state_size(self, seq_len: int) -> int:
        """d_inner·N + (d_inner + 2N)·(conv_size-1), constant in seq_len."""
        return self.d_inner * self.config.d_state + self.conv_dim * (self.config.conv_size - 1)
