"""What every synthetic task returns: a `Segment` of examples that share one slice (e.g. one (L, n) pair)."""

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # label of every position that is not scored


@dataclass
class Segment:
    """N examples of one slice.

    inputs: [N, L] int64 tokens. labels: [N, L] int64, the target of each position and `IGNORE_INDEX`
    wherever nothing is scored. slices: the coordinates of this segment, e.g. `{"seq_len": 256,
    "num_kv_pairs": 16}`, which evaluation uses to report accuracy per slice.
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    slices: dict[str, int]

    def __post_init__(self) -> None:
        if self.inputs.dtype != torch.int64 or self.labels.dtype != torch.int64:
            raise ValueError(f"Segment tensors must be int64, got {self.inputs.dtype} and {self.labels.dtype}")
        if self.inputs.ndim != 2 or self.inputs.shape != self.labels.shape:
            raise ValueError(
                f"Segment inputs and labels must both be [N, L], got {tuple(self.inputs.shape)} and "
                f"{tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return self.inputs.shape[0]
