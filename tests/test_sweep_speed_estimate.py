"""experiments/bench/sweep_speed.py's grid estimate from measured early-stop epochs: finished runs are charged
the epochs they took, the rest of their config the mean of those, configs with no finished run the full epochs."""

import json
from pathlib import Path

import pytest


@pytest.fixture
def bench(sweep_speed_bench):
    return sweep_speed_bench


ROWS = [
    {"mixer": "attention", "seq_len": 64, "d_model": 64, "epoch_s": 2.0, "epochs": 64, "runs": 4},
    {"mixer": "short_conv+based", "seq_len": 64, "d_model": 64, "epoch_s": 1.0, "epochs": 64, "runs": 4},
]


def write_summaries(directory: Path, finished: list[tuple[list[str], int]]) -> None:
    for i, (layers, epochs) in enumerate(finished):
        summary = {"layers": layers, "state_bytes_seq_len": 64, "d_model": 64, "epochs": epochs}
        (directory / f"run{i}.json").write_text(json.dumps(summary))


@pytest.mark.parametrize(
    ("finished", "expected"),
    [
        ([], 2.0 * 64 * 4 + 1.0 * 64 * 4),  # nothing finished: the upper bound
        ([(["attention", "attention"], 8)], 2.0 * 8 * 4 + 1.0 * 64 * 4),  # one run: its config charged 8 a run
        ([(["attention", "attention"], 8), (["attention", "attention"], 16), (["short_conv", "based"], 2)],
         2.0 * (8 + 16 + 2 * 12) + 1.0 * 2 * 4),  # the unfinished runs of a config: the mean of its finished
    ],
    ids=["none-finished", "one-finished", "mean-of-finished"],
)
def test_measured_estimate(bench, tmp_path, finished, expected):
    write_summaries(tmp_path, finished)
    est = bench.measured_estimate(ROWS, [str(tmp_path)])
    assert est["grid_estimate_measured_s"] == pytest.approx(expected)
    assert est["grid_estimate_measured_runs"] == len(finished)


def test_upper_bound_charges_every_run_the_full_epochs(bench):
    assert bench.upper_estimate(ROWS) == 2.0 * 64 * 4 + 1.0 * 64 * 4


@pytest.mark.parametrize(
    ("extra", "want"),
    [({}, 3.0), ({"compiled_device_ms": 2.0}, 2.0), ({"compiled_device_ms": 2.0, "packed_device_ms": 4.0,
                                                       "pack_size": 4}, 1.0),
     ({"packed_device_ms": 16.0, "pack_size": 4}, 3.0)],
    ids=["plain", "compiled", "packed-cheapest", "packed-dearer"],
)
def test_a_run_is_charged_its_cheapest_step(bench, extra, want):
    assert bench.run_step_ms({"device_ms": 3.0} | extra) == want


def test_flop_floor_charges_every_run_its_full_epochs_at_the_rate(bench):
    rows = [r | {"epoch_tflop": t} for r, t in zip(ROWS, (3.0, 1.5))]
    assert bench.flop_floor(rows, 100.0) == pytest.approx((4 * 64 * 3.0 + 4 * 64 * 1.5) / 100.0)


def test_example_gflop_is_per_example_and_counts_the_backward(bench):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from zoo.eval import query_loss
    from zoo.models import LanguageModel
    from zoo.train import load_config, load_split

    b = bench
    runs, _ = b.grid_configs(tiny=True)
    cfg, _ = load_config(b.shrink(runs[0], 8) + ["data.cache=false"])
    segments = load_split(cfg, "train", torch.device("cpu"))
    torch.manual_seed(0)
    two, four = (b.example_gflop(cfg, segments, torch.device("cpu"), examples=n) for n in (2, 4))
    assert two == pytest.approx(four, rel=1e-6)
    # a matmul's backward costs twice its forward: forward + backward is at least 3x the forward alone (the
    # convolutions' and linear attention's backward here cost more than that)
    seg = segments[0]
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        query_loss(LanguageModel(cfg.model), seg.inputs[:4], seg.query_pos[:4], seg.query_labels[:4])
    forward = counter.get_total_flops() / 4 / 1e9
    assert 2.9 < four / forward < 4.5


CHEAPEST = {  # the d = 512 H3 row measured at L = 256 on one H100, and a small config where the pack wins
    "compiled single": ({"device_ms": 34.6, "compiled_device_ms": 13.0, "packed_device_ms": 155.7,
                         "packed_compiled_device_ms": 82.9, "pack_size": 4}, "compiled", 13.0),
    "compiled pack": ({"device_ms": 4.2, "compiled_device_ms": 2.0, "packed_device_ms": 13.8,
                       "packed_compiled_device_ms": 6.0, "pack_size": 4}, "compiled pack", 1.5),
    "eager only": ({"device_ms": 4.2}, "eager", 4.2),
}


@pytest.mark.parametrize("case", CHEAPEST)
def test_the_table_names_the_step_a_run_is_charged(bench, case):
    row, kind, ms = CHEAPEST[case]
    assert bench.cheapest_step(row) == kind
    assert bench.run_step_ms(row) == pytest.approx(ms)
