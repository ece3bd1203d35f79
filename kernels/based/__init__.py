"""Based linear attention (Arora et al., 2024): Taylor feature map, references and Triton kernels.

Importing this package imports Triton (the kernels are defined at import) but launches nothing.
"""

from kernels.based.chunk import chunk_based
from kernels.based.decode import fused_recurrent_based
from kernels.based.naive import (
    feature_dim,
    naive_chunk_based,
    naive_parallel_based,
    naive_recurrent_based,
    orders_to_state,
    state_to_orders,
    taylor_feature_map,
)

__all__ = [
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
