"""Accuracy vs KV memory on the Quellmere gazetteer: ICL, truncated context, no context, and cartridges trained by
self-study, hard labels and NTP at several sizes; plus two composed cartridges (one per half of the document).

Every stage writes into `--out` and is skipped when its output exists, so an interrupted sweep continues:

    out/ss/                      self-study on the whole document (cartridges-synthesize)
    out/ss_part{1,2}/            self-study on each half (composition)
    out/c{p}_{method}/           one cartridge per size and method (cartridges-distill)
    out/compose/part{1,2}/       one cartridge per half, size --compose-size
    out/eval/results.json        every arm (eval.py), then plot.py draws tradeoff.png

The H200 run (default sizes 64..1024, all methods) is the README command. `--quick` is a CPU smoke run of the
same pipeline: a few conversations, one size, a few steps, a few questions.

Several GPUs: run one process per GPU on the same `--out`, each with its share of `--methods` and `--no-eval`,
then once more without `--no-eval` (every stage is found done; it evaluates). Cartridges that need no
synthetic data (NTP) train first; a process that needs a self-study dataset another process is writing waits
for it (`--wait-synth`). `--eval-existing` evaluates the cartridges found so far and lists the missing ones.
"""

import argparse
import json
import logging
import os
import time
from pathlib import Path

from zoo.atomic import atomic_write_text

HERE = Path(__file__).resolve().parent
SIZES = [64, 128, 256, 512, 1024]
METHODS = ["self_study", "hard_labels", "ntp"]
SPLIT_AT = "## 11."  # the second half of the document starts at this section


def split_document(out: Path) -> tuple[Path, Path]:
    text = (HERE / "document.md").read_text()
    cut = text.index(SPLIT_AT)
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    a, b = parts / "part1.md", parts / "part2.md"
    a.write_text(text[:cut])
    b.write_text(text[cut:])
    return a, b


