"""Based Fig. 2 (the recall–state frontier) from the committed run summaries: results.json, the figure and the
README's comparison table.

    python experiments/based_frontier/plot.py collect runs/based_frontier   # copy finished runs' summaries here
    python experiments/based_frontier/plot.py                               # build everything from summaries/
    python experiments/based_frontier/plot.py checks                        # the same for checks/zero_filler_shuffled

`collect` copies every finished run below a runs dir (its summary.json, plus the `model` section of its
config.yaml) to `summaries/<run>.json`; commit those. The build step reads `summaries/` (and, for the figure,
`checks/zero_filler_shuffled/summaries/`: runs of an earlier data setting) and writes
- `results.json`: {"rows": [...]}, one row per run: mixer (the preset's name), dial (feature_dim, window or
  d_state where the grid sweeps one), d_model, seq_len (the longest test length, 1,024, where Zoology measures
  the state), lr, epochs, state_bytes (the exact decode state, fp32, at seq_len), paper_state_bytes (the state as
  the code behind the figure counts it: `paper_state_bytes`), valid_accuracy, test_accuracy,
  test_accuracy_by_slice, best_lr_by_valid;
- `accuracy_vs_state.png`: test accuracy of every (model, d_model, dial) point at its best lr (chosen on
  validation) against paper_state_bytes, one series per model, and the frontier over all of them;
- the table between the `comparison` markers of README.md: the paper's readings (shared/REFERENCE.md §1) beside
  ours, "matches" or "differs";
- the table between the `points` markers: every marker of the paper's figure itself (`paper_points.json`, read
  from Zoology's copy of it) beside our best-lr point of the same model at the nearest paper_state_bytes, within
  2^±0.15 B.
  The figure draws the paper's markers as open circles.
"""

from __future__ import annotations

import json
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

from zoo.atomic import atomic_savefig
from zoo.plot import (
    build_reproduction,
    copy_summaries,
    fill_readme_block,
    mark_best_lr,
    markdown_table,
    reproduction_main,
    result_row,
)
from zoo.plot import load_summaries as _load_summaries

HERE = Path(__file__).resolve().parent
SUMMARIES = HERE / "summaries"
# Runs of an earlier data setting, kept as a check and drawn beside the grid's: zero filler tokens and shuffled
# batches, where the config has random filler and Zoology's fixed batch order (README, "Data").
CHECKS = HERE / "checks" / "zero_filler_shuffled"
# Layer kinds of each preset (zoo/configs/model/based_fig2/<name>.yaml) -> (name, the mixer option the grid sweeps).
PRESETS = {
    ("short_conv", "attention"): ("attention", None),
    ("short_conv", "based"): ("based", ("based", "feature_dim")),
    ("short_conv", "sliding_window"): ("sliding_window", ("sliding_window", "window")),
    ("mamba", "mamba"): ("mamba", ("mamba", "d_state")),
    ("mamba2", "mamba2"): ("mamba2", ("mamba2", "d_state")),
    ("hyena", "hyena"): ("hyena", None),
    ("h3", "h3"): ("h3", ("h3", "d_state")),
    ("short_conv", "gla"): ("gla", None),
    ("short_conv", "gated_deltanet"): ("gated_deltanet", None),
}
ORDER = ["based", "attention", "sliding_window", "mamba", "mamba2", "hyena", "h3", "gla", "gated_deltanet"]
TOLERANCE = 0.05
COLUMNS = [  # the README table: (header, comparison entry key)
    ("model", "mixer"),
    ("where", "where"),
    ("paper (Based Fig. 2)", "paper"),
    ("ours (best lr by valid, test)", "ours"),
    ("verdict", "verdict"),
    ("cause, or the check that settles it", "cause"),
]
# For a reading where ours differs: the cause found, or the check that would settle it, by (model, where).
CLAIM_CAUSES = {
    ("mamba", "best over d, d_state"): "the reading is of the figure's markers at 2^17–2^19 B, beyond the config's "
                                       "grid (d ≤ 256, d_state ≤ 24: at most 2^16.58 B); the 11 markers the grid "
                                       "can meet reach at most 0.82",
}
START, END = "<!-- comparison:start -->", "<!-- comparison:end -->"
PAPER_POINTS = HERE / "paper_points.json"
POINTS_START, POINTS_END = "<!-- points:start -->", "<!-- points:end -->"
STATE_MATCH = 0.15  # log2 bytes: our point and the paper's marker are "at the same state" within this
READ_PRECISION = 0.01  # the markers' accuracy as read from the image
POINT_COLUMNS = [
    ("model", "mixer"),
    ("paper state", "paper_state"),
    ("paper", "paper"),
    ("ours (state, run)", "ours_at"),
    ("ours", "ours"),
    ("ours − paper", "diff"),
    ("verdict", "verdict"),
    ("cause, or the check that settles it", "cause"),
]
# For every marker where ours differs: the cause found, or the check that would settle it, by (model, the
# marker's log2 bytes to two places). The README's "Where ours stands" gives the evidence.
CAUSES = {
    ("based", "16.48"): "candidate: another Based of the figure's wider grid at this state (our d = 48, f = 24 "
                        "gives 0.894 at 2^15.96); check: the config's commented-out d = 256 and f = 32, 64 runs",
}


