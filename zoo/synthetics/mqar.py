"""Multi-query associative recall (MQAR), from Zoology (Arora et al., 2023).

An example holds n key-value pairs and then queries every key once. Vocab V: token 0 is the blank, keys
come from [1, V/2) and values from [V/2, V), distinct within an example. With C = 2·n·num_passes:

    position   0   1   2   3  ...  C-1 | C    C+1  C+2  C+3  ...
    inputs     k1  v1  k2  v2 ...  vn  | 0    0    k3   0    ...    (the context, num_passes times)
    labels     -100 ...           -100 | -100 -100 v3   -100 ...

After the context come space = (L - C)/2 query slots at even offsets: slot g is position C + 2g. Each key
sits in one slot, and the label of that position is the key's value (next-token convention: the value is
never an input). The n slots are drawn without replacement with probability ∝ i^(a-1), i = 1..space,
a = power_a, so most queries sit soon after the context.

What is unusual here:
- Query order is a uniform random permutation of context order. (Zoology pairs the j-th context key with
  the j-th slot draw, so early context keys tend to be queried early.)
- Every random choice, random filler included, comes from one PCG64 generator seeded by `seed`: the same
  (config, seed) gives the same tensors on any machine.
- `generate_mqar` is vectorised over examples. `generate_mqar_reference` is a per-example loop in the style
  of Zoology's generator: the benchmark baseline and the distribution reference of the tests. The two agree
  in distribution, not tensor for tensor.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from zoo.synthetics.base import IGNORE_INDEX, Segment


@dataclass
class MQARConfig:
    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16
    num_examples: int = 1000
    power_a: float = 0.01
    random_non_queries: bool = False
    num_passes: int = 1

    @property
    def context_len(self) -> int:
        """C = 2·n·num_passes: positions [0, C) hold the context."""
        return 2 * self.num_kv_pairs * self.num_passes

    @property
    def num_slots(self) -> int:
        """space = (L - C)/2 query slots; slot g is input position C + 2g."""
        return (self.seq_len - self.context_len) // 2

    def slices(self) -> dict[str, int]:
        out = {"seq_len": self.seq_len, "num_kv_pairs": self.num_kv_pairs}
        if self.num_passes != 1:
            out["num_passes"] = self.num_passes
        return out

    def validate(self) -> None:
        """Raise ValueError naming the first violated constraint."""
        for name in ("vocab_size", "seq_len", "num_kv_pairs", "num_examples", "num_passes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"mqar.{name} must be an int, got {value!r}")
        if not isinstance(self.random_non_queries, bool):
            raise ValueError(f"mqar.random_non_queries must be a bool, got {self.random_non_queries!r}")
        a = self.power_a
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not (0 < a < math.inf):
            raise ValueError(f"mqar.power_a must be a finite number > 0, got {a!r}")
        for name in ("num_kv_pairs", "num_examples", "num_passes"):
            if getattr(self, name) < 1:
                raise ValueError(f"mqar.{name} must be >= 1, got {getattr(self, name)}")
        n, L, V, p = self.num_kv_pairs, self.seq_len, self.vocab_size, self.num_passes
        if L % 2:
            raise ValueError(f"mqar.seq_len must be even, got {L}")
        # With V > L >= 4n there are always enough distinct keys (V//2 - 1 >= n) and values (V - V//2 >= n).
        if V <= L:
            raise ValueError(f"mqar.vocab_size must be > seq_len (V > L), got V={V}, L={L}")
        if 2 * n * p + 2 * n > L:
            raise ValueError(
                f"mqar: context and queries must fit, 2n·passes + 2n <= L (4n <= L for one pass), "
                f"got n={n}, passes={p}, L={L}"
            )


def query_slot_probs(num_slots: int, power_a: float) -> np.ndarray:
    """P(slot g) ∝ (g+1)^(a-1) for g = 0..num_slots-1: the distribution of each successive slot draw."""
    w = np.arange(1, num_slots + 1, dtype=np.float64) ** (power_a - 1.0)
    return w / w.sum()


def generate_mqar(cfg: MQARConfig, seed: int) -> Segment:
    """`cfg.num_examples` MQAR examples, vectorised over examples (layout in the module docstring)."""
    cfg.validate()
    _check_seed(seed)
    rng = np.random.Generator(np.random.PCG64(seed))
    N, L, n, V = cfg.num_examples, cfg.seq_len, cfg.num_kv_pairs, cfg.vocab_size
    C, space = cfg.context_len, cfg.num_slots

    keys = _distinct_per_row(rng, N, n, 1, V // 2)  # [N, n]
    values = _distinct_per_row(rng, N, n, V // 2, V)  # [N, n]
    taken = _sample_slot_sets(rng, N, space, n, query_slot_probs(space, cfg.power_a))  # [N, W]
    perm = _random_permutations(rng, N, n)  # [N, n]

    # flatnonzero of taken lists row*W + slot, ascending within each row, n per row. The input position of
    # slot s in row r, flattened, is r*L + C + 2s = 2*(r*W + s) + r*(L - 2W) + C.
    width = taken.shape[1]
    flat = np.flatnonzero(taken.view(bool)).reshape(N, n)  # [N, n]
    # Context key j is queried at the perm[j]-th smallest of its row's slots.
    pos = 2 * np.take_along_axis(flat, perm, axis=1)  # [N, n]
    pos += np.arange(N, dtype=np.int64)[:, None] * (L - 2 * width) + C

    inputs = np.empty((N, L), dtype=np.int64)
    if cfg.random_non_queries:
        inputs[:, C:] = rng.integers(0, V, size=(N, L - C), dtype=np.int64)
    else:
        torch.from_numpy(inputs)[:, C:].zero_()
    inputs[:, 0 : 2 * n : 2] = keys
    inputs[:, 1 : 2 * n : 2] = values
    for p in range(1, cfg.num_passes):
        inputs[:, 2 * n * p : 2 * n * (p + 1)] = inputs[:, : 2 * n]
    inputs.reshape(-1)[pos] = keys
    labels = np.empty((N, L), dtype=np.int64)
    # torch fills with all cores; numpy's fill is single-threaded.
    torch.from_numpy(labels).fill_(IGNORE_INDEX)
    labels.reshape(-1)[pos] = values
    return Segment(torch.from_numpy(inputs), torch.from_numpy(labels), cfg.slices())


def generate_mqar_reference(cfg: MQARConfig, seed: int) -> Segment:
    """The same distribution as `generate_mqar`, one example at a time with `RandomState.choice`.

    Written the way Zoology's generator works (legacy `choice` per example for keys, values and the slots
    drawn without replacement ∝ weights), plus the seeded filler and the random query order.
    """
    cfg.validate()
    _check_seed(seed)
    rs = np.random.RandomState(np.random.MT19937(seed))
    N, L, n, V = cfg.num_examples, cfg.seq_len, cfg.num_kv_pairs, cfg.vocab_size
    C, space = cfg.context_len, cfg.num_slots
    key_space = np.arange(1, V // 2)
    value_space = np.arange(V // 2, V)
    probs = query_slot_probs(space, cfg.power_a)

    inputs = np.zeros((N, L), dtype=np.int64)
    labels = np.full((N, L), IGNORE_INDEX, dtype=np.int64)
    for i in range(N):
        keys = rs.choice(key_space, n, replace=False)
        values = rs.choice(value_space, n, replace=False)
        slots = rs.choice(space, n, replace=False, p=probs)[rs.permutation(n)]
        x = np.zeros(L + 1, dtype=np.int64)
        y = np.full(L + 1, IGNORE_INDEX, dtype=np.int64)
        pairs = np.empty(2 * n, dtype=np.int64)
        pairs[0::2] = keys
        pairs[1::2] = values
        x[:C] = np.tile(pairs, cfg.num_passes)
        x[C + 2 * slots] = keys
        y[C + 2 * slots + 1] = values
        if cfg.random_non_queries:
            filler = np.ones(L + 1, dtype=bool)
            filler[:C] = False
            filler[C + 2 * slots] = False
            x[filler] = rs.randint(0, V, size=int(filler.sum()))
        inputs[i] = x[:-1]
        labels[i] = y[1:]
    return Segment(torch.from_numpy(inputs), torch.from_numpy(labels), cfg.slices())


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def _distinct_per_row(rng: np.random.Generator, rows: int, n: int, low: int, high: int) -> np.ndarray:
    """[rows, n] int64: each row n distinct integers from [low, high), uniformly, in uniformly random order."""
    size = high - low
    if n * (n - 1) <= size:
        # At most 1/2 expected duplicate pairs per row: draw with replacement, redraw the rows with a
        # duplicate (rejection, so exact) until none is left.
        out = rng.integers(low, high, size=(rows, n), dtype=np.int64)
        bad = _rows_with_duplicates(out)
        while bad.size:
            out[bad] = rng.integers(low, high, size=(bad.size, n), dtype=np.int64)
            bad = bad[_rows_with_duplicates(out[bad])]
        return out
    # Many pairs relative to the range: order the whole range by random keys, keep the first n.
    out = np.empty((rows, n), dtype=np.int64)
    chunk = max(1, (1 << 22) // size)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        out[start:stop] = low + np.argsort(rng.random((stop - start, size)), axis=1)[:, :n]
    return out


def _rows_with_duplicates(a: np.ndarray) -> np.ndarray:
    s = np.sort(a, axis=1)
    same = s[:, 1:] == s[:, :-1]
    if not same.any():
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(same.any(axis=1))


def _random_permutations(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """[rows, n] int64, each row a uniformly random permutation of 0..n-1.

    Sorts random integers whose low bits hold the index; the low bits of the sorted row are the
    permutation. Rows where two random parts tie are redrawn, which keeps it exact.
    """
    bits = max(1, (n - 1).bit_length())
    dtype = np.uint32 if bits <= 8 else np.uint64
    index = np.arange(n, dtype=dtype)
    low = dtype((1 << bits) - 1)

    def draw(k: int) -> np.ndarray:
        words = -(-k * n * np.dtype(dtype).itemsize // 8)
        r = rng.bit_generator.random_raw(words).view(dtype)[: k * n].reshape(k, n)
        s = np.sort((r & ~low) | index, axis=1)
        return s

    s = draw(rows)
    bad = _rows_with_ties(s, bits)
    while bad.size:
        s[bad] = draw(bad.size)
        bad = bad[_rows_with_ties(s[bad], bits)]
    return (s & low).astype(np.int64)


def _rows_with_ties(sorted_packed: np.ndarray, bits: int) -> np.ndarray:
    random_part = sorted_packed >> sorted_packed.dtype.type(bits)
    tie = random_part[:, 1:] == random_part[:, :-1]
    if not tie.any():
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(tie.any(axis=1))


class _SlotSampler:
    """IID draws from `probs` by inverse CDF on 63 random bits, through a 2^16-bin guide table.

    Slot i covers the integers [bounds[i-1], bounds[i]) of [0, 2^63), so P(i) = probs[i] to within 2^-63.
    A bin of the table that holds no boundary maps straight to its slot; draws in the few bins with a
    boundary are resolved by binary search.
    """

    TABLE_BITS = 16

    def __init__(self, probs: np.ndarray):
        cdf = np.clip(np.cumsum(probs)[:-1], 0.0, 1.0)
        self.bounds = np.floor(cdf * 2.0**63).astype(np.uint64)
        shift = 63 - self.TABLE_BITS
        starts = np.arange(1 << self.TABLE_BITS, dtype=np.uint64) << np.uint64(shift)
        lo = np.searchsorted(self.bounds, starts, side="right")
        hi = np.searchsorted(self.bounds, starts + np.uint64((1 << shift) - 1), side="right")
        self.table = np.where(lo == hi, lo, -1).astype(np.int64)
        self.shift = np.uint64(shift + 1)

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        raw = rng.bit_generator.random_raw(count)
        out = np.take(self.table, (raw >> self.shift).astype(np.intp))
        fix = np.flatnonzero(out < 0)
        if fix.size:
            out[fix] = np.searchsorted(self.bounds, raw[fix] >> np.uint64(1), side="right")
        return out


def _sample_slot_sets(
    rng: np.random.Generator, rows: int, space: int, n: int, probs: np.ndarray, max_rounds: int = 32
) -> np.ndarray:
    """[rows, W] uint8 (W = space rounded up to 8): per row, ones at n slots drawn without replacement ∝ probs.

    Successive sampling without replacement picks the same set as drawing with replacement and skipping
    repeats until n distinct slots are seen. Each round draws, for every unfinished row, as many slots as
    it still misses, so no round overshoots n. Rows still unfinished after `max_rounds` rounds (many pairs
    relative to the slots) are completed by an exponential race over their free slots, the same
    distribution: successive draws from the remaining slots ∝ probs.
    """
    width = -(-space // 8) * 8
    taken = np.zeros((rows, width), dtype=np.uint8)
    if n == space:
        taken[:, :space] = 1
        return taken
    flat = taken.reshape(-1)
    sampler = _SlotSampler(probs)
    active = np.arange(rows, dtype=np.int64)
    count = np.zeros(rows, dtype=np.int64)
    for _ in range(max_rounds):
        if not active.size:
            break
        missing = n - count[active]
        m = int(missing.max())
        idx = active[:, None] * width + sampler.draw(rng, active.size * m).reshape(active.size, m)
        if int(missing.min()) < m:
            idx = idx[np.arange(m) < missing[:, None]]
        flat[idx] = 1
        count[active] = _row_sums(taken if active.size == rows else taken[active])
        active = active[count[active] < n]
    if active.size:
        race = rng.standard_exponential((active.size, space)) / probs  # [A, space]
        race[taken[active, :space].astype(bool)] = np.inf
        missing = n - count[active]
        m = int(missing.max())
        first = np.argsort(race, axis=1)[:, :m]  # [A, m], earliest first
        keep = np.arange(m) < missing[:, None]
        flat[(active[:, None] * width + first)[keep]] = 1
    return taken


def _row_sums(u8: np.ndarray) -> np.ndarray:
    """Sum of each row of a 0/1 uint8 matrix whose width is a multiple of 8, 8 bytes at a time."""
    words = u8.view(np.uint64)
    # Multiplying by 0x0101...01 adds the 8 bytes of a word into its top byte (each sum is <= 8).
    return ((words * np.uint64(0x0101010101010101)) >> np.uint64(56)).sum(axis=1, dtype=np.int64)
