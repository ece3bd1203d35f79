"""`zoo-plot <runs dir>`: the recall figures from run directories (never from a tracker).

    zoo-plot runs/zoology_fig2                   # writes the PNGs and summary.json into runs/zoology_fig2
    zoo-plot runs/zoology_fig2 --out experiments/zoology_fig2

Every finished run below the directory (summary.json present) is one (mixer, d_model, lr) result. A point is
a (mixer, d_model, state size) group; its learning rate is the one with the best validation accuracy (model
selection on the validation split), and the point reports that run's test accuracy. Figures:

- `accuracy_vs_state.png`: test accuracy against recurrent state in bytes at fp32 (4 × `state_size` at the
  longest training length), one series per mixer, and the frontier: the best accuracy reached at or below
  each state size, over all mixers. One panel per training length, each titled with it.
- `accuracy_vs_d_model.png`: test accuracy against d_model, one panel per test sequence length.

`summary.json` beside them holds every point, the frontier and the runs they came from.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from zoo.atomic import atomic_savefig, atomic_write_text
from zoo.runs import find_runs, summary_point_key

SELECT = "valid/accuracy"
REPORT = "test/accuracy"


def mixer_label(summary: dict[str, Any]) -> str:
    """The mixers of a run in pattern order, e.g. 'base_conv+based'."""
    return "+".join(dict.fromkeys(summary["layers"]))


def collect(root: str | Path) -> list[dict[str, Any]]:
    """Summaries of the finished runs below root, each with its run dir added."""
    out = []
    for run in find_runs(root):
        if run.is_finished():
            out.append(run.read_summary() | {"run_dir": str(run.path)})
    return out


def best_lr_points(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per (mixer, d_model, state bytes, training length, experiment): the lr with the best validation
    accuracy. The training length is part of the key because a constant-state mixer has the same state at
    every length, and runs trained at different lengths must not compete."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for s in summaries:
        key = (
            mixer_label(s),
            s["d_model"],
            s["state_bytes_fp32"],
            s.get("state_bytes_seq_len", 0),
            s.get("experiment"),
        )
        groups[key].append(s)
    points = []
    for (mixer, d_model, state_bytes, train_len, _), runs in sorted(groups.items(), key=lambda kv: kv[0][:4]):
        best = max(runs, key=lambda s: (s.get(SELECT, -1.0), -s["lr"]))
        slices = {k[len(REPORT) + 1 :]: v for k, v in best.items() if k.startswith(REPORT + "/")}
        points.append(
            {
                "mixer": mixer,
                "d_model": d_model,
                "state_bytes_fp32": state_bytes,
                "train_seq_len": train_len,
                "lr": best["lr"],
                "valid_accuracy": best.get(SELECT),
                "test_accuracy": best.get(REPORT),
                "test_slices": slices,
                "lrs_tried": sorted(s["lr"] for s in runs),
                "run_dir": best["run_dir"],
            }
        )
    return points


def frontier(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per training length, the points not beaten by any point with a smaller or equal state: ascending state,
    rising accuracy. Lengths have separate frontiers: a state that recalls at L=32 says nothing about L=64."""
    out = []
    for L in train_lengths(points):
        best = -math.inf
        mine = [p for p in points if p.get("train_seq_len", 0) == L]
        for p in sorted(mine, key=lambda p: (p["state_bytes_fp32"], -(p["test_accuracy"] or 0.0))):
            acc = p["test_accuracy"] if p["test_accuracy"] is not None else -math.inf
            if acc > best:
                out.append(
                    {
                        "mixer": p["mixer"],
                        "d_model": p["d_model"],
                        "state_bytes_fp32": p["state_bytes_fp32"],
                        "train_seq_len": L,
                        "test_accuracy": acc,
                    }
                )
                best = acc
    return out


def train_lengths(points: list[dict[str, Any]]) -> list[int]:
    """The training lengths of the points (0 for summaries that do not record one)."""
    return sorted({p.get("train_seq_len", 0) for p in points})


def seq_lens(points: list[dict[str, Any]]) -> list[int]:
    lengths = set()
    for p in points:
        for key in p["test_slices"]:
            m = re.fullmatch(r"seq_len=(\d+)", key)
            if m:
                lengths.add(int(m.group(1)))
    return sorted(lengths)


