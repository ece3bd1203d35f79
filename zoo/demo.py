"""The README's main job (`make demo`): train Based and attention on a small MQAR preset, print a table.

Runs on a CPU in a few minutes; each model writes its own run dir under runs/demo/.
"""

import json
import logging
import sys
import time

from zoo.train import ConfigError, load_config, train

MODELS = ("based", "attention")


def main(argv: list[str] | None = None) -> None:
    extra = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    t0 = time.perf_counter()
    for model in MODELS:
        try:
            cfg, resolved = load_config(["+experiment=demo", f"model={model}", "train.overwrite=true", *extra])
        except ConfigError as e:
            print(f"zoo demo: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        rows.append((model, train(cfg, resolved)))
    total = time.perf_counter() - t0

    print()
    header = ("mixer", "valid acc", "test acc", "state (fp32 bytes)", "params", "epochs", "time")
    print("{:<11} {:>9} {:>8} {:>18} {:>8} {:>6} {:>7}".format(*header))
    for model, s in rows:
        print(
            f"{model:<11} {s['valid/accuracy']:>9.3f} {s['test/accuracy']:>8.3f} {s['state_bytes_fp32']:>18,d} "
            f"{s['parameters']:>8,d} {s['epochs']:>6d} {s['wall_time_s']:>6.1f}s"
        )
    seq_len = rows[0][1]["state_bytes_seq_len"]
    print(f"state size at seq_len={seq_len}; per-slice test accuracy in runs/demo/*/summary.json")
    print(f"total {total:.1f}s")
    print(json.dumps({m: {"valid_accuracy": s["valid/accuracy"], "test_accuracy": s["test/accuracy"],
                          "state_bytes_fp32": s["state_bytes_fp32"], "wall_time_s": s["wall_time_s"]}
                      for m, s in rows} | {"total_s": total}))


if __name__ == "__main__":
    main()
