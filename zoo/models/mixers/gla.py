"""Gated linear attention (Yang et al., 2024, "Gated Linear Attention Transformers with Hardware-Efficient
Training").

Per head, with a data-dependent forget gate α_t ∈ (0, 1)^{d_k} on the key dimension:

    S_t = diag(α_t) S_{t-1} + k_tᵀ v_t            S: [d_k, d_v]
    o_t = scale · q_t S_t;   out = Linear(H·d_v → d)(o ⊙ SiLU(Linear(d → H·d_v)(x)))

log α_t = logsigmoid(low-rank Linear(x)) / gate_normalizer (16 in the paper, so α starts near 1).

What is unusual here: `impl="naive"` is the token loop above (the specification); `impl="fla"` calls
`fla.ops.gla.chunk_gla` (forward) and `fused_recurrent_gla` (step). State {"S": [B, H, d_k, d_v]} in fp32;
state_size = H·d_k·d_v (REFERENCE: "GLA: H·dk·dv").
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
class GLAConfig:
    """Options of `gla` (d_model comes from the model)."""

    num_heads: int | None = None  # None: default_num_heads(d_model)
    head_dim_k: int | None = None  # None: d_model // (2·num_heads) (expand_k 0.5, as in the paper)
    head_dim_v: int | None = None  # None: d_model // num_heads
    gate_rank: int = 16
    gate_normalizer: float = 16.0
    impl: str = "naive"  # naive | fla

    def validate(self, d_model: int) -> None:
        heads = self.heads(d_model)
        check_int("gla: num_heads", heads, minimum=1)
        if d_model % heads:
            raise ValueError(f"gla: d_model={d_model} must be divisible by num_heads={heads}")
        for name in ("head_dim_k", "head_dim_v"):
            if getattr(self, name) is not None:
                check_int(f"gla: {name}", getattr(self, name), minimum=1)
        if self.head_dim_k is None and d_model // heads < 2:
            raise ValueError(f"gla: default head_dim_k = d_model // (2·num_heads) is 0 for d_model={d_model}")
        check_int("gla: gate_rank", self.gate_rank, minimum=1)
        if not self.gate_normalizer > 0:
            raise ValueError(f"gla: gate_normalizer must be > 0, got {self.gate_normalizer}")
        check_choice("gla: impl", self.impl, IMPLS)

    def heads(self, d_model: int) -> int:
        return self.num_heads if self.num_heads is not None else default_num_heads(d_model)


class GLA(MatrixStateMixer):
    """Gated linear attention: [B, T, d_model] -> [B, T, d_model]. State: {"S": [B, H, d_k, d_v]} (fp32)."""

    Config = GLAConfig
    name = "gla"
    FLA_MODULE = "gla"
    FLA_NAMES = ("chunk_gla", "fused_recurrent_gla")

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = c = make_config(self.name, self.Config, d_model, options)
        self.d_model, self.impl = d_model, c.impl
        self.num_heads = H = c.heads(d_model)
        self.head_dim_k = c.head_dim_k if c.head_dim_k is not None else d_model // (2 * H)
        self.head_dim_v = c.head_dim_v if c.head_dim_v is not None else d_model // H
        dk, dv = H * self.head_dim_k, H * self.head_dim_v
        self.q_proj = nn.Linear(d_model, dk, bias=False)
        self.k_proj = nn.Linear(d_model, dk, bias=False)
        self.v_proj = nn.Linear(d_model, dv, bias=False)
        self.gate = nn.Sequential(nn.Linear(d_model, c.gate_rank, bias=False), nn.Linear(c.gate_rank, dk))
        self.g_proj = nn.Linear(d_model, dv, bias=False)
        self.out = nn.Linear(dv, d_model, bias=False)
        self.scale = self.head_dim_k**-0.5
        self._check_impl()

    def _inputs(self, x, state):
        split = self._split_heads
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))  # [B, T, H, d_k|d_v]
        log_alpha = split(F.logsigmoid(self.gate(x)) / self.config.gate_normalizer)  # [B, T, H, d_k]
        return {"q": q, "k": k, "v": v, "g": log_alpha}, F.silu(self.g_proj(x))

    def _naive_token(self, S, inp):
        S = torch.exp(inp["g"])[..., None] * S + inp["k"][..., None] * inp["v"][..., None, :]
        return self.scale * torch.einsum("bhk,bhkv->bhv", inp["q"], S), S

    def _fla(self, inp, S, recurrent):
        chunk_gla, fused_recurrent_gla = fla_ops(self.name, self.FLA_MODULE, self.FLA_NAMES)
        common = dict(q=inp["q"], k=inp["k"], v=inp["v"], scale=self.scale, initial_state=S)
        if recurrent:
            return fused_recurrent_gla(**common, gk=inp["g"], output_final_state=S is not None)
        return chunk_gla(**common, g=inp["g"], output_final_state=S is not None)

    def _output(self, o, aux):
        return self.out(rearrange(o, "b t h d -> b t (h d)") * aux)  # [B, T, d_model]
