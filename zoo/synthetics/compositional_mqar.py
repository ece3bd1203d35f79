"""Compositional MQAR: every key is a pair of tokens (a, b) from a g×g grid, g = √n (Zoology's variant).

The vocab is cut in thirds: first-half keys a ∈ [1, V/3), second-half keys b ∈ [V/3, 2V/3), values
v ∈ [2V/3, V). An example draws g distinct a's and g distinct b's, and its n = g² keys are all (a_i, b_j),
each with its own distinct value, listed in random order:

    position   0  1  2  | 3  4  5 | ... | C = 3n | C+3s C+3s+1 C+3s+2
    inputs     a  b  v  | a' b' v'| ... |        | a    b      0          (query slot s)
    labels     -100 ...                          | -100 v      -100

After the context come space = (L - 3n)/3 query slots of three positions: the key's two tokens and a blank.
The label sits on the b of the query (next-token convention). Each key is queried once, at slots drawn
without replacement ∝ i^(a-1) like MQAR, in random order. Because each a (and each b) occurs in g keys, no
single token identifies a key: the model has to bind both.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from zoo.synthetics._variant_base import check_ints, check_power_a, check_single_pass, rng_for
from zoo.synthetics.base import IGNORE_INDEX, Segment
from zoo.synthetics.mqar import _distinct_per_row, _random_permutations, _sample_slots, _slot_sampler


@dataclass
class CompositionalMQARConfig:
    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16  # n, a perfect square: the g×g grid of (a, b) keys
    num_examples: int = 1000
    power_a: float = 0.01
    random_non_queries: bool = False
    num_passes: int = 1

    @property
    def grid(self) -> int:
        return math.isqrt(self.num_kv_pairs)

    @property
    def context_len(self) -> int:
        return 3 * self.num_kv_pairs

    @property
    def num_slots(self) -> int:
        return (self.seq_len - self.context_len) // 3

    def slices(self) -> dict[str, int]:
        return {"seq_len": self.seq_len, "num_kv_pairs": self.num_kv_pairs}

    def validate(self) -> None:
        task = "compositional_mqar"
        check_ints(task, self, ("vocab_size", "seq_len", "num_kv_pairs", "num_examples", "num_passes"))
        check_power_a(task, self.power_a)
        check_single_pass(task, self)
        n, L, V = self.num_kv_pairs, self.seq_len, self.vocab_size
        if self.grid**2 != n:
            raise ValueError(f"{task}.num_kv_pairs must be a perfect square (a g×g grid), got {n}")
        if 6 * n > L:
            raise ValueError(f"{task}: context (3n) and queries (3n) must fit, 6n <= L, got n={n}, L={L}")
        if V // 3 - 1 < self.grid or V - 2 * (V // 3) < n:
            raise ValueError(f"{task}: vocab_size={V} is too small for n={n} (need V/3 - 1 >= √n, V/3 >= n)")


def generate_compositional_mqar(cfg: CompositionalMQARConfig, seed: int) -> Segment:
    """`cfg.num_examples` examples, vectorised over examples (layout in the module docstring)."""
    cfg.validate()
    rng = rng_for(seed)
    N, L, n, V, g, C = cfg.num_examples, cfg.seq_len, cfg.num_kv_pairs, cfg.vocab_size, cfg.grid, cfg.context_len
    third = V // 3
    a = _distinct_per_row(rng, N, g, (1, third))  # [N, g]
    b = _distinct_per_row(rng, N, g, (third, 2 * third))  # [N, g]
    values = _distinct_per_row(rng, N, n, (2 * third, V))  # [N, n]
    order = _random_permutations(rng, N, n)  # [N, n]: key order in the context
    key_a = np.take_along_axis(np.repeat(a, g, axis=1), order, axis=1)  # [N, n]: grid cell (i, j) -> a_i
    key_b = np.take_along_axis(np.tile(b, (1, g)), order, axis=1)  # [N, n]: -> b_j
    slots = _sample_slots(rng, N, n, _slot_sampler(cfg.num_slots, float(cfg.power_a)))  # [N, n] ascending
    perm = _random_permutations(rng, N, n)
    query_pos = C + 3 * np.take_along_axis(slots, perm, axis=1)  # [N, n]: where context key j is asked
    inputs = np.zeros((N, L), dtype=np.int64)
    labels = np.full((N, L), IGNORE_INDEX, dtype=np.int64)
    inputs[:, 0:C:3], inputs[:, 1:C:3], inputs[:, 2:C:3] = key_a, key_b, values
    rows = np.arange(N)[:, None]
    inputs[rows, query_pos] = key_a
    inputs[rows, query_pos + 1] = key_b
    labels[rows, query_pos + 1] = values
    return Segment(torch.from_numpy(inputs), torch.from_numpy(labels), cfg.slices())
