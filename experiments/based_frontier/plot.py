"""Figures of the Based frontier sweep: `python experiments/based_frontier/plot.py [runs dir] [out dir]`.

Defaults: runs/based_frontier -> experiments/based_frontier/ (accuracy_vs_d_model.png, accuracy_vs_state.png,
summary.json). Pass runs/based_frontier_tiny and experiments/based_frontier/tiny for the CPU smoke grid.
"""

import sys
from pathlib import Path

from zoo.plot import make_figures


def main(argv: list[str]) -> None:
    here = Path(__file__).resolve().parent
    runs = Path(argv[0]) if argv else Path("runs/based_frontier")
    out = Path(argv[1]) if len(argv) > 1 else here
    record = make_figures(runs, out, title="MQAR recall-state frontier (L = 256)")
    print(f"{record['num_runs']} runs -> {len(record['points'])} points; figures and summary.json in {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
