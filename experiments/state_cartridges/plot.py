"""Accuracy against bytes per arm, from a run's summary.json; writes accuracy_vs_bytes.png next to it.

python -m experiments.state_cartridges.plot runs/state_cartridges/summary.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zoo.atomic import atomic_savefig

STYLE = {  # arm prefix -> (marker, label)
    "icl": ("*", "ICL (corpus in context)"),
    "none": ("v", "no corpus"),
    "prefill": ("s", "prefilled state / first-p KV"),
    "self_study": ("o", "trained by self-study"),
}
COLORS = {"based": "tab:blue", "attention": "tab:orange"}


def plot(summary_path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary_path = Path(summary_path)
    results = json.loads(summary_path.read_text())["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    seen = set()
    labels: dict[tuple[str, float, float], list[str]] = {}  # arms at the same point share one label
    for r in results.values():
        labels.setdefault((r["model"], r["bytes_fp32"], round(r["accuracy"], 4)), []).append(r["arm"])
    for (model, nbytes, acc), arms in labels.items():
        ax.annotate(", ".join(arms), (nbytes / 1024, acc), fontsize=7, xytext=(4, 4), textcoords="offset points",
                    color=COLORS[model])  # fmt: skip
    for r in results.values():
        kind = next(k for k in STYLE if r["arm"].startswith(k))
        marker, label = STYLE[kind]
        legend = f"{r['model']}: {label}"
        ax.scatter(
            r["bytes_fp32"] / 1024,
            r["accuracy"],
            marker=marker,
            s=90,
            color=COLORS[r["model"]],
            label=None if legend in seen else legend,
        )
        seen.add(legend)
    ax.set_xscale("log")
    ax.set_xlabel("state / KV per sequence (KiB at fp32)")
    ax.set_ylabel("QA accuracy on unseen fact sheets")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    out = summary_path.with_name("accuracy_vs_bytes.png")
    fig.tight_layout()
    atomic_savefig(fig, out, dpi=150)
    plt.close(fig)
    return out


def table(summary: dict) -> str:
    lines = [f"{'model/arm':<32}{'tokens':>8}{'KiB fp32':>10}{'accuracy':>10}{'n':>5}"]
    for name, r in summary["results"].items():
        lines.append(f"{name:<32}{r['tokens']:>8}{r['bytes_fp32'] / 1024:>10.1f}{r['accuracy']:>10.3f}{r['n']:>5}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(plot(sys.argv[1] if len(sys.argv) > 1 else "runs/state_cartridges/summary.json"))
