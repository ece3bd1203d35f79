"""Figures of the Fig. 2 sweep: `python experiments/zoology_fig2/plot.py [runs dir] [out dir]`.

Defaults: runs/zoology_fig2 -> experiments/zoology_fig2/ (accuracy_vs_d_model.png, accuracy_vs_state.png,
summary.json). Pass runs/zoology_fig2_tiny and experiments/zoology_fig2/tiny for the CPU smoke grid.
"""

import sys
from pathlib import Path

from zoo.plot import make_figures


def main(argv: list[str]) -> None:
    here = Path(__file__).resolve().parent
    runs = Path(argv[0]) if argv else Path("runs/zoology_fig2")
    out = Path(argv[1]) if len(argv) > 1 else here
    record = make_figures(runs, out, title="MQAR recall vs state (Zoology Fig. 2 grid)")
    print(f"{record['num_runs']} runs -> {len(record['points'])} points; figures and summary.json in {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
