"""Based Fig. 2's own markers (experiments/based_frontier/paper_points.json) beside ours: the file holds the
figure's models and axis ranges, and each marker is paired with our nearest point of its model by state."""

import json
import runpy
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent / "experiments" / "based_frontier"
PLOT = runpy.run_path(str(HERE / "plot.py"), run_name="plot")


def test_markers_are_the_figures_models_within_its_axes():
    points = json.loads((HERE / "paper_points.json").read_text())["points"]
    assert {p["model"] for p in points} == {"attention", "based", "sliding_window", "mamba", "h3", "hyena"}
    assert all(12 <= p["log2_bytes"] <= 22.5 and 0 <= p["accuracy"] <= 1 for p in points)
    # the sliding window's eight windows, one marker each, a power of two apart
    windows = sorted(p["log2_bytes"] for p in points if p["model"] == "sliding_window")
    assert len(windows) == 8 and all(0.9 < b - a < 1.1 for a, b in zip(windows, windows[1:]))


def row(mixer, state_bytes, test, d=64, dial=8, best=True):
    return {"mixer": mixer, "state_bytes": state_bytes, "test_accuracy": test, "d_model": d, "dial": dial,
            "best_lr_by_valid": best}


PAPER = [{"model": "based", "log2_bytes": 13.5, "accuracy": 0.71}]


@pytest.mark.parametrize(("rows", "verdict"), [
    ([row("based", 2**13.58, 0.77)], "matches"),  # +0.06 = 0.05 tolerance + 0.01 reading
    ([row("based", 2**13.58, 0.78)], "ours higher"),
    ([row("based", 2**13.58, 0.64)], "ours lower"),
    ([row("based", 2**13.7, 0.71)], "no point at this state"),  # 0.2 log2 bytes away
    ([row("based", 2**13.7, 0.71), row("based", 2**13.45, 0.70, dial=16)], "matches"),  # the nearest is paired
    ([row("based", 2**13.5, 0.2, best=False)], "not run"),  # only best-lr points count
    ([row("attention", 2**13.5, 0.71)], "not run"),
], ids=["within", "higher", "lower", "too-far", "nearest", "not-best-lr", "other-model"])
def test_each_marker_meets_our_nearest_point_of_its_model(rows, verdict):
    (entry,) = PLOT["point_comparison"](rows, PAPER)
    assert entry["verdict"] == verdict


def test_every_committed_difference_names_its_cause_or_check():
    """Each marker where the committed runs differ from the figure carries the cause found or the check that would
    settle it in the README's table; matching markers carry none."""
    rows = PLOT["rows"](PLOT["load_summaries"]())
    for entry in PLOT["point_comparison"](rows):
        differs = entry["verdict"] in ("ours lower", "ours higher")
        assert bool(entry["cause"]) == differs, f"{entry['mixer']} at {entry['paper_state']}: {entry['verdict']}"
