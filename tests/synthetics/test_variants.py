"""Layout invariants of the MQAR variants and circuit tasks, read back from the generated tensors."""

import numpy as np
import pytest
import torch

from zoo.config import DataConfig, SegmentConfig
from zoo.synthetics import (
    TASKS,
    CompositionalMQARConfig,
    ForgettingMQARConfig,
    MajorityConfig,
    ParityConfig,
    StackedMQARConfig,
    cached_generate,
    generate,
)
from zoo.synthetics.circuits import ONE, ZERO
from zoo.synthetics.stacked_mqar import split_pair_token

IGNORE = -100


def queries(seg):
    """Per example: (query positions ascending, their labels) as numpy arrays [N, Q]."""
    y = seg.labels.numpy()
    rows, cols = np.nonzero(y != IGNORE)
    counts = np.bincount(rows, minlength=len(seg))
    assert (counts == counts[0]).all()
    pos = cols.reshape(len(seg), -1)
    return pos, np.take_along_axis(y, pos, 1)


COMPOSITIONAL = {
    "n4": CompositionalMQARConfig(vocab_size=96, seq_len=36, num_kv_pairs=4, num_examples=200),
    "n16-L96": CompositionalMQARConfig(vocab_size=300, seq_len=96, num_kv_pairs=16, num_examples=100),
}


@pytest.mark.parametrize("name", COMPOSITIONAL)
def test_compositional_layout(name):
    cfg = COMPOSITIONAL[name]
    seg = generate(cfg, seed=3)
    x = seg.inputs.numpy()
    N, L, n, V, g = cfg.num_examples, cfg.seq_len, cfg.num_kv_pairs, cfg.vocab_size, cfg.grid
    assert x.shape == (N, L) and seg.slices == {"seq_len": L, "num_kv_pairs": n}
    third = V // 3
    a, b, v = x[:, 0 : 3 * n : 3], x[:, 1 : 3 * n : 3], x[:, 2 : 3 * n : 3]
    assert ((a >= 1) & (a < third)).all() and ((b >= third) & (b < 2 * third)).all() and (v >= 2 * third).all()
    pos, labels = queries(seg)
    for i in range(N):
        # The keys form a full g×g grid: g distinct a's, g distinct b's, every (a, b) pair exactly once.
        assert len(set(a[i])) == g and len(set(b[i])) == g and len(set(zip(a[i], b[i]))) == n
        assert len(set(v[i])) == n
        table = {(ka, kb): val for ka, kb, val in zip(a[i], b[i], v[i])}
        assert ((pos[i] - 3 * n) % 3 == 1).all(), "labels sit on the b of a query slot"
        asked = {(x[i, p - 1], x[i, p]) for p in pos[i]}
        assert asked == set(table), "every key is queried exactly once"
        for p, lab in zip(pos[i], labels[i]):
            assert table[(x[i, p - 1], x[i, p])] == lab
        filler = np.ones(L, bool)
        filler[: 3 * n] = False
        filler[pos[i]] = filler[pos[i] - 1] = False
        assert (x[i, filler] == 0).all()


FORGETTING = {
    "n4-r2": ForgettingMQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4, num_updates=2, num_examples=300),
    "n8-r8": ForgettingMQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=8, num_updates=8, num_examples=100),
    "n4-r0": ForgettingMQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4, num_updates=0, num_examples=50),
}