def plot(points: list[dict[str, Any]], front: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_mixer: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        by_mixer[p["mixer"]].append(p)
    paths = []

    # One panel per training length: the state of attention grows with L, and a point trained at L=32 must not
    # sit on the same axes as one trained at L=64 unlabelled.
    trained = train_lengths(points)
    fig, axes = plt.subplots(1, len(trained), figsize=(6.5 * len(trained), 4.5), squeeze=False)
    colors = {mixer: f"C{i}" for i, mixer in enumerate(sorted(by_mixer))}
    for ax, L in zip(axes[0], trained):
        for mixer, ps in sorted(by_mixer.items()):
            ps = sorted((p for p in ps if p.get("train_seq_len", 0) == L), key=lambda p: p["state_bytes_fp32"])
            if ps:
                xs, ys = [p["state_bytes_fp32"] for p in ps], [p["test_accuracy"] for p in ps]
                ax.plot(xs, ys, "o-", label=mixer, alpha=0.8, color=colors[mixer])
        mine = [f for f in front if f.get("train_seq_len", 0) == L]
        if mine:
            ax.step(
                [f["state_bytes_fp32"] for f in mine],
                [f["test_accuracy"] for f in mine],
                "k--",
                where="post",
                label="frontier",
                linewidth=1,
            )
        ax.set_xscale("log")
        ax.set_xlabel(f"recurrent state at L = {L} (bytes, fp32)" if L else "recurrent state (bytes, fp32)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{title}, trained at L = {L}" if L and len(trained) > 1 else title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("test accuracy (best lr by valid)")
    fig.tight_layout()
    paths.append(out / "accuracy_vs_state.png")
    atomic_savefig(fig, paths[-1], dpi=130)
    plt.close(fig)

    lengths = seq_lens(points) or [None]
    fig, axes = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 3.8), squeeze=False)
    for ax, L in zip(axes[0], lengths):
        key = f"seq_len={L}"
        for mixer, ps in sorted(by_mixer.items()):
            # Best point per d_model for this length (several state sizes can share a d_model).
            best: dict[int, float] = {}
            for p in ps:
                # A point tested without this length has nothing to say about its panel.
                acc = p["test_slices"].get(key) if L is not None else p["test_accuracy"]
                if acc is not None:
                    best[p["d_model"]] = max(best.get(p["d_model"], -1.0), acc)
            ds = sorted(best)
            ax.plot(ds, [best[d] for d in ds], "o-", label=mixer, alpha=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_model")
        ax.set_title(f"L = {L}" if L is not None else "all lengths")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "accuracy_vs_d_model.png")
    atomic_savefig(fig, paths[-1], dpi=130)
    plt.close(fig)
    return paths


def make_figures(root: str | Path, out: str | Path | None = None, title: str | None = None) -> dict[str, Any]:
    """Collect, select, plot; write summary.json next to the PNGs and return it."""
    root = Path(root)
    out = Path(out) if out is not None else root
    summaries = collect(root)
    if not summaries:
        raise ValueError(f"no finished runs (summary.json) below {root}")
    points = best_lr_points(summaries)
    front = frontier(points)
    out.mkdir(parents=True, exist_ok=True)
    figures = plot(points, front, out, title or root.name)
    record = {
        "runs_dir": str(root),
        "num_runs": len(summaries),
        "selection": SELECT,
        "reported": REPORT,
        "points": points,
        "frontier": front,
        "figures": [p.name for p in figures],
    }
    atomic_write_text(out / "summary.json", json.dumps(record, indent=1) + "\n")
    return record


def learning_curve(metrics: list[dict[str, Any]]) -> dict[str, list]:
    """A run's metrics.jsonl as one row per evaluation: the epoch, the step, valid accuracy and loss, and the mean of
    the training losses logged since the previous evaluation (None where none was). Small enough to commit with the
    summary, and what tells a run that never learned from one that memorised its training set (training loss
    falling while validation loss rises)."""
    curve: dict[str, list] = {"epoch": [], "step": [], "train_loss": [], "valid_loss": [], "valid_accuracy": []}
    pending: list[float] = []
    for record in metrics:
        if "train/loss" in record:
            pending.append(record["train/loss"])
        if "valid/accuracy" in record:
            curve["epoch"].append(record.get("epoch"))
            curve["step"].append(record.get("step"))
            curve["train_loss"].append(round(sum(pending) / len(pending), 5) if pending else None)
            curve["valid_loss"].append(round(record["valid/loss"], 5) if "valid/loss" in record else None)
            curve["valid_accuracy"].append(round(record["valid/accuracy"], 5))
            pending = []
    return curve


def copy_summaries(runs_dir: str | Path, out: Path) -> int:
    """Copy each finished run's summary.json, with its resolved model config under "model", its data, optimiser
    and training settings under "setup" (`zoo.runs.training_setup`) and its learning curve under "curve"
    (`learning_curve`), to out/<run>.json (the data a reproduction commits); returns the count. A summary already
    in `out` under another name for the same run (`zoo.runs.summary_point_key`) is replaced, as one under the same
    name is: the runs dir holds the newer result."""
    import yaml

    from zoo.runs import training_setup
    from zoo.train import EXECUTION_KEYS

    out.mkdir(parents=True, exist_ok=True)
    existing = {summary_point_key(json.loads(p.read_text())): p for p in sorted(out.glob("*.json"))}
    count = 0
    for run in find_runs(runs_dir):
        if not run.is_finished():
            continue
        summary = run.read_summary()
        config = yaml.safe_load((run.path / "config.yaml").read_text()) or {}
        record = summary | {"model": config.get("model", {}), "setup": training_setup(config, EXECUTION_KEYS["train"]),
                            "curve": learning_curve(run.read_metrics())}
        target, key = out / f"{summary['run']}.json", summary_point_key(record)
        atomic_write_text(target, json.dumps(record, indent=1, sort_keys=True) + "\n")
        old = existing.get(key)
        if old is not None and old != target:
            old.unlink(missing_ok=True)
            print(f"replaced {old.name} (the same run under its earlier name)", file=sys.stderr)
        existing[key] = target
        count += 1
    return count


