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
- Query order (`query_order`): "random" (the default) queries the keys in a uniformly random permutation of
  context order; "zoology" queries the j-th context key at the j-th slot of the successive draw, as Zoology's
  generator does, so early context keys tend to take the likelier, earlier slots (at L=128, n=8 the first key's
  mean slot is about 11, the last's about 17). The key-to-query distances differ little between the two
  (experiments/zoology_fig2/README.md).
- Every random choice, random filler included, comes from PCG64 streams spawned from `seed` (one per chunk
  of rows), cut from raw 64-bit words: the same (config, seed) gives the same tensors on any machine and
  with any number of threads. (The slot probabilities go through floating-point pow; a last-bit difference
  between math libraries would move a slot draw with probability below 1e-13.)
- `generate_mqar` is vectorised over examples: sets of slots come from draws with replacement that skip
  repeats, which is successive sampling without replacement, and keys from rejection of rows with a repeat.
  `generate_mqar_reference` is a per-example loop in the style of Zoology's generator: the benchmark
  baseline and the distribution reference of the tests. The two agree in distribution, not tensor for tensor.
"""

import functools
import math
from concurrent.futures import ThreadPoolExecutor
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
    query_order: str = "random"  # random | zoology (module docstring)

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
        if self.query_order not in ("random", "zoology"):
            raise ValueError(f"mqar.query_order must be random or zoology, got {self.query_order!r}")
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
    """`cfg.num_examples` MQAR examples, vectorised over examples (layout in the module docstring).

    Rows are generated in chunks of `_ROWS_PER_CHUNK`, each from its own stream spawned from `seed`, on
    `torch.get_num_threads()` threads; the output does not depend on the thread count.
    """
    cfg.validate()
    _check_seed(seed)
    N, L = cfg.num_examples, cfg.seq_len
    sampler = _slot_sampler(cfg.num_slots, float(cfg.power_a))
    # Fresh zeroed pages from the OS: the zero filler costs no pass of its own.
    inputs = np.zeros((N, L), dtype=np.int64)
    labels = np.empty((N, L), dtype=np.int64)
    starts = range(0, N, _ROWS_PER_CHUNK)
    streams = np.random.SeedSequence(seed).spawn(len(starts))
    chunks = [slice(r0, min(N, r0 + _ROWS_PER_CHUNK)) for r0 in starts]
    tasks = [functools.partial(_fill_rows, cfg, sampler, inputs[c], labels[c], s) for c, s in zip(chunks, streams)]
    _run_all(max(1, torch.get_num_threads()), tasks)
    return Segment(torch.from_numpy(inputs), torch.from_numpy(labels), cfg.slices())


# Rows generated together from one stream. Part of the output's definition: changing it changes the data.
_ROWS_PER_CHUNK = 8192


def _fill_rows(
    cfg: MQARConfig, sampler: "_SlotSampler", inputs: np.ndarray, labels: np.ndarray, stream: np.random.SeedSequence
) -> None:
    """Write examples into `inputs` and `labels` ([R, L] each, `inputs` zeroed), drawing from `stream`."""
    rng = np.random.Generator(np.random.PCG64(stream))
    R, L, n, V, C = len(inputs), cfg.seq_len, cfg.num_kv_pairs, cfg.vocab_size, cfg.context_len
    pairs_kv = _distinct_per_row(rng, R, n, (1, V // 2), (V // 2, V))  # [R, 2n]
    keys, values = pairs_kv[:, :n], pairs_kv[:, n:]  # [R, n] each
    if cfg.query_order == "zoology":
        query_pos = _slots_in_draw_order(rng, R, n, sampler.probs)  # [R, n]: key j at the j-th draw
    else:
        slots = _sample_slots(rng, R, n, sampler)  # [R, n], ascending
        perm = _random_permutations(rng, R, n)  # [R, n]
        # Context key j is queried at the perm[j]-th smallest slot of its row, input position C + 2·slot.
        query_pos = slots.reshape(-1)[perm + np.arange(0, R * n, n)[:, None]]  # [R, n]
    query_pos *= 2
    query_pos += C
    pairs = np.empty((R, 2 * n), dtype=keys.dtype)
    pairs[:, 0::2] = keys
    pairs[:, 1::2] = values
    # Rows go in blocks that stay in cache, so each output line is written once while it is hot (filling a
    # whole output and then scattering into it would read it back from memory).
    block = max(1, (1 << 19) // (8 * L))
    row_offsets = np.arange(0, block * L, L, dtype=np.int64)[:, None]
    for b0 in range(0, R, block):
        b1 = min(R, b0 + block)
        x, y = inputs[b0:b1], labels[b0:b1]
        flat_pos = query_pos[b0:b1] + row_offsets[: b1 - b0]
        if cfg.random_non_queries:
            x[:, C:] = _uniform_ints(rng, (b1 - b0) * (L - C), 0, V).reshape(b1 - b0, L - C)
        x[:, :C].reshape(b1 - b0, cfg.num_passes, 2 * n)[:] = pairs[b0:b1, None, :]
        x.reshape(-1)[flat_pos] = keys[b0:b1]
        y.fill(IGNORE_INDEX)
        y.reshape(-1)[flat_pos] = values[b0:b1]


def _run_all(workers: int, tasks: list) -> list:
    """Results of the zero-argument `tasks`, run on up to `workers` threads (numpy releases the GIL)."""
    if workers == 1 or len(tasks) == 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(max_workers=min(workers, len(tasks))) as pool:
        return [f.result() for f in [pool.submit(task) for task in tasks]]


def generate_mqar_reference(cfg: MQARConfig, seed: int) -> Segment:
    """The same distribution as `generate_mqar`, one example at a time with `RandomState.choice`.

    Written the way Zoology's generator works (legacy `choice` per example for keys, values and the slots
    drawn without replacement ∝ weights, the j-th key at the j-th draw), plus the seeded filler and, by default, the
    random query order.
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
        slots = rs.choice(space, n, replace=False, p=probs)  # in draw order
        if cfg.query_order == "random":
            slots = slots[rs.permutation(n)]
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