def collect(runs_dir: Path, out: Path = SUMMARIES) -> int:
    """Copy each finished run's summary (+ its resolved model config) to out/<run>.json; returns the count."""
    return copy_summaries(runs_dir, out)


def load_summaries(directory: Path = SUMMARIES) -> list[dict[str, Any]]:
    return _load_summaries(directory)


def name_and_dial(summary: dict[str, Any]) -> tuple[str, int | None]:
    layers = tuple(summary["layers"])
    if layers not in PRESETS:
        return "+".join(dict.fromkeys(layers)), None
    name, dial = PRESETS[layers]
    if dial is None:
        return name, None
    mixer, option = dial
    return name, summary.get("model", {}).get("mixers", {}).get(mixer, {}).get(option)


def longest_test_length(summary: dict[str, Any]) -> int:
    """The longest sequence of the run's test slices (`test/accuracy/seq_len=L`): 1,024 for this grid."""
    prefix = "test/accuracy/seq_len="
    lengths = [int(k[len(prefix):]) for k in summary if k.startswith(prefix)]
    if not lengths:
        raise ValueError(f"run {summary.get('run')!r} has no test/accuracy/seq_len=L slice")
    return max(lengths)


def state_at_test_length(summary: dict[str, Any]) -> dict[str, Any]:
    """seq_len and state_bytes (fp32) at the longest test length, where Zoology's logger measures the state
    (`model.state_size(sequence_length=max(test input_seq_len)) * 4`): the attention and long-convolution states
    grow with L, so the training length (256) would put them 4x left of the paper's x-axis."""
    L = longest_test_length(summary)
    sizes = summary["state_size"]
    if str(L) not in sizes:
        raise ValueError(f"run {summary.get('run')!r} records no state_size at its test length {L}")
    return {"seq_len": L, "state_bytes": 4 * sizes[str(L)]}


def paper_state_bytes(summary: dict[str, Any], mixer: str, dial: int | None, seq_len: int) -> int:
    """The run's state as the code behind Based Fig. 2 counts it (Zoology's `state_size` methods, ×4 bytes),
    the x-axis of the figure's markers. It counts the main mixer's state alone: its BaseConv's (in the Hybrid
    models) is 0, Mamba's is the SSM's d_inner·d_state without the conv window, H3's d·d_state, the sliding
    window's keys and values of its block size w (our window w + 1); attention's KV cache and Hyena's input buffer
    at `seq_len`. Models not in the figure (Mamba-2, GLA, Gated DeltaNet) keep the exact state."""
    model, d = summary.get("model", {}), summary["d_model"]
    layers = len(summary["layers"])
    if mixer == "attention":
        return 4 * 2 * seq_len * d
    if mixer == "based":
        expanded = dial * (dial + 1) // 2 + dial + 1  # Taylor features: 1, x and the unique pairs of x
        return 4 * expanded * (d + 1)  # one head: the kv state and the normaliser's
    if mixer == "sliding_window":
        return 4 * 2 * (dial - 1) * d
    if mixer == "mamba":
        return 4 * layers * model.get("mixers", {}).get("mamba", {}).get("expand", 2) * d * dial
    if mixer == "hyena":
        return 4 * layers * d * seq_len
    if mixer == "h3":
        return 4 * layers * d * dial
    return state_at_test_length(summary)["state_bytes"]


