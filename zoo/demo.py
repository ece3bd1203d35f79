"""The README's main job (`make demo`): train Based and attention on a small MQAR preset, print a table.

Each model writes its own run dir under runs/demo/. The numbers are a function of the code alone: data, init
and batch order are seeded, and the preset trains on one CPU thread (`experiment/demo.yaml`), so the table
does not depend on the machine's core count. `table(rows)` is the block that README.md shows; a test reruns
the demo and compares (tests/test_readme.py).

    python -m zoo.demo                      # the table, then its times, then one line of JSON
    python -m zoo.demo train.device=cpu     # extra overrides go to both runs
"""

import json
import logging
import sys
import time

MODELS = ("based", "attention")
HEADER = ("mixer", "valid acc", "test acc", "state (fp32 bytes)", "params", "epochs")


def run(extra: list[str] = ()) -> list[tuple[str, dict]]:
    """Train every model of the demo; (model, summary) per model."""
    from zoo.device import set_threads
    from zoo.train import load_config, train

    rows = []
    for model in MODELS:
        cfg, resolved = load_config(["+experiment=demo", f"model={model}", "train.overwrite=true", *extra])
        set_threads(cfg.train.threads)
        rows.append((model, train(cfg, resolved)))
    return rows


def table(rows: list[tuple[str, dict]]) -> str:
    """The README's table: accuracies, state size, parameters and epochs per model (no times: they vary)."""
    lines = ["{:<11} {:>9} {:>8} {:>18} {:>8} {:>6}".format(*HEADER)]
    for model, s in rows:
        lines.append(
            f"{model:<11} {s['valid/accuracy']:>9.3f} {s['test/accuracy']:>8.3f} {s['state_bytes_fp32']:>18,d} "
            f"{s['parameters']:>8,d} {s['epochs']:>6d}"
        )
    seq_len = rows[0][1]["state_bytes_seq_len"]
    lines.append(f"state size at seq_len={seq_len}; per-slice test accuracy in runs/demo/*/summary.json")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from zoo.config import ConfigError

    extra = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    try:
        rows = run(extra)
    except ConfigError as e:
        print(f"zoo demo: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    total = time.perf_counter() - t0
    print()
    print(table(rows))
    print("training time: " + ", ".join(f"{m} {s['wall_time_s']:.1f} s" for m, s in rows) + f"; total {total:.1f} s")
    print(json.dumps({m: {"valid_accuracy": s["valid/accuracy"], "test_accuracy": s["test/accuracy"],
                          "state_bytes_fp32": s["state_bytes_fp32"], "wall_time_s": s["wall_time_s"]}
                      for m, s in rows} | {"total_s": total}))


if __name__ == "__main__":
    main()
