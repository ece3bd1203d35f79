"""results.json (one row per arm) and recipe.png from a run dir of experiments/cartridges_recipe/run.py.

python -m experiments.cartridges_recipe.plot runs/cartridges_recipe

A row: arm, kv_tokens, memory_bytes, accuracy, n, n_in_prefix, accuracy_in_prefix, accuracy_outside_prefix;
trained arms add method, the distillation overrides of their lever, the held-out KL before and after training,
the information KL of their data (teacher with chunk vs without: the most distillation could transfer) and
their training seconds.
"""

import json
import sys
from pathlib import Path


def data_info_kl(data: Path) -> float | None:
    """Token-weighted information KL of a synthesis output: its summary.json, else its dataset's column."""
    if (data / "summary.json").is_file():
        return json.loads((data / "summary.json").read_text()).get("info_kl")
    if not (data / "dataset").is_dir():
        return None
    import datasets

    ds = datasets.load_from_disk(str(data / "dataset"))
    if "info_kl" not in ds.column_names:
        return None
    pairs = [(k, len(t)) for k, t in zip(ds["info_kl"], ds["top_ids"])]
    n = sum(w for _, w in pairs)
    return sum(k * w for k, w in pairs) / n if n else None


def collect(out: str | Path) -> list[dict]:
    """The rows of a run dir, written to `<out>/results.json`."""
    from experiments.cartridges_recipe.run import ARMS
    from zoo.runs import atomic_write_text

    out = Path(out)
    results = json.loads((out / "eval" / "results.json").read_text())
    timings = json.loads((out / "timings.json").read_text()) if (out / "timings.json").is_file() else {}
    data_dirs = {"recipe": out / "synth_recipe", "paper": out / "synth_paper", "few": out / "data_few"}
    rows = []
    for arm, r in results.items():
        row = {"arm": arm, **r}
        if arm in ARMS:
            kind, overrides = ARMS[arm]
            summary = json.loads((out / f"c_{arm}" / "summary.json").read_text())
            row.update(
                method=summary["method"],
                lever=overrides,
                initial_heldout_kl=summary.get("initial_heldout_kl"),
                final_heldout_kl=summary.get("final_heldout_kl"),
                final_kl=summary.get("final_kl"),
                data_info_kl=data_info_kl(data_dirs[kind]) if kind in data_dirs else None,
                train_s=timings.get(f"distill/{arm}"),
                steps=summary["steps"],
                examples=summary["examples"],
            )
        rows.append(row)
    atomic_write_text(out / "results.json", json.dumps(rows, indent=1))
    return rows


def targets(rows: list[dict]) -> dict:
    """The issue's targets on this run: ss ≥ 2× truncated of equal memory and ≥ 0.7× ICL; ss > hard > ntp."""
    acc = {r["arm"]: r["accuracy"] for r in rows}
    truncated = next((r["accuracy"] for r in rows if r["arm"].startswith("truncated_")), None)
    ss, icl, hard, ntp = acc.get("ss"), acc.get("icl"), acc.get("hard_labels"), acc.get("ntp")
    best = max((r for r in rows if r["arm"].startswith("ss")), key=lambda r: r["accuracy"], default=None)
    ratio = lambda a, b: None if a is None or not b else a / b  # noqa: E731
    return {
        "ss_over_truncated": ratio(ss, truncated),
        "ss_over_icl": ratio(ss, icl),
        "ss_2x_truncated": None if ss is None or truncated is None else ss > 0 and ss >= 2 * truncated,
        "ss_70pct_icl": None if ss is None or icl is None else ss > 0 and ss >= 0.7 * icl,
        "ss_gt_hard_gt_ntp": None if None in (ss, hard, ntp) else ss > hard > ntp,
        "best_self_study_arm": best and best["arm"],
        "best_self_study_accuracy": best and best["accuracy"],
    }


def plot(out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    rows = json.loads((out / "results.json").read_text())
    fig, (ax, kx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    names = [r["arm"] for r in rows]
    y = range(len(rows))
    ax.barh(y, [r["accuracy"] for r in rows], color="#4c72b0", label="all questions")
    outside = [r.get("accuracy_outside_prefix") for r in rows]
    ax.plot([o if o is not None else float("nan") for o in outside], list(y), "o", color="#dd8452",
            label="answer outside the first p tokens")  # fmt: skip
    ax.set_yticks(list(y), [f"{n} ({r['kv_tokens']} tok)" for n, r in zip(names, rows)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("QA accuracy")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    trained = [r for r in rows if r.get("method")]
    ky = range(len(trained))
    kx.barh(ky, [r.get("initial_heldout_kl") or 0 for r in trained], color="#cccccc", label="held-out KL at init")
    kx.barh(ky, [r.get("final_heldout_kl") or 0 for r in trained], color="#55a868", height=0.5,
            label="after training")  # fmt: skip
    kx.set_yticks(list(ky), [r["arm"] for r in trained], fontsize=8)
    kx.invert_yaxis()
    kx.set_xlabel("KL to the teacher on held-out conversations (nats/token)")
    kx.grid(axis="x", alpha=0.3)
    kx.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = out / "recipe.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


if __name__ == "__main__":
    run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/cartridges_recipe"
    print(json.dumps(targets(collect(run_dir))))
    print(plot(run_dir))
