"""Based linear attention (Arora et al., 2024): Taylor feature map, references and Triton kernels."""

from kernels.based.naive import feature_dim, taylor_feature_map

__all__ = ["feature_dim", "taylor_feature_map"]
