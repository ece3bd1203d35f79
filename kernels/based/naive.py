"""PyTorch references for Based linear attention: the specification the Triton kernels are tested against.

The feature map is the second-order Taylor expansion of exp(s), written so that
φ(q)·φ(k) = 1 + s + s²/2 with s = q·k/√f. Its feature order is the one of
`fla.modules.feature_map.TaylorFeatureMap(f)`, so that a state (kv, k_sum) can move between this library and
flash-linear-attention's linear-attention ops:

    φ(x) = [1, x/f^¼, x_i²/(√2·√f) for i, x_i·x_j/√f for i<j (row-major)]     E = 1 + f + f(f+1)/2
"""

import math

import torch


def feature_dim(f: int) -> int:
    """E, the number of Taylor features for key/query dim f: 1 + f + f(f+1)/2 (153 at f=16, 45 at f=8)."""
    return 1 + f + f * (f + 1) // 2


def taylor_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) for x: [..., f] -> [..., E], computed in x's dtype (callers cast to fp32 for states)."""
    f = x.shape[-1]
    i, j = torch.triu_indices(f, f, offset=1, device=x.device)
    diag = x * x / (math.sqrt(2.0) * math.sqrt(f))  # [..., f]
    off = x[..., i] * x[..., j] / math.sqrt(f)  # [..., f(f-1)/2]
    return torch.cat([torch.ones_like(x[..., :1]), x / f**0.25, diag, off], dim=-1)
