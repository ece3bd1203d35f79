"""Circuit tasks over bit strings: parity and majority, plain and cumulative (two tasks, one file: they
share the layout and differ only in the function of the prefix).

Each position holds a bit as a token: `ZERO` = 1, `ONE` = 2 (0 stays the blank). Labels are answer tokens
(the same ZERO/ONE ids):

- plain (`cumulative=false`): only the last position is scored, with f(all L bits).
- cumulative (`cumulative=true`): every position t is scored with f(bits 0..t).

f is parity (XOR) or majority (more ones than zeros). A majority tie is unscored (label -100); plain
majority therefore needs an odd seq_len, so every example has its one query. MQAR's `num_kv_pairs` and
`power_a` mean nothing here and are ignored (not in the slices); `num_passes` must stay 1 and
`random_non_queries` false. Slices: seq_len and cumulative.
"""

from dataclasses import dataclass

import numpy as np
import torch

from zoo.synthetics._variant_base import check_ints, check_single_pass, rng_for
from zoo.synthetics.base import IGNORE_INDEX, Segment

ZERO, ONE = 1, 2


@dataclass
class ParityConfig:
    vocab_size: int = 8192
    seq_len: int = 64
    num_kv_pairs: int = 4  # unused
    num_examples: int = 1000
    power_a: float = 0.01  # unused
    random_non_queries: bool = False
    num_passes: int = 1
    cumulative: bool = False

    task = "parity"

    def slices(self) -> dict[str, int]:
        return {"seq_len": self.seq_len, "cumulative": int(self.cumulative)}

    def validate(self) -> None:
        check_ints(self.task, self, ("vocab_size", "seq_len", "num_examples", "num_passes"))
        check_single_pass(self.task, self)
        if not isinstance(self.cumulative, bool):
            raise ValueError(f"{self.task}.cumulative must be a bool, got {self.cumulative!r}")
        if self.vocab_size < 3:
            raise ValueError(f"{self.task}.vocab_size must be >= 3 (blank, ZERO, ONE), got {self.vocab_size}")


@dataclass
class MajorityConfig(ParityConfig):
    task = "majority"

    def validate(self) -> None:
        super().validate()
        if not self.cumulative and self.seq_len % 2 == 0:
            raise ValueError(f"majority: plain majority needs an odd seq_len (no ties), got {self.seq_len}")


def _bits(cfg: ParityConfig, seed: int) -> np.ndarray:
    cfg.validate()
    rng = rng_for(seed)
    return rng.integers(0, 2, size=(cfg.num_examples, cfg.seq_len), dtype=np.int64)  # [N, L]


def _segment(cfg: ParityConfig, bits: np.ndarray, answer: np.ndarray, scored: np.ndarray) -> Segment:
    """answer, scored: [N, L] (answer bit and whether it is scored, per prefix end)."""
    if not cfg.cumulative:
        scored = np.zeros_like(scored)
        scored[:, -1] = True
    labels = np.where(scored, answer + ZERO, IGNORE_INDEX)
    return Segment(torch.from_numpy(bits + ZERO), torch.from_numpy(labels.astype(np.int64)), cfg.slices())


def generate_parity(cfg: ParityConfig, seed: int) -> Segment:
    """Random bits; label(t) = XOR of bits 0..t (last position only when plain)."""
    bits = _bits(cfg, seed)
    answer = np.cumsum(bits, axis=1) % 2
    return _segment(cfg, bits, answer, np.ones_like(bits, dtype=bool))


def generate_majority(cfg: MajorityConfig, seed: int) -> Segment:
    """Random bits; label(t) = 1 if bits 0..t hold more ones than zeros; ties unscored."""
    bits = _bits(cfg, seed)
    ones = np.cumsum(bits, axis=1)
    count = np.arange(1, cfg.seq_len + 1)[None, :]
    answer = (2 * ones > count).astype(np.int64)
    return _segment(cfg, bits, answer, 2 * ones != count)