@pytest.mark.parametrize("name", FORGETTING)
def test_forgetting_layout_last_value_wins(name):
    cfg = FORGETTING[name]
    seg = generate(cfg, seed=5)
    x = seg.inputs.numpy()
    n, r, C, V = cfg.num_kv_pairs, cfg.num_updates, cfg.context_len, cfg.vocab_size
    assert seg.slices == {"seq_len": cfg.seq_len, "num_kv_pairs": n, "num_updates": r}
    pos, labels = queries(seg)
    assert (pos >= C).all() and ((pos - C) % 2 == 0).all()
    for i in range(len(seg)):
        ctx_k, ctx_v = x[i, 0:C:2], x[i, 1:C:2]
        assert len(set(ctx_k[:n])) == n and set(ctx_k[n:]) <= set(ctx_k[:n]) and len(set(ctx_k[n:])) == r
        assert len(set(ctx_v)) == n + r and (ctx_k < V // 2).all() and (ctx_v >= V // 2).all()
        last = {}
        for k, v in zip(ctx_k, ctx_v):
            last[k] = v  # the later assignment overwrites
        assert sorted(x[i, pos[i]]) == sorted(last)
        assert all(last[k] == lab for k, lab in zip(x[i, pos[i]], labels[i]))
    # Updated keys are really asked with their new value: some labels differ from the first assignment.
    if r:
        first = [dict(zip(x[i, 0 : 2 * n : 2], x[i, 1 : 2 * n : 2])) for i in range(len(seg))]
        changed = sum(first[i][k] != lab for i in range(len(seg)) for k, lab in zip(x[i, pos[i]], labels[i]))
        assert changed == r * len(seg)


@pytest.mark.parametrize("alphabet", [0, 6], ids=lambda k: f"K{k}")
def test_stacked_layout(alphabet):
    cfg = StackedMQARConfig(vocab_size=100, seq_len=24, num_kv_pairs=5, num_examples=200, alphabet=alphabet)
    K = cfg.K
    seg = generate(cfg, seed=9)
    x, n = seg.inputs, cfg.num_kv_pairs
    key_idx, val_idx = split_pair_token(x[:, :n], K)
    assert (key_idx >= 0).all() and (val_idx >= 0).all(), "the context is pair tokens"
    assert (split_pair_token(x[:, n:], K)[0] == -1).all(), "no pair token after the context"
    pos, labels = queries(seg)
    assert (pos >= n).all()
    for i in range(len(seg)):
        assert len(set(key_idx[i].tolist())) == n and len(set(val_idx[i].tolist())) == n
        table = {1 + k: 1 + K + v for k, v in zip(key_idx[i].tolist(), val_idx[i].tolist())}
        asked = x[i, pos[i]].tolist()
        assert sorted(asked) == sorted(table) and [table[k] for k in asked] == labels[i].tolist()
        rest = np.ones(cfg.seq_len, bool)
        rest[:n] = False
        rest[pos[i]] = False
        assert (x[i, rest] == 0).all()


@pytest.mark.parametrize("cumulative", [False, True], ids=["plain", "cumulative"])
@pytest.mark.parametrize("task", ["parity", "majority"])
def test_circuit_labels(task, cumulative):
    cls = ParityConfig if task == "parity" else MajorityConfig
    cfg = cls(vocab_size=8, seq_len=17, num_examples=100, cumulative=cumulative)
    seg = generate(cfg, seed=2)
    x, y = seg.inputs.numpy(), seg.labels.numpy()
    assert set(np.unique(x)) <= {ZERO, ONE}
    assert seg.slices == {"seq_len": 17, "cumulative": int(cumulative)}
    for i in range(len(seg)):
        for t in range(cfg.seq_len):
            prefix = x[i, : t + 1] == ONE
            if task == "parity":
                expected = ONE if prefix.sum() % 2 else ZERO
            else:
                ones, zeros = prefix.sum(), (~prefix).sum()
                expected = IGNORE if ones == zeros else (ONE if ones > zeros else ZERO)
            if not cumulative and t < cfg.seq_len - 1:
                expected = IGNORE
            assert y[i, t] == expected, (i, t)


SMALL = {  # one small config per registered task other than MQAR (whose own tests are test_mqar.py)
    "compositional_mqar": COMPOSITIONAL["n4"],
    "forgetting_mqar": FORGETTING["n4-r2"],
    "stacked_mqar": StackedMQARConfig(vocab_size=100, seq_len=24, num_kv_pairs=5, num_examples=50),
    "parity": ParityConfig(seq_len=16, num_examples=50, cumulative=True),
    "majority": MajorityConfig(seq_len=15, num_examples=50),
}


def test_every_registered_task_has_a_small_config():
    """A task added to `TASKS` gets its determinism test once it has an entry in SMALL here."""
    missing = sorted(set(TASKS) - {"mqar"} - set(SMALL))
    assert not missing and set(SMALL) <= set(TASKS), f"add a small config to SMALL for {missing}"


@pytest.mark.parametrize("name", sorted(SMALL))
def test_same_seed_same_tensors_other_seed_differs(name):
    cfg = SMALL[name]
    a, b, c = generate(cfg, 11), generate(cfg, 11), generate(cfg, 12)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.inputs, c.inputs)


BAD = [
    ("not-square", CompositionalMQARConfig(num_kv_pairs=8), "perfect square"),
    ("comp-fit", CompositionalMQARConfig(seq_len=90, num_kv_pairs=16), "6n <= L"),
    ("comp-passes", CompositionalMQARConfig(num_passes=2), "num_passes=1 only"),
    ("updates>n", ForgettingMQARConfig(num_kv_pairs=4, num_updates=5), "num_updates must be <= num_kv_pairs"),
    ("forget-fit", ForgettingMQARConfig(seq_len=64, num_kv_pairs=12, num_updates=10), r"2\(n\+r\) \+ 2n <= L"),
    ("forget-filler", ForgettingMQARConfig(random_non_queries=True), "random_non_queries=false only"),
    ("stacked-alphabet", StackedMQARConfig(vocab_size=100, alphabet=20), "cannot hold"),
    ("stacked-small-K", StackedMQARConfig(vocab_size=100, num_kv_pairs=16, seq_len=64), "must be >= num_kv_pairs"),
    ("majority-even", MajorityConfig(seq_len=64), "odd seq_len"),
    ("parity-cumulative-type", ParityConfig(cumulative="yes"), "must be a bool"),
]


@pytest.mark.parametrize(("cfg", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_configs_raise(cfg, message):
    with pytest.raises(ValueError, match=message):
        generate(cfg, 0)


def test_segment_options_reach_the_task_and_cache(tmp_path):
    seg_cfg = SegmentConfig(
        task="forgetting_mqar", seq_len=32, num_kv_pairs=4, num_examples=20, options={"num_updates": 3}
    )
    task_cfg = seg_cfg.task_config(64)
    assert isinstance(task_cfg, ForgettingMQARConfig) and task_cfg.num_updates == 3
    first, again = cached_generate(task_cfg, 4, tmp_path), cached_generate(task_cfg, 4, tmp_path)
    assert torch.equal(first.inputs, again.inputs) and again.slices == first.slices
    with pytest.raises(ValueError, match="num_updates must be <= num_kv_pairs"):
        DataConfig(vocab_size=64, train=[SegmentConfig(task="forgetting_mqar", seq_len=32, options={"num_updates": 9})])