def load_summaries(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def result_row(summary: dict[str, Any], mixer: str) -> dict[str, Any]:
    """One run of a reproduction's results.json: its model, length, lr, epochs, state and accuracies."""
    return {
        "mixer": mixer,
        "d_model": summary["d_model"],
        "seq_len": summary["state_bytes_seq_len"],
        "lr": summary["lr"],
        "epochs": summary["epochs"],
        "state_bytes": summary["state_bytes_fp32"],
        "valid_accuracy": summary.get("valid/accuracy"),
        "test_accuracy": summary.get("test/accuracy"),
        "test_accuracy_by_slice": {
            k[len("test/accuracy/") :]: v for k, v in summary.items() if k.startswith("test/accuracy/")
        },
        "parameters": summary.get("parameters"),
        "stopped_early": summary.get("stopped_early"),
        "stopped_by_pack": summary.get("stopped_by_pack", False),
        "run": summary["run"],
    }


def mark_best_lr(rows: list[dict[str, Any]], point: tuple[str, ...]) -> None:
    """Set best_lr_by_valid on the run each point (rows equal in the `point` fields) reports: the highest valid
    accuracy, ties to the smaller lr."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[tuple(r[k] for k in point)].append(r)
    for group in groups.values():
        best = max(group, key=lambda r: (r["valid_accuracy"] if r["valid_accuracy"] is not None else -1.0, -r["lr"]))
        for r in group:
            r["best_lr_by_valid"] = r is best


def fill_readme_block(readme: Path, start: str, end: str, block: str) -> None:
    """Replace what lies between the `start` and `end` markers of `readme` with `block` (atomically)."""
    from zoo.atomic import atomic_write_text

    text = readme.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{readme} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    atomic_write_text(readme, f"{head}{start}\n{block}\n{end}{tail}")


def markdown_table(columns: list[tuple[str, str]], entries: list[dict[str, Any]]) -> str:
    """A reproduction's comparison as markdown: `columns` are (header, entry key); None prints as "—" and a
    float (an accuracy) with three decimals."""

    def cell(value: Any) -> str:
        return "—" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(e[key]) for _, key in columns) + " |" for e in entries]
    return "\n".join(lines)


def build_reproduction(summaries_dir: Path, out: Path, rows, plot, comparison, table, markers: tuple[str, str],
                       allow_empty: bool = False) -> dict[str, Any]:
    """A reproduction's build step: its committed summaries -> results.json, its figure and the comparison block
    between `markers` in its README.md; the record it returns holds the rows too, for a further block. `rows`,
    `plot`, `comparison` and `table` are the experiment's own: summaries -> result rows, (rows, out) -> the figure's
    path, rows -> entries, entries -> a markdown table. `allow_empty`: a reproduction with no run yet still builds
    (empty rows, every reading "not run") instead of stopping."""
    from zoo.atomic import atomic_write_text

    summaries = load_summaries(summaries_dir) if Path(summaries_dir).is_dir() else []
    if not summaries and not allow_empty:
        raise SystemExit(f"no summaries in {summaries_dir}: run `plot.py collect <runs dir>` first")
    result_rows = rows(summaries)
    atomic_write_text(out / "results.json", json.dumps({"rows": result_rows}, indent=1) + "\n")
    figure = plot(result_rows, out)
    entries = comparison(result_rows)
    fill_readme_block(out / "README.md", *markers, table(entries))
    return {"runs": len(result_rows), "rows": result_rows, "figure": figure.name, "comparison": entries}


def reproduction_main(argv: list[str], summaries_dir: Path, collect, build) -> None:
    """A reproduction's plot.py command line: `collect <runs dir>` copies summaries, no argument builds."""
    if argv[:1] == ["collect"]:
        if len(argv) != 2:
            raise SystemExit("usage: plot.py collect <runs dir>")
        if not Path(argv[1]).is_dir():
            raise SystemExit(f"plot.py collect: no runs dir at {argv[1]}")
        print(f"{collect(Path(argv[1]))} summaries -> {summaries_dir}")
        return
    if argv:
        raise SystemExit("usage: plot.py [collect <runs dir>]")
    record = build()
    verdicts: dict[str, int] = defaultdict(int)
    for e in record["comparison"]:
        verdicts[e["verdict"]] += 1
    print(f"{record['runs']} runs -> results.json, {record['figure']}, README table ({dict(verdicts)})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zoo-plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir")
    parser.add_argument("--out", default=None, help="where the PNGs and summary.json go (default: runs_dir)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        record = make_figures(args.runs_dir, args.out, args.title)
    except ValueError as e:
        raise SystemExit(f"zoo-plot: error: {e}") from None
    out = Path(args.out or args.runs_dir)
    print(
        f"zoo-plot: {record['num_runs']} runs -> {len(record['points'])} points, "
        f"{len(record['frontier'])} on the frontier; wrote {', '.join(record['figures'])} and summary.json to {out}"
    )


if __name__ == "__main__":
    main()
