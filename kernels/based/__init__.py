"""Based linear attention (Arora et al., 2024): the Taylor feature map, PyTorch references and GPU kernels.

`chunk_based` (prefill and training) and `fused_recurrent_based` (one decoding step) are the ops; `naive.py` is
their specification. Importing this package imports Triton (the kernels are defined at import) but launches nothing.
kernels/based/README.md has the math, the kernels kept and the rule that picks them.
"""

from kernels.based.naive import (
    feature_dim,
    naive_chunk_based,
    naive_parallel_based,
    naive_recurrent_based,
    orders_to_state,
    state_to_orders,
    taylor_feature_map,
)
from kernels.based.ops import BasedConfig, choose_path, chunk_based, fused_recurrent_based

__all__ = [
    "BasedConfig",
    "choose_path",
    "chunk_based",
    "feature_dim",
    "fused_recurrent_based",
    "naive_chunk_based",
    "naive_parallel_based",
    "naive_recurrent_based",
    "orders_to_state",
    "state_to_orders",
    "taylor_feature_map",
]
