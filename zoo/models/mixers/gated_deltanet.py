"""Gated DeltaNet (Yang et al., 2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule").

Per head: q, k SiLU-activated and L2-normalised, β_t = sigmoid(Linear(x)), and a scalar decay
α_t = exp(g_t), g_t = -exp(A_log) · softplus(Linear(x) + dt_bias) (Mamba-2's gate):

    S_t = α_t S_{t-1} + β_t k_tᵀ (v_t - k_t α_t S_{t-1})      S: [d_k, d_v]
    o_t = scale · q_t S_t;   out = Linear(H·d_v → d)(o ⊙ SiLU(Linear(d → d)(x)))

What is unusual here: `impl="naive"` is the token loop above (the specification); `impl="fla"` calls
`fla.ops.gated_delta_rule.chunk_gated_delta_rule` (forward) and `fused_recurrent_gated_delta_rule` (step);
`impl="chunk"` is `deltanet.chunk_delta_rule` with the decays, in PyTorch. FLA 0.6 refuses the gated chunk
backward on Hopper GPUs with Triton < 3.7.1 (wrong results, its issue #640); impl="chunk" trains there.
State {"S": [B, H, d_k, d_v]} in fp32; state_size = H·d_k·d_v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from zoo.models.mixers._common import make_config
from zoo.models.mixers._matrix_state import ChunkedHeadsConfig, MatrixStateMixer, fla_ops
from zoo.models.mixers.deltanet import chunk_delta_rule, l2_normalize


@dataclass
class GatedDeltaNetConfig(ChunkedHeadsConfig):
    """Options of `gated_deltanet` (d_model comes from the model)."""

    mixer: ClassVar[str] = "gated_deltanet"


class GatedDeltaNet(MatrixStateMixer):
    """Gated delta rule: [B, T, d_model] -> [B, T, d_model]. State: {"S": [B, H, d_k, d_v]} (fp32)."""

    Config = GatedDeltaNetConfig
    name = "gated_deltanet"
    FLA_MODULE = "gated_delta_rule"
    FLA_NAMES = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = c = make_config(self.name, self.Config, d_model, options)
        self.d_model, self.impl = d_model, c.impl
        self.num_heads = H = c.heads(d_model)
        self.head_dim_k = self.head_dim_v = d_model // H
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.beta_proj = nn.Linear(d_model, H)
        self.a_proj = nn.Linear(d_model, H, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.g_proj = nn.Linear(d_model, d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.scale = self.head_dim_k**-0.5
        self._check_impl()

    def _inputs(self, x, state):
        q, k, v = (self._split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))  # [B, T, H, D] each
        q, k = l2_normalize(F.silu(q)), l2_normalize(F.silu(k))
        g = -torch.exp(self.A_log) * F.softplus(self.a_proj(x) + self.dt_bias)  # [B, T, H], log α
        beta = torch.sigmoid(self.beta_proj(x))  # [B, T, H]
        return {"q": q, "k": k, "v": v, "g": g, "beta": beta}, F.silu(self.g_proj(x))

    def _naive_token(self, S, inp):
        k, beta = inp["k"], inp["beta"]
        S = torch.exp(inp["g"])[..., None, None] * S
        old = torch.einsum("bhk,bhkv->bhv", k, S)  # [B, H, d_v]
        S = S + beta[..., None, None] * k[..., None] * (inp["v"] - old)[..., None, :]
        return self.scale * torch.einsum("bhk,bhkv->bhv", inp["q"], S), S

    def _chunk(self, inp, S):
        beta, chunk = inp["beta"], self.config.chunk_size
        return chunk_delta_rule(inp["q"], inp["k"], inp["v"], beta, inp["g"], self.scale, S, chunk)

    def _fla(self, inp, S, recurrent):
        chunk, fused_recurrent = fla_ops(self.name, self.FLA_MODULE, self.FLA_NAMES)
        op = fused_recurrent if recurrent else chunk
        return op(
            q=inp["q"],
            k=inp["k"],
            v=inp["v"],
            g=inp["g"],
            beta=inp["beta"],
            scale=self.scale,
            initial_state=S,
            output_final_state=S is not None,
            use_qk_l2norm_in_kernel=False,
        )

    def _output(self, o, aux):
        return self.out(rearrange(o, "b t h d -> b t (h d)") * aux)  # [B, T, d_model]
