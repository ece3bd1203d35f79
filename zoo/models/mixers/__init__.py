"""Sequence mixers, one per file, and `MIXERS`, the only registry of them.

Every mixer follows the protocol of docs/DESIGN.md: `__init__(d_model, **options)` with the options of its
`Config` dataclass, `forward(x, state=None)`, `step(x_t, state)`, `init_state(batch_size, device, dtype)` and
`state_size(seq_len)`, on [B, T, d_model] inputs.
"""

from __future__ import annotations

from typing import Any

import torch

from zoo.models.mixers._common import make_config
from zoo.models.mixers.attention import Attention
from zoo.models.mixers.base_conv import BaseConv
from zoo.models.mixers.based import Based
from zoo.models.mixers.deltanet import DeltaNet
from zoo.models.mixers.gated_deltanet import GatedDeltaNet
from zoo.models.mixers.gla import GLA
from zoo.models.mixers.h3 import H3
from zoo.models.mixers.hyena import Hyena
from zoo.models.mixers.linear_attention import LinearAttention
from zoo.models.mixers.long_conv import LongConv
from zoo.models.mixers.mamba import Mamba
from zoo.models.mixers.mamba2 import Mamba2
from zoo.models.mixers.rwkv import RWKV
from zoo.models.mixers.rwkv4 import RWKV4
from zoo.models.mixers.short_conv import ShortConv
from zoo.models.mixers.sliding_window import SlidingWindowAttention

MIXERS: dict[str, type] = {
    "attention": Attention,
    "sliding_window": SlidingWindowAttention,
    "based": Based,
    "base_conv": BaseConv,
    "hyena": Hyena,
    "h3": H3,
    "mamba": Mamba,
    "mamba2": Mamba2,
    "linear_attention": LinearAttention,
    "gla": GLA,
    "deltanet": DeltaNet,
    "gated_deltanet": GatedDeltaNet,
    "rwkv": RWKV,
    "short_conv": ShortConv,
    "long_conv": LongConv,
    "rwkv4": RWKV4,
}


def check_mixer_options(name: str, d_model: int, options: dict[str, Any]) -> None:
    """Raise ValueError for an unknown mixer name, an unknown option or an impossible value; builds no tensors."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r} (known: {', '.join(MIXERS)})")
    make_config(name, MIXERS[name].Config, d_model, dict(options))


def step_state_nbytes(mixer: torch.nn.Module, seq_len: int) -> tuple[int, int]:
    """(read, written): bytes of one sequence's recurrent state that one decode step moves at least, once the state
    holds seq_len tokens, for the state `mixer.init_state` allocates (its dtypes: Based's fp32 or bf16 kv).

    A state tensor is read whole and written whole (Based's kv and k_sum, the BaseConv tail, every other mixer's
    recurrent state), except the tensors a mixer names in its `slot_state`: position-indexed buffers
    [B, slots, ...] (the sliding window's ring, attention's KV cache, the long convolutions' input history), of
    which a step reads the slots that hold tokens, min(seq_len, slots), and writes one. Integer tensors
    (positions) are bookkeeping and count nothing. Weights are read once a step for the whole batch, not per
    sequence, so they are not here.
    """
    state = mixer.init_state(1, device="meta")
    read = written = 0
    for key, t in (state or {}).items():
        if not t.is_floating_point():
            continue
        nbytes = t.numel() * t.element_size()
        if key in getattr(mixer, "slot_state", ()):
            slots = t.shape[1]
            read += nbytes * min(seq_len, slots) // slots
            written += nbytes // slots
        else:
            read += nbytes
            written += nbytes
    return read, written


__all__ = [
    "GLA",
    "H3",
    "MIXERS",
    "RWKV",
    "RWKV4",
    "Attention",
    "BaseConv",
    "Based",
    "DeltaNet",
    "GatedDeltaNet",
    "Hyena",
    "LinearAttention",
    "LongConv",
    "Mamba",
    "Mamba2",
    "ShortConv",
    "SlidingWindowAttention",
    "check_mixer_options",
    "step_state_nbytes",
]
