"""results.json (one row per arm), recipe.png and the README's results tables of experiments/cartridges_recipe.

    python -m experiments.cartridges_recipe.plot runs/cartridges_recipe          # a run dir of run.py
    python -m experiments.cartridges_recipe.plot experiments/cartridges_recipe/h200 --readme

A run dir (it holds eval/) is collected into `results.json` first; a directory `run.py --export` wrote holds
`results.json` already. Either way the figure is drawn from `results.json`. With `--readme` the figure is left
as it is, and the table and the targets of that directory replace what stands between its markers in README.md
(`<!-- results:<dir name>:start -->` and `...:end -->`).

A row: arm, kv_tokens, memory_bytes, accuracy, n, n_in_prefix, accuracy_in_prefix, accuracy_outside_prefix;
trained arms add method, the distillation overrides of their arm, the held-out KL before and after training,
the information KL of their data (teacher with chunk vs without: the most distillation could transfer), their
training seconds, steps and examples.
"""

import json
from pathlib import Path

from zoo.atomic import atomic_savefig


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
    from zoo.atomic import atomic_write_text

    out = Path(out)
    results = json.loads((out / "eval" / "results.json").read_text())
    timings = json.loads((out / "timings.json").read_text()) if (out / "timings.json").is_file() else {}
    rows = []
    for arm, r in results.items():
        row = {"arm": arm, **r}
        if (out / f"c_{arm}" / "summary.json").is_file():  # a trained arm (ss_p<p>: self-study at another size)
            summary = json.loads((out / f"c_{arm}" / "summary.json").read_text())
            row.update(
                method=summary["method"],
                lever=ARMS.get(arm, [*ARMS["ss"], f"num_tokens={r['kv_tokens']}"]),
                initial_heldout_kl=summary.get("initial_heldout_kl"),
                final_heldout_kl=summary.get("final_heldout_kl"),
                final_kl=summary.get("final_kl"),
                # NTP trains on the document, not on the conversations
                data_info_kl=None if summary["method"] == "ntp" else data_info_kl(out / "synth_recipe"),
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
    # the first truncated arm is at the run's p (run.py lists it first); ss_p<q> arms are other sizes
    truncated = next((r["accuracy"] for r in rows if r["arm"].startswith("truncated_")), None)
    ss, icl, hard, ntp = acc.get("ss"), acc.get("icl"), acc.get("hard_labels"), acc.get("ntp")
    at_p = [r for r in rows if r["arm"].startswith("ss") and not r["arm"].startswith("ss_p")]
    best = max(at_p, key=lambda r: r["accuracy"], default=None)
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
    atomic_savefig(fig, path, dpi=130)
    plt.close(fig)
    return path


def results_table(rows: list[dict]) -> str:
    """The README's table of one run: accuracy, the part outside the first p tokens, and the KLs per arm."""
    from zoo.plot import markdown_table

    def kl(r: dict) -> str | None:
        a, b = r.get("initial_heldout_kl"), r.get("final_heldout_kl")
        return None if a is None or b is None else f"{a:.3f} → {b:.3f}"

    entries = [
        {"arm": f"`{r['arm']}`", "kv": r["kv_tokens"], "acc": r["accuracy"],
         "outside": r.get("accuracy_outside_prefix"), "kl": kl(r), "info": r.get("data_info_kl"),
         "steps": r.get("steps")}
        for r in rows
    ]  # fmt: skip
    columns = [("arm", "arm"), ("KV tokens", "kv"), ("accuracy", "acc"),
               ("accuracy, answer outside the first p tokens", "outside"), ("held-out KL start → end", "kl"),
               ("information KL of its data", "info"), ("steps", "steps")]  # fmt: skip
    return markdown_table(columns, entries)


def targets_line(t: dict) -> str:
    """The issue's targets on one run, in words."""

    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else "met" if ok else "unmet"

    def ratio(x: float | None, digits: int) -> str:
        return "—" if x is None else f"{x:.{digits}f}"  # None: the denominator scored 0 or is missing

    parts = [
        f"ss / truncated {ratio(t['ss_over_truncated'], 1)}× (≥ 2×: {verdict(t['ss_2x_truncated'])})",
        f"ss / ICL {ratio(t['ss_over_icl'], 2)} (≥ 0.7: {verdict(t['ss_70pct_icl'])})",
        f"ss > hard_labels > ntp: {verdict(t['ss_gt_hard_gt_ntp'])}",
    ]
    if t.get("best_self_study_arm"):
        parts.append(f"best self-study arm `{t['best_self_study_arm']}` {t['best_self_study_accuracy']:.3f}")
    return "Targets: " + "; ".join(parts) + "."


README = Path(__file__).resolve().parent / "README.md"


def fill_readme(run_dir: str | Path, readme: Path = README) -> None:
    """Replace the block between `run_dir`'s markers in README.md with its table and targets line."""
    from zoo.plot import fill_readme_block

    run_dir = Path(run_dir)
    rows = json.loads((run_dir / "results.json").read_text())
    block = f"{results_table(rows)}\n\n{targets_line(targets(rows))}"
    name = run_dir.name
    fill_readme_block(readme, f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->", block)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", default="runs/cartridges_recipe")
    p.add_argument("--readme", action="store_true", help="fill this directory's block of README.md, not the figure")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if (run_dir / "eval" / "results.json").is_file():
        collect(run_dir)
    elif not (run_dir / "results.json").is_file():
        raise SystemExit(f"{run_dir}: neither a run dir (eval/results.json) nor an export (results.json)")
    rows = json.loads((run_dir / "results.json").read_text())
    print(json.dumps(targets(rows)))
    if args.readme:
        fill_readme(run_dir)
        print(README)
    else:
        print(plot(run_dir))


if __name__ == "__main__":
    main()
