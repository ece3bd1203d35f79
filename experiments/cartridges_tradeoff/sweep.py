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
"""

import argparse
import json
import logging
import time
from pathlib import Path

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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/cartridges_tradeoff")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--conversations", type=int, default=2048)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--pack-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4, help="packed rows per distillation step")
    p.add_argument("--synth-batch", type=int, default=64)
    p.add_argument("--compose-size", type=int, default=256, help="0 skips the composition arm")
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
    from cartridges.models import load_model, parse_dtype
    from zoo.device import resolve_device

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
        if not (target / "dataset").is_dir():
            cfg, _ = load_config(
                "synthesize", [*synth_common, f"corpus.path={corpus}", f"output={target}", f"num_conversations={n}"]
            )
            t0 = time.time()
            self_study.synthesize(cfg, model, tokenizer)
            timings[f"synthesize/{name}"] = time.time() - t0
        return target

    def train(name: str, corpus: Path, data: Path, size: int, method: str) -> Path:
        target = out / name
        if not (target / "cartridge.safetensors").is_file():
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

    ss = synth("ss", doc, args.conversations)
    cartridges = {}
    for size in args.sizes:
        for method in args.methods:
            cartridges[f"{method}_{size}"] = train(f"c{size}_{method}", doc, ss, size, method)
    if args.compose_size:
        part1, part2 = split_document(out)
        halves = []
        for i, part in enumerate((part1, part2), start=1):
            data = synth(f"ss_part{i}", part, args.conversations // 2)
            halves.append(train(f"compose/part{i}", part, data, args.compose_size, "self_study"))
        from cartridges.cache import Cartridge

        composed = out / "compose" / "composed.safetensors"
        if not composed.is_file():
            Cartridge.concat([Cartridge.load(h, model) for h in halves]).save(composed)
        cartridges[f"compose_2x{args.compose_size}"] = composed
        cartridges[f"part1_only_{args.compose_size}"] = halves[0]

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
    (out / "timings.json").write_text(json.dumps(timings, indent=2))
    from experiments.cartridges_tradeoff.plot import plot

    plot(out / "eval" / "results.json")
    print(json.dumps({"results": results, "timings_s": timings}))


if __name__ == "__main__":
    main()
