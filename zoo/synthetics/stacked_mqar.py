"""Stacked MQAR: each context position holds a whole key-value pair, so one layer can solve it (Zoology's
"stacked/continuous" variant, where a position carries [key emb; value emb]).

How the model consumes it (our choice): the pair (key i, value j) is one token of the ordinary vocabulary,
`pair_token(i, j)`, so every model runs unchanged through its token embedding. Vocab layout, with K keys and
K values (K = `alphabet`, default the largest with 1 + 2K + K² <= V):

    0 blank | keys [1, 1+K) | values [1+K, 1+2K) | pairs [1+2K, 1+2K+K²), pair(i, j) = 1 + 2K + i·K + j

The paper's factorised embedding [E_k(i); E_v(j)] would be an embedding hook mapping a pair token to
E_k(i) + E_v(j) (disjoint halves); `split_pair_token` decodes the ids for such a hook. With the plain
embedding a model must learn the K² pair rows, so recall here also measures that; keep K small.

    position   0       1       ... n-1 | n+s
    inputs     (k1,v1) (k2,v2) ... ()  | k    (query slot s: a plain key token)
    labels     -100 ...                | v    (the value token 1+K+j)

Queries occupy one position each, at space = L - n slots drawn without replacement ∝ i^(a-1), in random
order; keys are distinct within an example, and values are too.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from zoo.synthetics._variant_base import check_ints, check_power_a, check_single_pass, rng_for
from zoo.synthetics.base import IGNORE_INDEX, Segment
from zoo.synthetics.mqar import _distinct_per_row, _random_permutations, _sample_slots, _slot_sampler


def default_alphabet(vocab_size: int) -> int:
    """The largest K with 1 + 2K + K² = (K+1)² <= V."""
    return math.isqrt(vocab_size) - 1


def pair_token(key: np.ndarray, value: np.ndarray, alphabet: int) -> np.ndarray:
    """Token id of the pair (key index i, value index j), both in [0, K)."""
    return 1 + 2 * alphabet + key * alphabet + value


def split_pair_token(token: torch.Tensor, alphabet: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key index, value index) of pair tokens; -1 for ids that are not pair tokens."""
    offset = token - (1 + 2 * alphabet)
    is_pair = (offset >= 0) & (offset < alphabet * alphabet)
    return torch.where(is_pair, offset // alphabet, -1), torch.where(is_pair, offset % alphabet, -1)


@dataclass
class StackedMQARConfig:
    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16
    num_examples: int = 1000
    power_a: float = 0.01
    random_non_queries: bool = False
    num_passes: int = 1
    alphabet: int = 0  # K keys and K values; 0: default_alphabet(vocab_size)

    @property
    def K(self) -> int:
        return self.alphabet or default_alphabet(self.vocab_size)

    def slices(self) -> dict[str, int]:
        return {"seq_len": self.seq_len, "num_kv_pairs": self.num_kv_pairs}

    def validate(self) -> None:
        task = "stacked_mqar"
        check_ints(task, self, ("vocab_size", "seq_len", "num_kv_pairs", "num_examples", "num_passes"))
        check_ints(task, self, ("alphabet",), minimum=0)
        check_power_a(task, self.power_a)
        check_single_pass(task, self)
        n, L, V, K = self.num_kv_pairs, self.seq_len, self.vocab_size, self.K
        if 2 * n > L:
            raise ValueError(f"{task}: context (n) and queries (n) must fit, 2n <= L, got n={n}, L={L}")
        if K < n:
            raise ValueError(f"{task}: alphabet K={K} must be >= num_kv_pairs={n}")
        if (K + 1) ** 2 > V:
            raise ValueError(f"{task}: vocab_size={V} cannot hold 1 + 2K + K² tokens for K={K}")


def generate_stacked_mqar(cfg: StackedMQARConfig, seed: int) -> Segment:
    """`cfg.num_examples` examples, vectorised over examples (layout in the module docstring)."""
    cfg.validate()
    rng = rng_for(seed)
    N, L, n, K = cfg.num_examples, cfg.seq_len, cfg.num_kv_pairs, cfg.K
    keys = _distinct_per_row(rng, N, n, (0, K))  # [N, n] key indices
    values = _distinct_per_row(rng, N, n, (0, K))  # [N, n] value indices
    slots = _sample_slots(rng, N, n, _slot_sampler(L - n, float(cfg.power_a)))
    query_pos = n + np.take_along_axis(slots, _random_permutations(rng, N, n), axis=1)  # [N, n]
    inputs = np.zeros((N, L), dtype=np.int64)
    labels = np.full((N, L), IGNORE_INDEX, dtype=np.int64)
    inputs[:, :n] = pair_token(keys, values, K)
    rows = np.arange(N)[:, None]
    inputs[rows, query_pos] = 1 + keys
    labels[rows, query_pos] = 1 + K + values
    return Segment(torch.from_numpy(inputs), torch.from_numpy(labels), cfg.slices())