def rows(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run; best_lr_by_valid marks the run each (mixer, dial, d_model) point reports."""
    out = []
    for s in summaries:
        mixer, dial = name_and_dial(s)
        state = state_at_test_length(s)
        out.append(result_row(s, mixer) | state | {"dial": dial}
                   | {"paper_state_bytes": paper_state_bytes(s, mixer, dial, state["seq_len"])})
    mark_best_lr(out, ("mixer", "dial", "d_model"))
    order = {m: i for i, m in enumerate(ORDER)}
    return sorted(out, key=lambda r: (order.get(r["mixer"], len(order)), r["d_model"], r["dial"] or 0, r["lr"]))


def points(result_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in result_rows if r["best_lr_by_valid"]]


def _of(pts: list[dict[str, Any]], mixer: str, max_bytes: float = math.inf) -> list[dict[str, Any]]:
    return [p for p in pts if p["mixer"] == mixer and p["paper_state_bytes"] <= max_bytes]


def comparison(result_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The paper's readings of Based Fig. 2 (REFERENCE §1) against our best-lr points."""
    pts = points(result_rows)
    out = []

    def claim(mixer: str, where: str, paper: str, found: list[dict[str, Any]], measure, ok) -> None:
        if not found:
            out.append({"mixer": mixer, "where": where, "paper": paper, "ours": None, "verdict": "not run",
                        "cause": ""})
            return
        ours = measure(found)
        verdict = "matches" if ok(ours) else "differs"
        cause = CLAIM_CAUSES.get((mixer, where), "") if verdict == "differs" else ""
        out.append({"mixer": mixer, "where": where, "paper": paper, "ours": ours, "verdict": verdict, "cause": cause})

    def best(ps):
        return max(p["test_accuracy"] for p in ps)

    def within(low, high):
        return lambda v: low - TOLERANCE <= v <= high + TOLERANCE

    claim("based", "state ≤ 2^14 B", "≈0.55–0.7", _of(pts, "based", 2**14), best, within(0.55, 0.7))
    claim("based", "state ≤ 2^18 B", "≈1.0", _of(pts, "based", 2**18), best, within(1.0, 1.0))
    claim("mamba", "best over d, d_state", "saturates ≈0.9 (near 2^19 B)", _of(pts, "mamba"), best, within(0.9, 0.9))
    small_swa = _of(pts, "sliding_window", 2**19 - 1)
    claim("sliding_window", "state < 2^19 B", "below its plateau: needs ≥ 2^19 B", small_swa, best,
          lambda v: v < 0.9)
    claim("h3", "best over d", "< 0.4", _of(pts, "h3"), best, lambda v: v < 0.4 + TOLERANCE)
    hyena = _of(pts, "hyena")
    claim("hyena", "largest state", "≈0.5 (at 2^22 B)", hyena,
          lambda ps: max(ps, key=lambda p: p["paper_state_bytes"])["test_accuracy"], within(0.5, 0.5))
    claim("attention", "best over d", "≈1.0 (at 2^20–2^21 B)", _of(pts, "attention"), best, within(1.0, 1.0))
    return out


def comparison_table(entries: list[dict[str, Any]]) -> str:
    return markdown_table(COLUMNS, entries)


def paper_points(path: Path = PAPER_POINTS) -> list[dict[str, Any]]:
    """The markers of Based Fig. 2: {"model", "log2_bytes", "accuracy"} each (paper_points.json)."""
    return json.loads(path.read_text())["points"]


def point_comparison(result_rows: list[dict[str, Any]], paper: list[dict[str, Any]] | None = None
                     ) -> list[dict[str, Any]]:
    """Every marker of the paper's figure beside our best-lr point of its model nearest in state: "matches"
    within TOLERANCE + READ_PRECISION, else "ours higher"/"ours lower"; "no point at this state" when our nearest is
    more than STATE_MATCH (log2 bytes) away, "not run" when the model has no run."""
    paper = paper_points() if paper is None else paper
    pts = points(result_rows)
    order = {m: i for i, m in enumerate(ORDER)}
    out = []
    for p in sorted(paper, key=lambda p: (order.get(p["model"], len(order)), p["log2_bytes"], p["accuracy"])):
        entry = {"mixer": p["model"], "paper_state": f"2^{p['log2_bytes']:.2f}", "paper": f"{p['accuracy']:.2f}",
                 "ours_at": None, "ours": None, "diff": None, "verdict": "not run", "cause": ""}
        mine = _of(pts, p["model"])
        if mine:
            near = min(mine, key=lambda q: abs(math.log2(q["paper_state_bytes"]) - p["log2_bytes"]))
            gap = math.log2(near["paper_state_bytes"]) - p["log2_bytes"]
            dial = f", {near['dial']}" if near["dial"] is not None else ""
            entry["ours_at"] = f"2^{math.log2(near['paper_state_bytes']):.2f} (d {near['d_model']}{dial})"
            if abs(gap) > STATE_MATCH:
                entry["verdict"] = "no point at this state"
            else:
                diff = near["test_accuracy"] - p["accuracy"]
                close = abs(round(diff, 3)) <= TOLERANCE + READ_PRECISION
                entry |= {"ours": near["test_accuracy"], "diff": f"{round(diff, 2) + 0.0:+.2f}",
                          "verdict": "matches" if close else ("ours higher" if diff > 0 else "ours lower"),
                          "cause": "" if close else CAUSES.get((p["model"], f"{p['log2_bytes']:.2f}"), "")}
        out.append(entry)
    return out


def frontier(pts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points no point of smaller or equal state beats: ascending state, rising accuracy."""
    out, top = [], -math.inf
    for p in sorted(pts, key=lambda p: (p["paper_state_bytes"], -p["test_accuracy"])):
        if p["test_accuracy"] > top:
            out.append(p)
            top = p["test_accuracy"]
    return out


def plot(result_rows: list[dict[str, Any]], out: Path, checks: list[dict[str, Any]] | None = None) -> Path:
    """The figure; `checks`: result rows of the earlier data setting (CHECKS), drawn as open squares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(result_rows)
    check_pts = points(checks or [])
    paper = paper_points()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, mixer in enumerate(ORDER):
        color = f"C{i}"
        ps = sorted(_of(pts, mixer), key=lambda p: p["paper_state_bytes"])
        if ps:
            ax.plot([p["paper_state_bytes"] for p in ps], [p["test_accuracy"] for p in ps], "o", color=color,
                    label=mixer, alpha=0.8)
        cs = _of(check_pts, mixer)
        if cs:
            ax.plot([p["paper_state_bytes"] for p in cs], [p["test_accuracy"] for p in cs], "s", color=color,
                    markerfacecolor="none", markersize=5, alpha=0.6, label=f"{mixer} (zero filler, checks/)")
        theirs = [p for p in paper if p["model"] == mixer]
        if theirs:  # the paper's markers, open circles in the model's colour
            ax.plot([2 ** p["log2_bytes"] for p in theirs], [p["accuracy"] for p in theirs], "o", color=color,
                    markerfacecolor="none", markersize=8, alpha=0.7, label=f"{mixer} (paper)")
    front = frontier(pts)
    if len(front) > 1:  # one point draws no line: no legend entry for it either
        ax.step([p["paper_state_bytes"] for p in front], [p["test_accuracy"] for p in front], "k--", where="post",
                label="frontier", linewidth=1)
    ax.set_xscale("log", base=2)
    lengths = "/".join(str(L) for L in sorted({p["seq_len"] for p in pts + check_pts})) or "the longest test length"
    ax.set_xlabel(f"recurrent state (bytes, fp32, as Zoology counts it, at L = {lengths})")
    ax.set_ylabel("MQAR test accuracy (best lr by valid)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Based Fig. 2: recall vs state")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "accuracy_vs_state.png"
    atomic_savefig(fig, path, dpi=130)
    plt.close(fig)
    return path


def build(summaries_dir: Path = SUMMARIES, out: Path = HERE, checks_dir: Path | None = CHECKS / "summaries"
          ) -> dict[str, Any]:
    """results.json, the figure and the README's tables of `out` from `summaries_dir` (none yet: every reading
    "not run"), the figure with the runs under `checks_dir` beside them."""
    checks = rows(load_summaries(checks_dir)) if checks_dir is not None and Path(checks_dir).is_dir() else None
    record = build_reproduction(summaries_dir, out, rows, partial(plot, checks=checks), comparison, comparison_table,
                                (START, END), allow_empty=True)
    entries = point_comparison(record["rows"])
    fill_readme_block(out / "README.md", POINTS_START, POINTS_END, markdown_table(POINT_COLUMNS, entries))
    return record | {"points": entries}


def main(argv: list[str]) -> None:
    if argv == ["checks"]:  # the earlier data setting's own results.json, figure and tables
        record = build(CHECKS / "summaries", CHECKS, checks_dir=None)
        print(f"{record['runs']} runs -> {CHECKS.relative_to(HERE)}: results.json, {record['figure']}, README tables")
        return
    reproduction_main(argv, SUMMARIES, collect, build)


if __name__ == "__main__":
    main(sys.argv[1:])
