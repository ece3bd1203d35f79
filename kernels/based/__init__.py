"""Based linear attention (Arora et al., 2024): `chunk_based` (prefill, training) and `fused_recurrent_based`
(one decoding step), with `naive.py` their specification. Importing defines the Triton kernels, launching nothing.
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
