"""H3 (Fu et al., 2023, "Hungry Hungry Hippos: Towards Language Modeling with State Space Models").

    q, k, v = split(Linear(d → 3d)(x))
    k' = shift(k)                         a learned causal FIR of length `shift_size` per channel (shift SSM)
    y = Linear(d → d)(q ⊙ SSM_diag(k' ⊙ v))

SSM_diag runs `d_state` real diagonal modes per channel (S4D-real style):

    s_t = a ⊙ s_{t-1} + b · u_t,   out_t = Σ_n c_n s_{t,n} + D · u_t,   a = exp(-Δ·A) ∈ (0, 1)

with A_n = n + 1 and Δ per channel. Heads have width 1 (the form Zoology sweeps), so q ⊙ and k' ⊙ v are
elementwise.

What is unusual here:
- The parallel form builds the SSM's kernel K[l, c] = Σ_n c_n b_n a_n^l and convolves through an FFT; a
  carried state enters as Σ_n c_n a_n^{t+1} s_0 and the final state is a^T s_0 + Σ_s a^{T-1-s} b u_s.
- State: {"shift": [B, shift_size-1, d], "ssm": [B, d, d_state]}, the SSM part in fp32 (fp64 for fp64
  models). state_size = d·d_state (REFERENCE's "H3: d·d_state") + d·(shift_size-1) for the shift register.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from zoo.models.mixers._common import (
    check_input,
    check_int,
    check_step_input,
    compute_dtype,
    make_config,
    module_device_dtype,
)
from zoo.models.mixers._long_conv import depthwise_causal_conv, fft_causal_conv


@dataclass
class H3Config:
    """Options of `h3` (d_model comes from the model)."""

    d_state: int = 64  # diagonal SSM modes per channel (Zoology Fig. 2 uses d_state = L)
    shift_size: int = 4  # length of the shift filter on k
    dt_min: float = 1e-3
    dt_max: float = 1e-1

    def validate(self, d_model: int) -> None:
        check_int("h3: d_state", self.d_state, minimum=1)
        check_int("h3: shift_size", self.shift_size, minimum=1)
        for name in ("dt_min", "dt_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"h3: {name} must be a number > 0, got {value!r}")
        if self.dt_min > self.dt_max:
            raise ValueError(f"h3: dt_min={self.dt_min} exceeds dt_max={self.dt_max}")


class H3(nn.Module):
    """H3 with width-1 heads: [B, T, d_model] -> [B, T, d_model].

    State: {"shift": [B, shift_size-1, d] past k, "ssm": [B, d, d_state] diagonal SSM state (fp32)}.
    """

    Config = H3Config
    name = "h3"

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        d, N, k = d_model, self.config.d_state, self.config.shift_size
        self.qkv = nn.Linear(d, 3 * d)
        self.shift_weight = nn.Parameter(torch.randn(d, k) / math.sqrt(k))
        lo, hi = math.log(self.config.dt_min), math.log(self.config.dt_max)
        self.log_dt = nn.Parameter(torch.rand(d) * (hi - lo) + lo)  # [d]
        self.log_A = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(d, 1))  # [d, N]
        self.B = nn.Parameter(torch.ones(d, N))
        self.C = nn.Parameter(torch.randn(d, N) / math.sqrt(N))
        self.D = nn.Parameter(torch.randn(d))
        self.out = nn.Linear(d, d)

    def _log_a(self, dtype: torch.dtype) -> torch.Tensor:
        """log a = -Δ·A: [d, N], in `dtype`."""
        return -(torch.exp(self.log_dt.to(dtype))[:, None] * torch.exp(self.log_A.to(dtype)))

    def _inputs(self, x: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, d] -> q, u = shift(k) ⊙ v: [B, T, d], and the new shift history [B, k-1, d]."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [B, T, d] each
        k_shift = depthwise_causal_conv(k, self.shift_weight, history)  # [B, T, d]
        new_history = torch.cat([history.to(k.dtype), k], dim=1)[:, k.shape[1] :]  # [B, k-1, d]
        return q, k_shift * v, new_history

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: continues the shift and the SSM from it."""
        check_input(x, self.d_model, self.name)
        B, T, d = x.shape
        history = x.new_zeros(B, self.config.shift_size - 1, d) if state is None else state["shift"]
        q, u, new_history = self._inputs(x, history)
        dtype = compute_dtype(x.dtype) if state is None else torch.promote_types(x.dtype, state["ssm"].dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            log_a = self._log_a(dtype)  # [d, N]
            lags = torch.arange(T, device=x.device, dtype=dtype)  # [T]
            powers = torch.exp(lags[:, None, None] * log_a[None])  # [T, d, N]: a^l
            cb = (self.C * self.B).to(dtype)  # [d, N]
            kernel = torch.einsum("ldn,dn->ld", powers, cb)  # [T, d]
            u32 = u.to(dtype)
            y = fft_causal_conv(u32, kernel) + self.D.to(dtype) * u32  # [B, T, d]
            if state is not None:
                s0 = state["ssm"].to(dtype)  # [B, d, N]
                carried = powers * torch.exp(log_a)[None]  # [T, d, N]: a^{t+1}
                y = y + torch.einsum("tdn,bdn,dn->btd", carried, s0, self.C.to(dtype))
                # s_T = a^T s_0 + Σ_s a^{T-1-s} b u_s; powers.flip(0)[s] = a^{T-1-s}.
                s_T = powers[-1] * torch.exp(log_a) * s0 + torch.einsum(
                    "tdn,btd,dn->bdn", powers.flip(0), u32, self.B.to(dtype)
                )
                state["ssm"].copy_(s_T)
                state["shift"].copy_(new_history)
        return self.out(q * y.to(x.dtype))  # [B, T, d_model]

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]: s = a ⊙ s + b·u, out = c·s + D·u, in place."""
        check_step_input(x_t, self.d_model, self.name)
        q, u, new_history = self._inputs(x_t[:, None], state["shift"])
        state["shift"].copy_(new_history)
        s = state["ssm"]
        dtype = torch.promote_types(x_t.dtype, s.dtype)
        with torch.autocast(device_type=x_t.device.type, enabled=False):
            u32 = u[:, 0].to(dtype)  # [B, d]
            s_new = torch.exp(self._log_a(dtype))[None] * s.to(dtype) + self.B.to(dtype) * u32[..., None]
            s.copy_(s_new)
            y = torch.einsum("bdn,dn->bd", s_new, self.C.to(dtype)) + self.D.to(dtype) * u32  # [B, d]
        return self.out(q[:, 0] * y.to(x_t.dtype))  # [B, d_model]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed shift history [B, shift_size-1, d] (module dtype) and SSM state [B, d, d_state] (fp32+)."""
        device, dtype = module_device_dtype(self, device, dtype)
        d = self.d_model
        return {
            "shift": torch.zeros(batch_size, self.config.shift_size - 1, d, device=device, dtype=dtype),
            "ssm": torch.zeros(batch_size, d, self.config.d_state, device=device, dtype=compute_dtype(dtype)),
        }

    def state_size(self, seq_len: int) -> int:
        """d·d_state + d·(shift_size-1), constant in seq_len."""
        return self.d_model * (self.config.d_state + self.config.shift_size - 1)