def _alive(lock: Path) -> bool:
    """Whether the process whose pid `lock` holds is running (a killed writer leaves a stale lock)."""
    try:
        os.kill(int(lock.read_text()), 0)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/cartridges_tradeoff")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    p.add_argument("--methods", nargs="*", default=METHODS, choices=METHODS, help="none: composition only")
    p.add_argument("--conversations", type=int, default=2048)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--pack-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4, help="packed rows per distillation step")
    p.add_argument("--synth-batch", type=int, default=64)
    p.add_argument("--compose-size", type=int, default=256, help="0 skips the composition arm")
    p.add_argument("--compose-conversations", type=int, default=0,
                   help="self-study conversations per half for composition (0: half of --conversations)")
    p.add_argument("--no-eval", action="store_true", help="train only (another process evaluates)")
    p.add_argument("--eval-existing", action="store_true",
                   help="evaluate the cartridges trained so far instead of training the missing ones")
    p.add_argument("--wait-synth", type=float, default=900.0,
                   help="seconds to wait for a self-study dataset another process is writing")
    p.add_argument("--questions", type=int, default=0, help="first N questions only (0: all)")
    p.add_argument("--device", default="auto")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: overrides sizes, counts and steps")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.conversations, args.steps, args.synth_batch = [64], 16, 8, 8
        args.pack_len, args.batch_size, args.compose_size, args.questions = 512, 1, 0, args.questions or 8

    from cartridges import distill, self_study
    from cartridges import eval as ceval
    from cartridges.config import load_config
    from zoo.device import resolve_device
    from zoo.pretrained import load_model, parse_dtype

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    dtype = parse_dtype("bf16" if device.type == "cuda" else "fp32")
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    doc = HERE / "document.md"
    common = [f"model={args.model}", f"device={args.device}"]
    user_tokens, answer_tokens, chunk_max = (48, 64, 768) if args.quick else (96, 256, 2048)
    synth_common = [
        *common,
        "corpus.min_tokens=512",
        f"corpus.max_tokens={chunk_max}",
        f"max_user_tokens={user_tokens}",
        f"max_answer_tokens={answer_tokens}",
        f"batch_size={args.synth_batch}",
    ]
    timings = {}

    def synth(name: str, corpus: Path, n: int) -> Path:
        target = out / name
        lock = out / f".{name}.synthesizing"  # holds the writer's pid
        deadline = time.time() + args.wait_synth
        while not (target / "dataset").is_dir() and _alive(lock) and time.time() < deadline:
            time.sleep(5)  # another process of this sweep is writing it
        if not (target / "dataset").is_dir():
            lock.write_text(str(os.getpid()))
            try:
                _synthesize(name, corpus, n, target)
            finally:
                lock.unlink(missing_ok=True)
        return target

    def _synthesize(name: str, corpus: Path, n: int, target: Path) -> None:
        cfg, _ = load_config(
            "synthesize", [*synth_common, f"corpus.path={corpus}", f"output={target}", f"num_conversations={n}"]
        )
        t0 = time.time()
        self_study.synthesize(cfg, model, tokenizer)
        timings[f"synthesize/{name}"] = time.time() - t0

    def train(name: str, corpus: Path, data, size: int, method: str) -> Path:
        """The cartridge `name`; `data` is the self-study dir or a callable giving it (synthesized when first
        needed)."""
        target = out / name
        if not (target / "cartridge.safetensors").is_file() and not args.eval_existing:
            # NTP trains on the document itself; the other methods on a self-study set
            data = out / "ss" if method == "ntp" else data() if callable(data) else data
            cfg, _ = load_config(
                "distill",
                [
                    *common,
                    f"corpus.path={corpus}",
                    f"data={data}",
                    f"output={target}",
                    f"num_tokens={size}",
                    f"method={method}",
                    f"steps={args.steps}",
                    f"pack_len={args.pack_len}",
                    f"batch_size={args.batch_size}",
                    "corpus.min_tokens=256",
                    "corpus.max_tokens=1024",
                    f"log_every={max(1, args.steps // 20)}",
                    f"checkpoint_every={max(1, args.steps // 4)}",
                    f"resume={(target / 'ckpt' / 'state.pt').is_file()}",
                ],
            )
            t0 = time.time()
            distill.distill(cfg, model, tokenizer)
            timings[f"distill/{name}"] = time.time() - t0
        return target / "cartridge.safetensors"

    def ss() -> Path:
        return synth("ss", doc, args.conversations)

    cartridges = {}
    # NTP needs no synthetic data: it trains first, while another process may be writing the self-study set.
    for method in sorted(args.methods, key=lambda m: m != "ntp"):
        for size in args.sizes:
            cartridges[f"{method}_{size}"] = train(f"c{size}_{method}", doc, ss, size, method)
    if args.compose_size:
        part1, part2 = split_document(out)
        halves = []
        n_half = args.compose_conversations or args.conversations // 2
        for i, part in enumerate((part1, part2), start=1):
            halves.append(
                train(
                    f"compose/part{i}", part, lambda i=i, part=part: synth(f"ss_part{i}", part, n_half),
                    args.compose_size, "self_study",
                )
            )
        from cartridges.cache import Cartridge

        composed = out / "compose" / "composed.safetensors"
        if not composed.is_file() and all(h.is_file() for h in halves):
            Cartridge.concat([Cartridge.load(h, model) for h in halves]).save(composed)
        cartridges[f"compose_2x{args.compose_size}"] = composed
        cartridges[f"part1_only_{args.compose_size}"] = halves[0]
    if args.no_eval:
        print(json.dumps({"trained": sorted(cartridges), "timings_s": timings}))
        return
    missing = sorted(name for name, path in cartridges.items() if not Path(path).is_file())
    if missing:
        print(f"not trained yet, left out of the evaluation: {', '.join(missing)}")
        cartridges = {name: path for name, path in cartridges.items() if name not in missing}

    eval_args = [
        *common,
        f"corpus.path={doc}",
        f"qa={HERE / 'qa.json'}",
        f"output={out / 'eval'}",
        f"truncated_tokens=[{','.join(str(s) for s in args.sizes)}]",
        f"limit={args.questions}",
    ]
    eval_args += [f"+cartridges.{name}={path}" for name, path in cartridges.items()]
    cfg, _ = load_config("eval", eval_args)
    t0 = time.time()
    results = ceval.evaluate(cfg, model, tokenizer)
    timings["eval"] = time.time() - t0
    print(ceval.format_table(results))
    atomic_write_text(out / "timings.json", json.dumps(timings, indent=2))
    from experiments.cartridges_tradeoff.plot import plot

    plot(out / "eval" / "results.json")
    print(json.dumps({"results": results, "timings_s": timings}))


if __name__ == "__main__":
    main()
