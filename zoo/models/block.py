"""A pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)) unless mlp is "none"."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MLPS = ("none", "swiglu", "gelu", "tanh", "identity")
NORMS = ("layernorm", "rmsnorm")


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with the affine part as plain ops: normalize, then ·weight + bias.

    Same parameters, state dict and values; only the backward differs: PyTorch's fused kernel reduces the
    weight and bias gradients over the rows with a kernel that is slow for narrow rows on the GPU (e.g. d = 128
    over a Fig. 2 batch's B·L = 65k rows; experiments/LOG.md has the profile); as a multiply-add they are ordinary
    sum reductions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        return (y * self.weight + self.bias).to(y.dtype) if self.elementwise_affine else y


def make_norm(kind: str, d_model: int, rms_eps: float | None = None) -> nn.Module:
    """LayerNorm (eps 1e-5) or RMSNorm over the last dim; `rms_eps`: the RMSNorm's eps (None: torch's default,
    the dtype's machine epsilon)."""
    if kind == "layernorm":
        return LayerNorm(d_model)
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model, eps=rms_eps)
    raise ValueError(f"norm must be one of {'|'.join(NORMS)}, got {kind!r}")


class SwiGLU(nn.Module):
    """down(SiLU(gate(x)) ⊙ up(x)) (Shazeer, 2020): [..., d] -> [..., d], hidden 2·d by default."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    """down(GELU(up(x))): [..., d] -> [..., d], hidden 4·d by default."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TanhMLP(nn.Module):
    """fc2(tanh(fc1(x))) with biases: [..., d] -> [..., d], hidden 4·d by default. Zoology's TransformerBlock
    hard-wired this state mixer until November 2023, so the runs behind its published Fig. 2 for attention,
    Hyena and RWKV have it (experiments/zoology_fig2/README.md); `model.init=zoology` rescales `fc2` as Zoology
    does."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Block(nn.Module):
    """norm -> mixer -> residual -> norm -> mlp -> residual, on [B, T, d_model].

    mixer: a module of the mixer protocol; mlp: none | swiglu | gelu | tanh | identity; mlp_hidden: 0 picks 2·d
    (swiglu) or 4·d (gelu, tanh); norm: layernorm | rmsnorm (`rms_eps` its eps, None: torch's default).
    forward/step/init_state/state_size pass the mixer's state through.

    `identity` is Zoology's block with `state_mixer=Identity` (its Fig. 2 models): the MLP is the identity but
    its norm and residual remain, so the block ends with x + norm(x).
    """

    def __init__(self, d_model: int, mixer: nn.Module, mlp: str = "none", mlp_hidden: int = 0, norm: str = "layernorm",
                 rms_eps: float | None = None):
        super().__init__()
        if mlp not in MLPS:
            raise ValueError(f"mlp must be one of {'|'.join(MLPS)}, got {mlp!r}")
        if mlp_hidden < 0:
            raise ValueError(f"mlp_hidden must be >= 0, got {mlp_hidden}")
        self.mixer_norm = make_norm(norm, d_model, rms_eps)
        self.mixer = mixer
        self.mlp_norm = make_norm(norm, d_model, rms_eps) if mlp != "none" else None
        if mlp == "swiglu":
            self.mlp = SwiGLU(d_model, mlp_hidden or 2 * d_model)
        elif mlp == "gelu":
            self.mlp = GeluMLP(d_model, mlp_hidden or 4 * d_model)
        elif mlp == "tanh":
            self.mlp = TanhMLP(d_model, mlp_hidden or 4 * d_model)
        elif mlp == "identity":
            self.mlp = nn.Identity()
        else:
            self.mlp = None

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor, state: Any = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]; a state is continued and updated in place by the mixer."""
        return self._mlp(x + self.mixer(self.mixer_norm(x), state))

    def step(self, x_t: torch.Tensor, state: Any) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]."""
        return self._mlp(x_t + self.mixer.step(self.mixer_norm(x_t), state))

    def init_state(self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        return self.mixer.init_state(batch_size, device=device, dtype=dtype)

    def state_size(self, seq_len: int) -> int:
        return self.mixer.state_size(seq_len)
