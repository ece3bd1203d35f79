import hashlib
import itertools
import math

import numpy as np
import pytest
import torch

from zoo.synthetics import MQARConfig, Segment, generate, generate_mqar, generate_mqar_reference, mqar
from zoo.synthetics.mqar import (
    _distinct_per_row,
    _random_permutations,
    _rows_with_repeats,
    _rows_with_ties,
    _sample_slots,
    _SlotSampler,
    query_slot_probs,
)

GENERATORS = {"fast": generate_mqar, "reference": generate_mqar_reference}


def chi2_limit(dof: int, z: float = 5.0) -> float:
    """Upper tail of chi-square at ~z sigma (Wilson-Hilferty), p ≈ 3e-7 for z = 5."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def parse(seg: Segment, cfg: MQARConfig) -> dict:
    """Read a segment back: context keys/values, query positions and slots, and which context key each asks."""
    x, y = seg.inputs.numpy(), seg.labels.numpy()
    N, n, C = len(seg), cfg.num_kv_pairs, cfg.context_len
    rows, cols = np.nonzero(y != -100)
    counts = np.bincount(rows, minlength=N)
    assert (counts == n).all(), f"query labels per example: {np.unique(counts)}, expected {n}"
    qpos = cols.reshape(N, n)  # ascending within each row
    qkeys = np.take_along_axis(x, qpos, 1)
    qlabels = np.take_along_axis(y, qpos, 1)
    keys, values = x[:, 0 : 2 * n : 2], x[:, 1 : 2 * n : 2]
    match = qkeys[:, :, None] == keys[:, None, :]  # [N, query, context key]
    assert (match.sum(2) == 1).all(), "every query must hold exactly one context key"
    assert (match.sum(1) == 1).all(), "every context key must be queried exactly once"
    asked = match.argmax(2)  # [N, n]: context index of the key queried at each position
    slot_of_key = np.empty_like(asked)
    np.put_along_axis(slot_of_key, asked, (qpos - C) // 2, 1)
    return dict(x=x, y=y, keys=keys, values=values, qpos=qpos, qlabels=qlabels, asked=asked, slot_of_key=slot_of_key)


LAYOUTS = {
    "L64-n4": MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4, num_examples=300),
    "L256-n16": MQARConfig(vocab_size=8192, seq_len=256, num_kv_pairs=16, num_examples=200),
    "3-passes": MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4, num_examples=300, num_passes=3),
    "random-filler": MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4, num_examples=300, random_non_queries=True),
    "odd-vocab": MQARConfig(vocab_size=67, seq_len=64, num_kv_pairs=4, num_examples=300),
    "all-slots-queried": MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=8, num_examples=300),
    "keys-crowd-range": MQARConfig(vocab_size=34, seq_len=32, num_kv_pairs=8, num_examples=300),
    "power_a=1": MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4, num_examples=300, power_a=1.0),
    "smallest": MQARConfig(vocab_size=5, seq_len=4, num_kv_pairs=1, num_examples=50),
    "vocab-above-int16": MQARConfig(vocab_size=100_000, seq_len=64, num_kv_pairs=8, num_examples=300),
}


@pytest.mark.parametrize("gen", GENERATORS, ids=str)
@pytest.mark.parametrize("name", LAYOUTS, ids=str)
def test_layout(name, gen):
    cfg = LAYOUTS[name]
    seg = GENERATORS[gen](cfg, seed=7)
    N, L, n, V, C = cfg.num_examples, cfg.seq_len, cfg.num_kv_pairs, cfg.vocab_size, cfg.context_len
    assert seg.inputs.dtype == seg.labels.dtype == torch.int64
    assert seg.inputs.shape == seg.labels.shape == (N, L) and len(seg) == N
    expected_slices = {"seq_len": L, "num_kv_pairs": n}
    if cfg.num_passes != 1:
        expected_slices["num_passes"] = cfg.num_passes
    assert seg.slices == expected_slices

    p = parse(seg, cfg)
    keys, values, x = p["keys"], p["values"], p["x"]
    assert ((keys >= 1) & (keys < V // 2)).all()
    assert ((values >= V // 2) & (values < V)).all()
    assert (np.diff(np.sort(keys, 1), axis=1) > 0).all(), "keys repeat within an example"
    assert (np.diff(np.sort(values, 1), axis=1) > 0).all(), "values repeat within an example"
    for k in range(1, cfg.num_passes):
        np.testing.assert_array_equal(x[:, 2 * n * k : 2 * n * (k + 1)], x[:, : 2 * n])

    # Queries sit after the context at even offsets; each label is the value that follows its key in the context.
    assert (p["qpos"] >= C).all() and ((p["qpos"] - C) % 2 == 0).all()
    np.testing.assert_array_equal(p["qlabels"], np.take_along_axis(values, p["asked"], 1))

    filler = np.ones((N, L), dtype=bool)
    filler[:, :C] = False
    np.put_along_axis(filler, p["qpos"], False, 1)
    if cfg.random_non_queries:
        assert ((x[filler] >= 0) & (x[filler] < V)).all()
        assert (x[filler] != 0).mean() > 0.9
    else:
        assert (x[filler] == 0).all()


@pytest.mark.parametrize("random_non_queries", [False, True], ids=["zero-filler", "random-filler"])
def test_seeded(random_non_queries):
    cfg = MQARConfig(
        vocab_size=256, seq_len=128, num_kv_pairs=8, num_examples=64, random_non_queries=random_non_queries
    )
    a, b, c = generate_mqar(cfg, 3), generate_mqar(cfg, 3), generate_mqar(cfg, 4)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.inputs, c.inputs) and not torch.equal(a.labels, c.labels)
    if random_non_queries:
        query_region = slice(cfg.context_len, None)
        differs = a.inputs[:, query_region] != c.inputs[:, query_region]
        assert differs.float().mean() > 0.5, "the filler must change with the seed"
    r1, r2 = generate_mqar_reference(cfg, 3), generate_mqar_reference(cfg, 3)
    assert torch.equal(r1.inputs, r2.inputs) and torch.equal(r1.labels, r2.labels)


def test_chunks_of_rows_use_their_own_streams():
    """Rows come in chunks, each from its own stream: chunks must not repeat one another, whatever the threads."""
    chunk = mqar._ROWS_PER_CHUNK
    cfg = MQARConfig(vocab_size=64, seq_len=16, num_kv_pairs=2, num_examples=2 * chunk + 100, random_non_queries=True)
    before = torch.get_num_threads()
    try:
        segs = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            segs.append(generate_mqar(cfg, 8))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(segs[0].inputs, segs[1].inputs) and torch.equal(segs[0].labels, segs[1].labels)
    x = segs[0].inputs
    assert not torch.equal(x[:100], x[chunk : chunk + 100]) and not torch.equal(x[:100], x[2 * chunk :])


def test_output_is_pinned_to_generator_version():
    """A changed output for the same (config, seed) must come with a new GENERATOR_VERSION (stale caches).

    If this fails after an intended change of the generator, bump `zoo.synthetics.GENERATOR_VERSION` and
    record the new digest here.
    """
    from zoo.synthetics import GENERATOR_VERSION

    cfg = MQARConfig(vocab_size=512, seq_len=128, num_kv_pairs=8, num_examples=32, random_non_queries=True)
    seg = generate_mqar(cfg, 11)
    digest = hashlib.sha256(seg.inputs.numpy().tobytes() + seg.labels.numpy().tobytes()).hexdigest()[:16]
    assert (GENERATOR_VERSION, digest) == (1, "86686703035150ba")


def test_generate_dispatches_on_config_type():
    cfg = MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4, num_examples=8)
    assert torch.equal(generate(cfg, 5).inputs, generate_mqar(cfg, 5).inputs)

    class NotATask:
        pass

    with pytest.raises(ValueError, match="no synthetic task takes a NotATask config"):
        generate(NotATask(), 0)


BAD_CONFIGS = {
    "odd-seq_len": (dict(seq_len=255), "seq_len must be even"),
    "vocab-not-above-seq_len": (dict(vocab_size=256, seq_len=256), r"vocab_size must be > seq_len \(V > L\)"),
    "zero-pairs": (dict(num_kv_pairs=0), "num_kv_pairs must be >= 1"),
    "zero-examples": (dict(num_examples=0), "num_examples must be >= 1"),
    "zero-passes": (dict(num_passes=0), "num_passes must be >= 1"),
    "power_a-zero": (dict(power_a=0.0), "power_a must be a finite number > 0"),
    "power_a-negative": (dict(power_a=-0.5), "power_a must be a finite number > 0"),
    "power_a-nan": (dict(power_a=float("nan")), "power_a must be a finite number > 0"),
    "power_a-inf": (dict(power_a=float("inf")), "power_a must be a finite number > 0"),
    "4n-above-L": (dict(seq_len=64, num_kv_pairs=17), r"2n·passes \+ 2n <= L \(4n <= L for one pass\)"),
    "passes-overflow": (dict(seq_len=64, num_kv_pairs=8, num_passes=4), r"2n·passes \+ 2n <= L"),
    "float-seq_len": (dict(seq_len=256.0), "seq_len must be an int"),
    "bool-examples": (dict(num_examples=True), "num_examples must be an int"),
    "str-filler-flag": (dict(random_non_queries="yes"), "random_non_queries must be a bool"),
    "query-order": (dict(query_order="sorted"), "query_order must be random or zoology, got 'sorted'"),
}


@pytest.mark.parametrize("name", BAD_CONFIGS, ids=str)
def test_bad_config_raises(name):
    overrides, message = BAD_CONFIGS[name]
    cfg = MQARConfig(**overrides)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    for gen in GENERATORS.values():
        with pytest.raises(ValueError, match=message):
            gen(cfg, 0)


def test_largest_valid_configs_pass():
    MQARConfig(seq_len=64, num_kv_pairs=16).validate()  # 4n = L
    MQARConfig(seq_len=64, num_kv_pairs=8, num_passes=3).validate()  # 2n·3 + 2n = L
    MQARConfig(vocab_size=257, seq_len=256).validate()


@pytest.mark.parametrize("seed", [-1, 1.5, True], ids=["negative", "float", "bool"])
def test_bad_seed_raises(seed):
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        generate_mqar(MQARConfig(num_examples=2), seed)


def test_segment_checks_its_tensors():
    x = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="must be int64"):
        Segment(x.int(), x, {})
    with pytest.raises(ValueError, match=r"must both be \[N, L\]"):
        Segment(x, x[:, :3], {})


# Distribution: slots


def exact_set_probs(probs: np.ndarray, n: int) -> dict[tuple, float]:
    """P(set) under successive sampling without replacement ∝ probs, summed over all draw orders."""
    out: dict[tuple, float] = {}
    for order in itertools.permutations(range(len(probs)), n):
        p, left = 1.0, 1.0
        for s in order:
            p *= probs[s] / left
            left -= probs[s]
        key = tuple(sorted(order))
        out[key] = out.get(key, 0.0) + p
    return out


def set_counts(slot_sets: np.ndarray, sets: list[tuple]) -> np.ndarray:
    index = {s: i for i, s in enumerate(sets)}
    counts = np.zeros(len(sets))
    for row in map(tuple, np.sort(slot_sets, 1)):
        counts[index[row]] += 1
    return counts


@pytest.mark.parametrize("power_a", [0.01, 0.5], ids=["a=0.01", "a=0.5"])
def test_slot_sets_match_exact_successive_sampling(power_a):
    """L=18, n=3: 6 slots, 20 possible sets; the set frequencies of the generator against exact probabilities."""
    cfg = MQARConfig(vocab_size=64, seq_len=18, num_kv_pairs=3, num_examples=20_000, power_a=power_a)
    exact = exact_set_probs(query_slot_probs(cfg.num_slots, power_a), 3)
    sets = sorted(exact)
    probs = np.array([exact[s] for s in sets])
    assert abs(probs.sum() - 1) < 1e-12
    counts = set_counts(parse(generate_mqar(cfg, 1), cfg)["slot_of_key"], sets)
    assert chi2(counts, probs) < chi2_limit(len(sets) - 1)


@pytest.mark.parametrize("max_rounds", [0, 1, 32], ids=["race-only", "one-round-then-race", "rounds"])
def test_slot_sampler_paths_match_exact(max_rounds):
    """Both ways of drawing a slot set (rounds of draws with replacement, exponential race) are exact."""
    space, n, a = 7, 4, 0.01
    probs = query_slot_probs(space, a)
    exact = exact_set_probs(probs, n)
    sets = sorted(exact)
    slot_sets = _sample_slots(np.random.default_rng(2), 20_000, n, _SlotSampler(probs), max_rounds=max_rounds)
    assert slot_sets.shape == (20_000, n) and (np.diff(slot_sets, axis=1) > 0).all()
    assert slot_sets.min() >= 0 and slot_sets.max() < space
    counts = set_counts(slot_sets, sets)
    assert chi2(counts, np.array([exact[s] for s in sets])) < chi2_limit(len(sets) - 1)


def test_iid_slot_draws_follow_power_law():
    """One draw (the first draw of successive sampling) has P(slot g) ∝ (g+1)^(a-1) exactly."""
    probs = query_slot_probs(112, 0.01)  # L=256, n=16
    draws = _SlotSampler(probs).draw(np.random.default_rng(0), 400_000)
    counts = np.bincount(draws, minlength=112)
    assert chi2(counts, probs) < chi2_limit(111)
    # docs/REFERENCE.md §1: about 0.55 of first draws land in the first 10 slots.
    assert abs(probs[:10].sum() - 0.55) < 0.01
    assert abs((draws < 10).mean() - probs[:10].sum()) < 5 * math.sqrt(0.25 / draws.size)


def test_slot_distribution_matches_reference_at_L256():
    """All queries at L=256, n=16: the fast generator's slot statistics against the reference generator's."""
    cfg = MQARConfig(seq_len=256, num_kv_pairs=16, num_examples=12_000)
    fast = parse(generate_mqar(cfg, 0), cfg)["slot_of_key"]
    ref_cfg = MQARConfig(seq_len=256, num_kv_pairs=16, num_examples=1500)
    ref = parse(generate_mqar_reference(ref_cfg, 0), ref_cfg)["slot_of_key"]

    def first10(s):
        # Whole examples are independent; their per-example fractions give an honest standard error.
        per_example = (s < 10).mean(1)
        return per_example.mean(), per_example.std() / math.sqrt(len(s))

    (f, f_se), (r, r_se) = first10(fast), first10(ref)
    assert abs(f - r) < 5 * math.hypot(f_se, r_se)
    assert abs(f - 0.38) < 0.02  # docs/REFERENCE.md §1: about 0.38 of all queries fall in the first 10 slots
    assert abs(np.median(fast) - np.median(ref)) <= 2
    assert 14 <= np.median(fast) <= 18  # docs/REFERENCE.md §1: median slot 16
    # The whole histogram, slot by slot, against the reference's (two-sample chi-square).
    cf, cr = np.bincount(fast.ravel(), minlength=112), np.bincount(ref.ravel(), minlength=112)
    keep = (cf + cr) >= 20
    k1, k2 = math.sqrt(cr.sum() / cf.sum()), math.sqrt(cf.sum() / cr.sum())
    stat = (((k1 * cf - k2 * cr) ** 2) / (cf + cr))[keep].sum()
    # Queries within an example are dependent (drawn without replacement), which only narrows the spread.
    assert stat < chi2_limit(int(keep.sum()) - 1)


def test_query_order_is_independent_of_context_order():
    """The slot of the j-th context key has the same distribution for every j (Zoology ties it to draw order)."""
    cfg = MQARConfig(seq_len=256, num_kv_pairs=16, num_examples=6000)
    slots = parse(generate_mqar(cfg, 5), cfg)["slot_of_key"].astype(float)  # [N, n]
    overall = slots.mean()
    for j in (0, 1, cfg.num_kv_pairs - 1):
        se = slots[:, j].std() / math.sqrt(len(slots))
        assert abs(slots[:, j].mean() - overall) < 5 * se, j
    before = (slots[:, 0] < slots[:, 1]).mean()
    assert abs(before - 0.5) < 5 * math.sqrt(0.25 / len(slots))


def exact_order_probs(probs: np.ndarray, n: int) -> dict[tuple, float]:
    """P(draw sequence) under successive sampling without replacement ∝ probs, for every ordered n-tuple."""
    out = {}
    for order in itertools.permutations(range(len(probs)), n):
        p, left = 1.0, 1.0
        for s in order:
            p *= probs[s] / left
            left -= probs[s]
        out[order] = p
    return out


@pytest.mark.parametrize("gen", ["fast", "reference"])
def test_zoology_query_order_is_the_draw_order(gen):
    """query_order=zoology, L=18, n=3 (6 slots, 120 draw sequences): the slots of context keys 1, 2, 3 are a
    successive draw without replacement in draw order, against the exact probability of every sequence."""
    cfg = MQARConfig(vocab_size=64, seq_len=18, num_kv_pairs=3, num_examples=20_000, query_order="zoology")
    exact = exact_order_probs(query_slot_probs(cfg.num_slots, cfg.power_a), 3)
    seqs = sorted(exact)
    index = {q: i for i, q in enumerate(seqs)}
    counts = np.zeros(len(seqs))
    for row in map(tuple, parse(GENERATORS[gen](cfg, 4), cfg)["slot_of_key"]):
        counts[index[row]] += 1
    assert chi2(counts, np.array([exact[q] for q in seqs])) < chi2_limit(len(seqs) - 1)


def test_zoology_query_order_puts_early_keys_early_at_L128():
    """query_order=zoology at L=128, n=8: the mean slot rises from the first context key to the last (≈11 to
    ≈17), as Zoology's generator (the reference's legacy `choice`, in draw order) has it."""
    cfg = MQARConfig(seq_len=128, num_kv_pairs=8, num_examples=20_000, query_order="zoology")
    fast = parse(generate_mqar(cfg, 3), cfg)["slot_of_key"].astype(float)  # [N, n]
    ref_cfg = MQARConfig(seq_len=128, num_kv_pairs=8, num_examples=4000, query_order="zoology")
    ref = parse(generate_mqar_reference(ref_cfg, 3), ref_cfg)["slot_of_key"].astype(float)
    for j in range(cfg.num_kv_pairs):
        se = math.hypot(fast[:, j].std() / math.sqrt(len(fast)), ref[:, j].std() / math.sqrt(len(ref)))
        assert abs(fast[:, j].mean() - ref[:, j].mean()) < 5 * se, j
    assert fast[:, 0].mean() < 12.5 and fast[:, -1].mean() > 15.5


# Distribution: keys, values, permutations


DISTINCT_CASES = {
    "rejection": (4, [(1, 17)]),
    "rejection-keys-and-values": (4, [(1, 17), (17, 34)]),
    "argsort": (8, [(1, 17)]),
    "argsort-keys-and-values": (8, [(1, 17), (17, 34)]),
}


@pytest.mark.parametrize("case", DISTINCT_CASES, ids=str)
def test_distinct_rows_are_uniform_in_every_position(case):
    n, ranges = DISTINCT_CASES[case]
    out = _distinct_per_row(np.random.default_rng(4), 20_000, n, *ranges)
    assert np.issubdtype(out.dtype, np.integer) and out.shape == (20_000, n * len(ranges))
    for b, (low, high) in enumerate(ranges):
        rows = out[:, b * n : (b + 1) * n].astype(np.int64)
        assert ((rows >= low) & (rows < high)).all()
        assert (np.diff(np.sort(rows, 1), axis=1) > 0).all()
        size = high - low
        for j in (0, n - 1):
            counts = np.bincount(rows[:, j] - low, minlength=size)
            assert chi2(counts, np.full(size, 1 / size)) < chi2_limit(size - 1)
        # Order within a row carries no information about the values.
        assert abs((rows[:, 0] < rows[:, 1]).mean() - 0.5) < 5 * math.sqrt(0.25 / len(rows))


def test_rows_with_repeats():
    a = np.array([[3, 1, 2], [5, 7, 5], [9, 9, 9], [0, 4, 8]])
    assert _rows_with_repeats(a).tolist() == [1, 2]


@pytest.mark.parametrize("n", [3, 300], ids=["n=3", "n=300-wide-words"])
def test_random_permutations_are_uniform(n):
    perms = _random_permutations(np.random.default_rng(6), 30_000 if n == 3 else 200, n)
    assert (np.sort(perms, 1) == np.arange(n)).all()
    if n == 3:
        codes = perms[:, 0] * 9 + perms[:, 1] * 3 + perms[:, 2]
        counts = np.array([np.sum(codes == a * 9 + b * 3 + c) for a, b, c in itertools.permutations(range(3))])
        assert counts.sum() == len(perms)
        assert chi2(counts, np.full(6, 1 / 6)) < chi2_limit(5)
    else:
        assert (perms[:, 0] == 0).mean() < 0.05


def test_rows_with_ties_finds_equal_random_parts_only():
    bits = 2
    packed = np.array([[4 << bits | 1, 5 << bits | 0, 6 << bits | 2], [4 << bits | 3, 4 << bits | 0, 9 << bits | 1]])
    assert _rows_with_ties(np.sort(packed.astype(np.uint32), 1), bits).tolist() == [1]