def _raw_chunks(rng: np.random.Generator, count: int, bits: int) -> np.ndarray:
    """`count` uniform unsigned ints of `bits` (16, 32 or 64) bits, cut from the generator's raw 64-bit words.

    The chunks are taken in little-endian order on every machine, so the stream does not depend on the host.
    """
    per_word = 64 // bits
    raw = rng.bit_generator.random_raw(-(-count // per_word))
    return raw.astype("<u8", copy=False).view(f"<u{bits // 8}")[:count]


def _int_dtype(high: int) -> type:
    return np.int16 if high <= 1 << 15 else np.int32 if high <= 1 << 31 else np.int64


def _uniform_ints(rng: np.random.Generator, count: int, low: int, high: int) -> np.ndarray:
    """`count` ints uniform on [low, high): the low bits of raw chunks, redrawing those >= high - low (exact)."""
    size = high - low
    bits = max(1, (size - 1).bit_length())
    chunk = 16 if bits <= 16 else 32 if bits <= 32 else 64
    mask = (1 << bits) - 1
    out = _raw_chunks(rng, count, chunk) & mask
    bad = np.flatnonzero(out >= size)
    while bad.size:
        out[bad] = _raw_chunks(rng, bad.size, chunk) & mask
        bad = bad[out[bad] >= size]
    return out.astype(_int_dtype(high)) + low


def _distinct_per_row(rng: np.random.Generator, rows: int, n: int, *ranges: tuple[int, int]) -> np.ndarray:
    """[rows, n·len(ranges)]: per row and range, n distinct integers drawn uniformly, in uniformly random order.

    Columns [b·n, (b+1)·n) come from ranges[b] = (low, high). The ranges must be disjoint, so that one sort of
    a row finds the repeats of every block.
    """
    if all(n * (n - 1) <= high - low for low, high in ranges):
        # At most 1/2 expected repeated pairs per block: draw with replacement, redraw the rows with a repeat
        # (rejection, so exact) until none is left.
        def draw(k: int) -> np.ndarray:
            blocks = [_uniform_ints(rng, k * n, low, high).reshape(k, n) for low, high in ranges]
            return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)

        out = draw(rows)
        bad = _rows_with_repeats(out)
        while bad.size:
            out[bad] = draw(bad.size)
            bad = bad[_rows_with_repeats(out[bad])]
        return out
    # Many pairs relative to a range: order the whole range by random keys, keep the first n.
    out = np.empty((rows, n * len(ranges)), dtype=_int_dtype(max(high for _, high in ranges)))
    for b, (low, high) in enumerate(ranges):
        size = high - low
        chunk = max(1, (1 << 22) // size)
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            order = np.argsort(_raw_chunks(rng, (stop - start) * size, 64).reshape(-1, size), axis=1)
            out[start:stop, b * n : (b + 1) * n] = low + order[:, :n]
    return out


def _rows_with_repeats(a: np.ndarray) -> np.ndarray:
    """Indices of the rows of `a` that hold some value twice."""
    s = np.sort(a, axis=1)
    repeats = np.flatnonzero(s[:, 1:] == s[:, :-1])
    return np.unique(repeats // (a.shape[1] - 1))


def _random_permutations(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """[rows, n] int64, each row a uniformly random permutation of 0..n-1.

    Sorts random integers whose low bits hold the index; the low bits of the sorted row are the
    permutation. Rows where two random parts tie are redrawn, which keeps it exact.
    """
    bits = max(1, (n - 1).bit_length())
    word = 32 if bits <= 8 else 64
    dtype = np.dtype(f"<u{word // 8}").type
    index = np.arange(n, dtype=dtype)
    low = dtype((1 << bits) - 1)

    def draw(k: int) -> np.ndarray:
        r = _raw_chunks(rng, k * n, word).reshape(k, n)
        return np.sort((r & ~low) | index, axis=1)

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
    """IID draws from `probs` by inverse CDF on a uniform 63-bit integer u, through a guide table.

    Slot i covers [bounds[i-1], bounds[i]) of [0, 2^63), so P(i) = probs[i] to within 2^-63. The top 16 bits
    of u pick a bin of the table; a bin without a boundary inside maps straight to its slot. For the few draws
    in a bin with a boundary, the other 47 bits of u are drawn and the slot is found by binary search.
    """

    TOP_BITS = 16

    def __init__(self, probs: np.ndarray):
        self.probs = probs
        cdf = np.clip(np.cumsum(probs)[:-1], 0.0, 1.0)
        self.bounds = np.floor(cdf * 2.0**63).astype(np.uint64)
        self.low_bits = np.uint64(63 - self.TOP_BITS)
        starts = np.arange(1 << self.TOP_BITS, dtype=np.uint64) << self.low_bits
        lo = np.searchsorted(self.bounds, starts, side="right")
        hi = np.searchsorted(self.bounds, starts + ((np.uint64(1) << self.low_bits) - np.uint64(1)), side="right")
        self.table = np.where(lo == hi, lo, -1).astype(_int_dtype(len(probs)))

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        top = _raw_chunks(rng, count, self.TOP_BITS)
        out = np.take(self.table, top)
        fix = np.flatnonzero(out < 0)
        if fix.size:
            rest = _raw_chunks(rng, fix.size, 64) >> (np.uint64(64) - self.low_bits)
            u = (top[fix].astype(np.uint64) << self.low_bits) | rest
            out[fix] = np.searchsorted(self.bounds, u, side="right")
        return out


def _race_times(rng: np.random.Generator, rows: int, probs: np.ndarray) -> np.ndarray:
    """[rows, len(probs)] float64: Exponential(1) times from 53-bit uniforms in (0, 1), slot g's scaled by
    1/probs[g]; the slots in finishing order are a successive draw without replacement ∝ probs."""
    raw = _raw_chunks(rng, rows * len(probs), 64).reshape(rows, len(probs))
    return -np.log((raw >> np.uint64(11)).astype(np.float64) * 2.0**-53 + 2.0**-54) / probs


def _slots_in_draw_order(rng: np.random.Generator, rows: int, n: int, probs: np.ndarray) -> np.ndarray:
    """[rows, n] int64: per row, n slots drawn without replacement ∝ probs, in the order of successive sampling.

    An exponential race (`_race_times`): the first n slots to finish, in finishing order, are a successive draw
    without replacement in draw order. Rows go in blocks of a bounded number of race times.
    """
    space = len(probs)
    out = np.empty((rows, n), dtype=np.int64)
    block = max(1, (1 << 22) // space)
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        race = _race_times(rng, r1 - r0, probs)  # [b, space]
        first = np.argpartition(race, n - 1, axis=1)[:, :n] if n < space else np.tile(np.arange(space), (r1 - r0, 1))
        out[r0:r1] = np.take_along_axis(first, np.argsort(np.take_along_axis(race, first, 1), axis=1), 1)
    return out


@functools.lru_cache(maxsize=64)
def _slot_sampler(space: int, power_a: float) -> _SlotSampler:
    return _SlotSampler(query_slot_probs(space, power_a))


def _sample_slots(
    rng: np.random.Generator, rows: int, n: int, sampler: "_SlotSampler", max_rounds: int = 32
) -> np.ndarray:
    """[rows, n] int64, ascending: per row, n of the sampler's slots drawn without replacement ∝ its probs.

    Successive sampling without replacement picks the same set as drawing with replacement and skipping
    repeats until n distinct slots are seen. Each round draws, for every unfinished row, as many slots as it
    still misses, so no round overshoots n. Rows still unfinished after `max_rounds` rounds (many pairs
    relative to the slots) are completed by an exponential race over their free slots, the same
    distribution: successive draws from the remaining slots ∝ probs.
    """
    probs = sampler.probs
    space = len(probs)
    taken = np.full((rows, space), n == space)  # [rows, space]
    flat = taken.reshape(-1)
    active = np.arange(rows, dtype=np.int64) if n < space else np.empty(0, dtype=np.int64)
    count = np.zeros(rows, dtype=np.int64)
    for round_ in range(max_rounds):
        if not active.size:
            break
        if round_ == 0:
            # Every row draws n slots into an empty set: mark them all, and count the repeats in sorted rows.
            draws = sampler.draw(rng, rows * n).reshape(rows, n)  # [rows, n]
            flat[(active * space)[:, None] + draws] = True
            ordered = np.sort(draws, axis=1)
            count = n - (ordered[:, 1:] == ordered[:, :-1]).sum(axis=1)
            active = active[count < n]
            continue
        # Order the unfinished rows by how many slots they miss, most first: column j of the round then
        # covers a prefix of them, the rows that miss more than j.
        missing = (n - count[active]).astype(np.int16)  # 16-bit: the stable argsort is a radix sort
        order = np.argsort(-missing, kind="stable")
        active, missing = active[order], missing[order]  # [A]
        columns = active.size - np.cumsum(np.bincount(missing))[:-1]  # rows missing more than j, j = 0..m-1
        draws = sampler.draw(rng, int(missing.sum()))
        base = active * space
        hits = np.zeros(active.size, dtype=np.int64)
        start = 0
        # Column by column, so a slot drawn twice in one round counts once.
        for size in columns:
            idx = base[:size] + draws[start : start + size]
            start += size
            hits[:size] += flat[idx]
            flat[idx] = True
        count[active] += missing - hits
        active = active[count[active] < n]
    if active.size:
        race = _race_times(rng, active.size, probs)  # [A, space]: earliest first wins
        race[taken[active]] = np.inf
        missing = n - count[active]
        m = int(missing.max())
        first = np.argsort(race, axis=1)[:, :m]  # [A, m]
        keep = np.arange(m) < missing[:, None]
        flat[(active[:, None] * space + first)[keep]] = True
    return np.flatnonzero(flat).reshape(rows, n) - (np.arange(rows, dtype=np.int64) * space)[:, None]
