"""Forgetting MQAR: some keys are reassigned later in the context, and the last value wins.

An example holds n distinct keys with n distinct values, then `num_updates` = r of those keys (distinct, in
random order) appear again with new values (distinct from every other value in the example):

    position   0  1  ... 2n-1 | 2n  2n+1 ... | C = 2(n+r) | C+2s  C+2s+1
    inputs     k1 v1 ...  vn  | k'  v'   ... |            | k     0          (query slot s)
    labels     -100 ...                                   | v*    -100       v* = k's last value

Then come space = (L - C)/2 query slots at even offsets; every key is queried once, at slots drawn without
replacement ∝ i^(a-1) (MQAR's rule), in random order. The label of an updated key is its new value, so a
model must overwrite, not only store. Slices add `num_updates`.
"""

from dataclasses import dataclass

import numpy as np
import torch

from zoo.synthetics._variant_base import check_ints, check_power_a, check_single_pass, rng_for
from zoo.synthetics.base import IGNORE_INDEX, Segment
from zoo.synthetics.mqar import _distinct_per_row, _random_permutations, _sample_slots, _slot_sampler


@dataclass
class ForgettingMQARConfig:
    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16
    num_examples: int = 1000
    power_a: float = 0.01
    random_non_queries: bool = False
    num_passes: int = 1
    num_updates: int = 4  # r <= n keys reassigned after the first n pairs

    @property
    def context_len(self) -> int:
        return 2 * (self.num_kv_pairs + self.num_updates)

    @property
    def num_slots(self) -> int:
        return (self.seq_len - self.context_len) // 2

    def slices(self) -> dict[str, int]:
        return {"seq_len": self.seq_len, "num_kv_pairs": self.num_kv_pairs, "num_updates": self.num_updates}

    def validate(self) -> None:
        task = "forgetting_mqar"
        check_ints(task, self, ("vocab_size", "seq_len", "num_kv_pairs", "num_examples", "num_passes"))
        check_ints(task, self, ("num_updates",), minimum=0)
        check_power_a(task, self.power_a)
        check_single_pass(task, self)
        n, r, L, V = self.num_kv_pairs, self.num_updates, self.seq_len, self.vocab_size
        if r > n:
            raise ValueError(f"{task}.num_updates must be <= num_kv_pairs, got r={r}, n={n}")
        if L % 2:
            raise ValueError(f"{task}.seq_len must be even, got {L}")
        if self.context_len + 2 * n > L:
            raise ValueError(f"{task}: context and queries must fit, 2(n+r) + 2n <= L, got n={n}, r={r}, L={L}")
        if V // 2 - 1 < n or V - V // 2 < n + r:
            raise ValueError(f"{task}: vocab_size={V} is too small for n={n}, r={r}")


def generate_forgetting_mqar(cfg: ForgettingMQARConfig, seed: int) -> Segment:
    """`cfg.num_examples` examples, vectorised over examples (layout in the module docstring)."""
    cfg.validate()
    rng = rng_for(seed)
    N, L, n, r, V, C = cfg.num_examples, cfg.seq_len, cfg.num_kv_pairs, cfg.num_updates, cfg.vocab_size, cfg.context_len
    keys = _distinct_per_row(rng, N, n, (1, V // 2))  # [N, n]
    values = _distinct_per_row(rng, N, n + r, (V // 2, V))  # [N, n + r]: first n old, last r new
    updated = _random_permutations(rng, N, n)[:, :r]  # [N, r]: indices of the reassigned keys
    final = values[:, :n].copy()
    np.put_along_axis(final, updated, values[:, n:], axis=1)  # [N, n]: each key's last value
    slots = _sample_slots(rng, N, n, _slot_sampler(cfg.num_slots, float(cfg.power_a)))
    query_pos = C + 2 * np.take_along_axis(slots, _random_permutations(rng, N, n), axis=1)  # [N, n]
    inputs = np.zeros((N, L), dtype=np.int64)
    labels = np.full((N, L), IGNORE_INDEX, dtype=np.int64)
    inputs[:, 0 : 2 * n : 2], inputs[:, 1 : 2 * n : 2] = keys, values[:, :n]
    inputs[:, 2 * n : C : 2] = np.take_along_axis(keys, updated, axis=1)
    inputs[:, 2 * n + 1 : C : 2] = values[:, n:]
    rows = np.arange(N)[:, None]
    inputs[rows, query_pos] = keys
    labels[rows, query_pos] = final
    return Segment(torch.from_numpy(inputs), torch.from_numpy(labels), cfg.slices())
