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
from torch import nn

from zoo.models.mixers._matrix_state import ChunkedHeadsConfig
from zoo.models.mixers.deltanet import DeltaNet


@dataclass
class GatedDeltaNetConfig(ChunkedHeadsConfig):
    """Options of `gated_deltanet` (d_model comes from the model)."""

    mixer: ClassVar[str] = "gated_deltanet"


class GatedDeltaNet(DeltaNet):
    """Gated delta rule: [B, T, d_model] -> [B, T, d_model]. State: {"S": [B, H, d_k, d_v]} (fp32).
    DeltaNet with a per-head decay before each update and a SiLU gate on the output."""

    Config = GatedDeltaNetConfig
    name = "gated_deltanet"
    FLA_MODULE = "gated_delta_rule"
    FLA_NAMES = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")

    def _gate_parameters(self, d_model: int, num_heads: int) -> None:
        H = num_heads
        self.a_proj = nn.Linear(d_model, H, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.g_proj = nn.Linear(d_model, d_model, bias=False)

    def _gates(self, x):
        g = -torch.exp(self.A_log) * F.softplus(self.a_proj(x) + self.dt_bias)  # [B, T, H], log α
        return g, F.silu(self.g_proj(x))
