"""Accuracy against KV memory per arm, from a sweep's eval/results.json; writes tradeoff.png next to it.

python -m experiments.cartridges_tradeoff.plot runs/cartridges_tradeoff/eval/results.json
"""

import json
import re
import sys
from pathlib import Path

from zoo.atomic import atomic_savefig

SERIES = {  # arm-name pattern -> (label, marker)
    r"self_study_(\d+)": ("cartridge, self-study", "o-"),
    r"hard_labels_(\d+)": ("cartridge, hard labels", "s--"),
    r"ntp_(\d+)": ("cartridge, NTP on corpus", "^:"),
    r"truncated_(\d+)": ("truncated context", "x-."),
}


def plot(results_path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results_path = Path(results_path)
    results = json.loads(results_path.read_text())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pattern, (label, style) in SERIES.items():
        points = sorted(
            (r["memory_bytes"], r["accuracy"]) for name, r in results.items() if re.fullmatch(pattern, name)
        )
        if points:
            ax.plot([m / 2**20 for m, _ in points], [a for _, a in points], style, label=label)
    for name, marker in (("icl", "*"), ("none", "v")):
        if name in results:
            r = results[name]
            ax.plot([r["memory_bytes"] / 2**20], [r["accuracy"]], marker, markersize=12, label=name)
    for name, r in results.items():
        if name.startswith("compose"):
            ax.plot([r["memory_bytes"] / 2**20], [r["accuracy"]], "D", label=name.replace("_", " "))
    ax.set_xscale("log")
    ax.set_xlabel("KV cache per sequence (MiB, model dtype)")
    ax.set_ylabel("QA accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out = results_path.with_name("tradeoff.png")
    fig.tight_layout()
    atomic_savefig(fig, out, dpi=150)
    plt.close(fig)
    return out


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/cartridges_tradeoff/eval/results.json")
    if not path.is_file():
        raise SystemExit(f"plot: no eval results at {path} (cartridges-eval's results.json)")
    print(plot(path))
