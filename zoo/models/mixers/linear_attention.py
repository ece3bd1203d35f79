"""Linear attention with a choice of feature map (Katharopoulos et al., 2020, "Transformers are RNNs").

    y_i = φ(q_i)ᵀ Σ_{j≤i} φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_{j≤i} φ(k_j) + eps)          per head, q, k ∈ R^f

`feature_map` picks φ, with E output features per head:

m = num_features (performer's fixed random projection W is drawn from `seed`).

| feature_map | φ(x) | E |
|---|---|---|
| `performer` | FAVOR+ positive random features (Choromanski et al., 2021): exp(Wx - |x|²/2)/√m, x/f^¼ | m |
| `cosformer` | [relu(x)·cos(π t / 2M), relu(x)·sin(π t / 2M)] at position t, M = max_seq_len (Qin et al., 2022) | 2f |
| `pos_elu` | elu(x) + 1 (Katharopoulos et al., 2020) | f |
| `relu` | relu(x) | f |
| `hedgehog` | [softmax(xW), softmax(-xW)] with a learned W per head (Zhang et al., 2024) | 2m |
| `taylor` | [1, x/f^¼, x⊗x/(√2·√f)] (symmetric half), Based's 2nd-order Taylor map ("all-poly") | 1+f+f(f+1)/2 |

What is unusual here:
- The state counts features, not the input width: {"kv": [B, H, E, d_v], "k_sum": [B, H, E]} (fp32), so
  state_size = H·(E·d_v + E). (Zoology's Performer used the input dim instead of the feature count.)
- `cosformer` reweights by absolute position, so its state also holds "pos" ([] int64, not counted).
- `naive` is the only path: chunks of `chunk_size` use the quadratic form in feature space, the past enters
  through φ(q)·kv.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from kernels.based.naive import feature_dim as taylor_dim
from kernels.based.naive import taylor_feature_map
from zoo.models.mixers._common import (
    check_choice,
    check_input,
    check_int,
    check_step_input,
    compute_dtype,
    make_config,
    module_device_dtype,
)

FEATURE_MAPS = ("performer", "cosformer", "pos_elu", "relu", "hedgehog", "taylor")


@dataclass
class LinearAttentionConfig:
    """Options of `linear_attention` (d_model comes from the model)."""

    feature_map: str = "taylor"  # performer | cosformer | pos_elu | relu | hedgehog | taylor
    feature_dim: int = 16  # f: width of q and k per head
    num_features: int = 32  # m: random features (performer), learned features per sign (hedgehog)
    num_heads: int = 1
    head_dim_v: int | None = None  # None: d_model // num_heads
    max_seq_len: int = 2048  # M of cosformer's position reweighting
    eps: float = 1e-6
    chunk_size: int = 64
    seed: int = 0  # draws performer's fixed random projection

    def validate(self, d_model: int) -> None:
        check_choice("linear_attention: feature_map", self.feature_map, FEATURE_MAPS)
        for name in ("feature_dim", "num_features", "num_heads", "max_seq_len", "chunk_size"):
            check_int(f"linear_attention: {name}", getattr(self, name), minimum=1)
        check_int("linear_attention: seed", self.seed, minimum=0)
        if self.head_dim_v is None:
            if d_model % self.num_heads:
                raise ValueError(f"linear_attention: d_model={d_model} must be divisible by num_heads={self.num_heads}")
        else:
            check_int("linear_attention: head_dim_v", self.head_dim_v, minimum=1)
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps >= 0:
            raise ValueError(f"linear_attention: eps must be a float >= 0, got {self.eps!r}")

    def expanded_dim(self) -> int:
        """E, the features per head after φ."""
        f, m = self.feature_dim, self.num_features
        return {"performer": m, "cosformer": 2 * f, "pos_elu": f, "relu": f, "hedgehog": 2 * m}.get(
            self.feature_map, taylor_dim(f)
        )


class LinearAttention(nn.Module):
    """Normalised linear attention: [B, T, d_model] -> [B, T, d_model].

    State: {"kv": [B, H, E, d_v], "k_sum": [B, H, E]} in fp32 (+ "pos": [] int64 for cosformer).
    """

    Config = LinearAttentionConfig
    name = "linear_attention"

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        c = self.config
        self.d_model = d_model
        self.num_heads, self.feature_dim = c.num_heads, c.feature_dim
        self.head_dim_v = c.head_dim_v if c.head_dim_v is not None else d_model // c.num_heads
        self.expanded_dim = c.expanded_dim()
        H, f, dv, m = self.num_heads, self.feature_dim, self.head_dim_v, c.num_features
        self.q_proj = nn.Linear(d_model, H * f, bias=False)
        self.k_proj = nn.Linear(d_model, H * f, bias=False)
        self.v_proj = nn.Linear(d_model, H * dv, bias=False)
        self.out = nn.Linear(H * dv, d_model, bias=False)
        if c.feature_map == "performer":
            g = torch.Generator().manual_seed(c.seed)
            self.register_buffer("projection", torch.randn(H, f, m, generator=g))  # [H, f, m], fixed
        if c.feature_map == "hedgehog":
            self.hedgehog = nn.Parameter(torch.eye(f, m).repeat(H, 1, 1) + 0.01 * torch.randn(H, f, m))

    def feature(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """φ: x [B, T, H, f] (positions [T] for cosformer) -> [B, T, H, E]."""
        kind, f = self.config.feature_map, self.feature_dim
        if kind == "taylor":
            return taylor_feature_map(x)
        if kind == "pos_elu":
            return F.elu(x) + 1
        if kind == "relu":
            return F.relu(x)
        if kind == "cosformer":
            angle = (math.pi / (2 * self.config.max_seq_len)) * positions.to(x.dtype)[None, :, None, None]  # [1,T,1,1]
            return torch.cat([F.relu(x) * torch.cos(angle), F.relu(x) * torch.sin(angle)], dim=-1)
        if kind == "performer":
            x = x * f**-0.25
            proj = torch.einsum("bthf,hfm->bthm", x, self.projection.to(x.dtype))  # [B, T, H, m]
            return torch.exp(proj - 0.5 * x.square().sum(-1, keepdim=True)) / math.sqrt(self.config.num_features)
        proj = torch.einsum("bthf,hfm->bthm", x, self.hedgehog.to(x.dtype))  # hedgehog, [B, T, H, m]
        return torch.cat([proj.softmax(-1), (-proj).softmax(-1)], dim=-1)

    def _qkv(self, x: torch.Tensor):
        q = rearrange(self.q_proj(x), "b t (h f) -> b t h f", h=self.num_heads)  # [B, T, H, f]
        k = rearrange(self.k_proj(x), "b t (h f) -> b t h f", h=self.num_heads)  # [B, T, H, f]
        v = rearrange(self.v_proj(x), "b t (h d) -> b t h d", h=self.num_heads)  # [B, T, H, d_v]
        return q, k, v

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: continues from it and updates it in place."""
        check_input(x, self.d_model, self.name)
        T = x.shape[1]
        q, k, v = self._qkv(x)
        start = state["pos"] if state is not None and "pos" in state else 0
        positions = start + torch.arange(T, device=x.device)  # [T]
        dtype = compute_dtype(x.dtype) if state is None else torch.promote_types(x.dtype, state["kv"].dtype)
        C, eps = self.config.chunk_size, self.config.eps
        kv = k_sum = None
        with torch.autocast(device_type=x.device.type, enabled=False):
            phi_q = self.feature(q.to(dtype), positions)  # [B, T, H, E]
            phi_k = self.feature(k.to(dtype), positions)  # [B, T, H, E]
            v = v.to(dtype)
            if state is not None:
                kv, k_sum = state["kv"].to(dtype), state["k_sum"].to(dtype)
            outs = []
            for s in range(0, T, C):
                pq, pk, vc = phi_q[:, s : s + C], phi_k[:, s : s + C], v[:, s : s + C]
                a = torch.einsum("bihe,bjhe->bhij", pq, pk).tril()  # [B, H, C, C]
                num = torch.einsum("bhij,bjhd->bihd", a, vc)  # [B, C, H, d_v]
                den = rearrange(a.sum(-1), "b h i -> b i h")  # [B, C, H]
                if kv is not None:
                    num = num + torch.einsum("bihe,bhed->bihd", pq, kv)
                    den = den + torch.einsum("bihe,bhe->bih", pq, k_sum)
                outs.append(num / (den[..., None] + eps))
                kv_c = torch.einsum("bjhe,bjhd->bhed", pk, vc)  # [B, H, E, d_v]
                kv = kv_c if kv is None else kv + kv_c
                k_sum = pk.sum(1) if k_sum is None else k_sum + pk.sum(1)  # [B, H, E]
        if state is not None:
            state["kv"].copy_(kv)
            state["k_sum"].copy_(k_sum)
            if "pos" in state:
                state["pos"].add_(T)
        y = torch.cat(outs, dim=1).to(x.dtype)  # [B, T, H, d_v]
        return self.out(rearrange(y, "b t h d -> b t (h d)"))  # [B, T, d_model]

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]: kv += φ(k)vᵀ, k_sum += φ(k), y = φ(q)kv / φ(q)·k_sum, in place."""
        check_step_input(x_t, self.d_model, self.name)
        q, k, v = self._qkv(x_t[:, None])
        kv, k_sum = state["kv"], state["k_sum"]
        positions = state["pos"][None] if "pos" in state else None
        dtype = torch.promote_types(x_t.dtype, kv.dtype)
        with torch.autocast(device_type=x_t.device.type, enabled=False):
            phi_q = self.feature(q.to(dtype), positions)[:, 0]  # [B, H, E]
            phi_k = self.feature(k.to(dtype), positions)[:, 0]  # [B, H, E]
            kv.add_(torch.einsum("bhe,bhd->bhed", phi_k, v[:, 0].to(dtype)).to(kv.dtype))
            k_sum.add_(phi_k.to(k_sum.dtype))
            num = torch.einsum("bhe,bhed->bhd", phi_q, kv.to(dtype))  # [B, H, d_v]
            den = torch.einsum("bhe,bhe->bh", phi_q, k_sum.to(dtype))  # [B, H]
            y = num / (den[..., None] + self.config.eps)
        if "pos" in state:
            state["pos"].add_(1)
        return self.out(rearrange(y.to(x_t.dtype), "b h d -> b (h d)"))  # [B, d_model]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed kv [B, H, E, d_v] and k_sum [B, H, E] in fp32 (fp64 for fp64); cosformer adds pos = 0."""
        device, dtype = module_device_dtype(self, device, dtype)
        dtype = compute_dtype(dtype)
        H, E, dv = self.num_heads, self.expanded_dim, self.head_dim_v
        state = {
            "kv": torch.zeros(batch_size, H, E, dv, device=device, dtype=dtype),
            "k_sum": torch.zeros(batch_size, H, E, device=device, dtype=dtype),
        }
        if self.config.feature_map == "cosformer":
            state["pos"] = torch.zeros((), device=device, dtype=torch.int64)
        return state

    def state_size(self, seq_len: int) -> int:
        """H·(E·d_v + E), constant in seq_len."""
        return self.num_heads * (self.expanded_dim * self.head_dim_v + self.expanded_dim)
