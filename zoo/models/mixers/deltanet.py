"""DeltaNet (Schlag et al., 2021, "Linear Transformers Are Secretly Fast Weight Programmers"; parallelised
by Yang et al., 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length").

Per head, q and k are SiLU-activated and L2-normalised, β_t = sigmoid(Linear(x)) ∈ (0, 1):

    S_t = S_{t-1} + β_t k_tᵀ (v_t - k_t S_{t-1})      S: [d_k, d_v]; the delta rule overwrites k's old value
    o_t = scale · q_t S_t;   out = Linear(H·d_v → d)(o)

What is unusual here: `impl="naive"` is the token loop above (the specification); `impl="fla"` calls
`fla.ops.delta_rule.chunk_delta_rule` (forward) and `fused_recurrent_delta_rule` (step), with q, k already
normalised (use_qk_l2norm_in_kernel=False). State {"S": [B, H, d_k, d_v]} in fp32; state_size = H·d_k·d_v.
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
class DeltaNetConfig:
    """Options of `deltanet` (d_model comes from the model)."""

    num_heads: int | None = None  # None: default_num_heads(d_model); d_k = d_v = d_model // num_heads
    impl: str = "naive"  # naive | fla

    def validate(self, d_model: int) -> None:
        heads = self.heads(d_model)
        check_int("deltanet: num_heads", heads, minimum=1)
        if d_model % heads:
            raise ValueError(f"deltanet: d_model={d_model} must be divisible by num_heads={heads}")
        check_choice("deltanet: impl", self.impl, IMPLS)

    def heads(self, d_model: int) -> int:
        return self.num_heads if self.num_heads is not None else default_num_heads(d_model)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


class DeltaNet(MatrixStateMixer):
    """Delta-rule linear attention: [B, T, d_model] -> [B, T, d_model]. State: {"S": [B, H, d_k, d_v]} (fp32)."""

    Config = DeltaNetConfig
    name = "deltanet"
    FLA_MODULE = "delta_rule"
    FLA_NAMES = ("chunk_delta_rule", "fused_recurrent_delta_rule")

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = c = make_config(self.name, self.Config, d_model, options)
        self.d_model, self.impl = d_model, c.impl
        self.num_heads = H = c.heads(d_model)
        self.head_dim_k = self.head_dim_v = d_model // H
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.beta_proj = nn.Linear(d_model, H)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.scale = self.head_dim_k**-0.5
        self._check_impl()

    def _inputs(self, x, state):
        q, k, v = (self._split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))  # [B, T, H, D] each
        q, k = l2_normalize(F.silu(q)), l2_normalize(F.silu(k))
        return {"q": q, "k": k, "v": v, "beta": torch.sigmoid(self.beta_proj(x))}, None  # beta: [B, T, H]

    def _naive_token(self, S, inp):
        k, beta = inp["k"], inp["beta"]
        old = torch.einsum("bhk,bhkv->bhv", k, S)  # [B, H, d_v]: what S returns for k now
        S = S + beta[..., None, None] * k[..., None] * (inp["v"] - old)[..., None, :]
        return self.scale * torch.einsum("bhk,bhkv->bhv", inp["q"], S), S

    def _fla(self, inp, S, recurrent):
        chunk, fused_recurrent = fla_ops(self.name, self.FLA_MODULE, self.FLA_NAMES)
        op = fused_recurrent if recurrent else chunk
        return op(
            q=inp["q"],
            k=inp["k"],
            v=inp["v"],
            beta=inp["beta"],
            scale=self.scale,
            initial_state=S,
            output_final_state=S is not None,
            use_qk_l2norm_in_kernel=False,
        )

    def _output(self, o, aux):
        return self.out(rearrange(o, "b t h d -> b t (h d)"))  # [B, T, d_model]
