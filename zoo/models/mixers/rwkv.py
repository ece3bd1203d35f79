"""RWKV-6 time mixing (Peng et al., 2024, "Eagle and Finch: RWKV with Matrix-Valued States and Dynamic
Recurrence").

Token shift: each projection sees x_t + μ ⊙ (x_{t-1} - x_t) with its own learned μ. Per head, with a
data-dependent decay w_t = exp(-exp(w_base + low-rank(x))) ∈ (0, 1)^{d_k} and a bonus u for the current token:

    o_t = scale · r_t (S_{t-1} + diag(u) k_tᵀ v_t)
    S_t = diag(w_t) S_{t-1} + k_tᵀ v_t                      S: [d_k, d_v]
    out = Linear(H·d_v → d)(o ⊙ SiLU(g_t))

What is unusual here:
- μ is static per projection (RWKV-6's data-dependent token-shift LoRA is left out); the decay keeps its
  data-dependent low-rank term, the defining change from RWKV-5.
- `impl="naive"` is the token loop above (the specification); `impl="fla"` calls
  `fla.ops.rwkv6.chunk_rwkv6` (forward) and `fused_recurrent_rwkv6` (step), with log w passed as `w`.
- State: {"S": [B, H, d_k, d_v] (fp32), "shift": [B, d] the last input}; state_size = H·d_k·d_v + d.
  (Zoology's RWKV-7 count was 4–16× too large; this one is checked against the real tensors.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from zoo.models.mixers._common import check_choice, check_int, default_num_heads, make_config
from zoo.models.mixers._matrix_state import IMPLS, MatrixStateMixer, fla_ops


@dataclass
class RWKVConfig:
    """Options of `rwkv` (d_model comes from the model)."""

    num_heads: int | None = None  # None: default_num_heads(d_model); d_k = d_v = d_model // num_heads
    decay_rank: int = 16
    impl: str = "naive"  # naive | fla

    def validate(self, d_model: int) -> None:
        heads = self.heads(d_model)
        check_int("rwkv: num_heads", heads, minimum=1)
        if d_model % heads:
            raise ValueError(f"rwkv: d_model={d_model} must be divisible by num_heads={heads}")
        check_int("rwkv: decay_rank", self.decay_rank, minimum=1)
        check_choice("rwkv: impl", self.impl, IMPLS)

    def heads(self, d_model: int) -> int:
        return self.num_heads if self.num_heads is not None else default_num_heads(d_model)


class RWKV(MatrixStateMixer):
    """RWKV-6 time mixing: [B, T, d_model] -> [B, T, d_model].

    State: {"S": [B, H, d_k, d_v] (fp32), "shift": [B, d_model] the previous token's input}.
    """

    Config = RWKVConfig
    name = "rwkv"
    FLA_MODULE = "rwkv6"
    FLA_NAMES = ("chunk_rwkv6", "fused_recurrent_rwkv6")

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = c = make_config(self.name, self.Config, d_model, options)
        self.d_model, self.impl = d_model, c.impl
        self.num_heads = H = c.heads(d_model)
        self.head_dim_k = self.head_dim_v = D = d_model // H
        self.mu = nn.Parameter(torch.rand(5, d_model))  # token-shift mix of r, k, v, w, g
        self.proj = nn.Linear(d_model, 4 * d_model, bias=False)  # r, k, v, g
        self.decay_down = nn.Linear(d_model, c.decay_rank, bias=False)
        self.decay_up = nn.Linear(c.decay_rank, d_model, bias=False)
        self.w_base = nn.Parameter(torch.linspace(-6.0, -0.5, d_model))  # slow to fast decay across channels
        self.u = nn.Parameter(0.5 * torch.randn(H, D))
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.scale = D**-0.5
        self._check_impl()

    def _inputs(self, x, state):
        B, T, d = x.shape
        prev = x.new_zeros(B, 1, d) if state is None else state["shift"][:, None].to(x.dtype)
        shifted = torch.cat([prev, x[:, :-1]], dim=1)  # [B, T, d]: x_{t-1}
        if state is not None:
            state["shift"].copy_(x[:, -1])
        mixed = x[None] + self.mu[:, None, None] * (shifted - x)[None]  # [5, B, T, d]
        w_r, w_k, w_v, w_g = self.proj.weight.chunk(4, dim=0)
        r, k, v = F.linear(mixed[0], w_r), F.linear(mixed[1], w_k), F.linear(mixed[2], w_v)
        g = F.silu(F.linear(mixed[4], w_g))
        log_w = -torch.exp(self.w_base + self.decay_up(torch.tanh(self.decay_down(mixed[3]))))  # [B, T, d]
        heads = {"r": r, "k": k, "v": v, "w": log_w}
        return {key: self._split_heads(t) for key, t in heads.items()}, g

    def _naive_token(self, S, inp):
        kv = inp["k"][..., None] * inp["v"][..., None, :]  # [B, H, d_k, d_v]
        o = self.scale * torch.einsum("bhk,bhkv->bhv", inp["r"], S + self.u.to(S.dtype)[None, :, :, None] * kv)
        return o, torch.exp(inp["w"])[..., None] * S + kv

    def _fla(self, inp, S, recurrent):
        chunk, fused_recurrent = fla_ops(self.name, self.FLA_MODULE, self.FLA_NAMES)
        op = fused_recurrent if recurrent else chunk
        return op(
            r=inp["r"],
            k=inp["k"],
            v=inp["v"],
            w=inp["w"],
            u=self.u.to(inp["r"].dtype),
            scale=self.scale,
            initial_state=S,
            output_final_state=S is not None,
        )

    def _output(self, o, aux):
        return self.out(rearrange(o, "b t h d -> b t (h d)") * aux)  # [B, T, d_model]

    def _extra_state(self, batch_size, device, dtype):
        return {"shift": torch.zeros(batch_size, self.d_model, device=device, dtype=dtype)}

    def _extra_size(self) -> int:
        return self.d_model
