"""The self-study recipe against its baselines at one cartridge size p ≤ 1/14 of the document: does a cartridge
beat the truncated context of equal memory, come near ICL, and beat hard labels and NTP?

Arms (all evaluated on the same questions, `cartridges/eval.py`):
    icl, none, truncated_<p>   the document in context, no document, its first p tokens of context
    ntp                        next-token prediction on the document itself
    hard_labels                the self-study conversations with the teacher's chosen tokens as one-hot targets
    ss                         self-study: the teacher's top-k distribution on the same conversations
    am, ss_am (with --arms)    the document's KV compacted to p tokens by attention matching, untrained
                               (cartridges/compact.py); self-study starting from it
    ss_half_frozen (--arms)    self-study with the cartridge's first p/2 tokens frozen at the prefix's KV: the
                               truncated context's first half kept as it is, the rest trained
    ss_closed (--arms)         self-study from the truncated context's own KV (a closed message of at most p
                               tokens), where the others start from the context's first p tokens, cut mid-document

The self-study data: chunks of 64-512 tokens, fact-stating seed prompts (question, quiz, extraction, recall;
--seeds picks others), answers of at most --answer-tokens tokens, --conversations of them. Every trained arm shares
the rest (`TRAINING`): --steps steps of 4 packed rows of 2,048 tokens, Adam lr 2e-2 decayed along a cosine to 0,
initialised from the KV of the first p tokens, no frozen token. They are trained in the order above, baselines
first, so a --time-limit that stops the run early never leaves self-study without the baselines it is judged
against.

Layout of `--out` (every stage is skipped when its output exists; self-study and distillation resume from their
shards and checkpoints, so re-running the same command continues an interrupted run):
    synth_recipe/              cartridges-synthesize output (summary.json: information KL, coverage)
    c_<arm>/                   cartridges-distill outputs (metrics.jsonl with held-out KL, summary.json)
    eval/                      results.json, answers.jsonl (with in_prefix per answer)
    results.json, recipe.png   plot.py: one row per arm, and the figure
    timings.json               seconds per stage
    recipe_settings.json       the run's settings: a run with other ones stops rather than reuse these outputs

    python -m experiments.cartridges_recipe.run --out runs/cartridges_recipe --model /path/SmolLM2.gguf
    python -m experiments.cartridges_recipe.run --smoke --out /tmp/recipe_smoke      # tiny Llama, CPU, seconds

`--more-sizes 7` also trains self-study at p = context // 7 (arm `ss_p<p>`, beside `truncated_<p>`) on the same
conversations: the cartridge-size lever.

The last line printed is JSON: the table's rows and the issue's targets (ss ≥ 2× truncated, ≥ 0.7× ICL,
ss > hard_labels > ntp).
"""

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path

from cartridges.config import SEED_PROMPT_TYPES
from zoo.atomic import atomic_write_text

HERE = Path(__file__).resolve().parent
DOCUMENTS = {
    "merrowby": (HERE / "document.md", HERE / "qa.json"),
    "quellmere": (HERE.parent / "cartridges_tradeoff" / "document.md", HERE.parent / "cartridges_tradeoff" / "qa.json"),
}
RECIPE_SEEDS = ["question", "quiz", "extraction", "recall"]
# cartridges-distill settings every trained arm shares
TRAINING = ["lr=2e-2", "lr_schedule=cosine", "num_frozen=0"]
# arm -> its own overrides of cartridges-distill, in training order (baselines first); ss_am (self-study from the
# attention-matching cartridge), ss_half_frozen and ss_closed (self-study from the truncated-context baseline's own
# KV, a closed message, where first_tokens stops mid-document) and ss_turns (the user turns distilled as well as the
# answers, as the reference implementation does; its conversations then carry the teacher's top-k on the user
# turns, `turn_targets=true`) run only when --arms names them
ARMS = {
    "ntp": ["method=ntp", "init=first_tokens"],
    "hard_labels": ["method=hard_labels", "init=first_tokens"],
    "ss": ["method=self_study", "init=first_tokens"],
    "ss_am": ["method=self_study", "init=attention_matching"],
    "ss_half_frozen": ["method=self_study", "init=first_tokens"],
    "ss_closed": ["method=self_study", "init=truncated_context"],
    "ss_turns": ["method=self_study", "init=first_tokens", "targets=conversation"],
}
# arm -> the share of its p tokens kept frozen at their init (the others freeze none, TRAINING's num_frozen=0).
# ss_half_frozen asks whether self-study loses what the truncated prefix answers by overwriting it: on the 4.6K
# Quellmere document `ss` answered 2 of the 11 questions inside the first p tokens, truncation 8.
FROZEN_SHARE = {"ss_half_frozen": 0.5}


def training(arm: str, size: int) -> list[str]:
    """TRAINING for one arm of p = `size` tokens: its num_frozen from FROZEN_SHARE."""
    frozen = int(size * FROZEN_SHARE.get(arm, 0.0))
    return [o if not o.startswith("num_frozen=") else f"num_frozen={frozen}" for o in TRAINING]
DEFAULT_ARMS = ["ntp", "hard_labels", "ss"]
# arms built without training: am, the document's KV compacted to p tokens by attention matching
# (cartridges/compact.py), the cheap baseline and the initialiser of ss_am
UNTRAINED_ARMS = ["am"]


def resolve_model(name: str) -> str:
    """A model name for `load_model`: a .gguf file, an HF dir, a known name, or a directory holding one .gguf."""
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise SystemExit(f"--model {path}: expected one .gguf file in it, found {len(ggufs)}")
        return str(ggufs[0])
    return name


def smoke_document(out: Path) -> tuple[Path, Path]:
    """The new document's first two sections and their questions: small enough for a tiny model on a CPU."""
    from cartridges.eval import is_correct

    doc, qa = DOCUMENTS["merrowby"]
    text = doc.read_text()
    cut = text.index("## The glassworks")
    small = text[:cut]
    items = [it for it in json.loads(qa.read_text()) if is_correct(small, it)]
    (out / "smoke").mkdir(parents=True, exist_ok=True)
    (out / "smoke" / "document.md").write_text(small)
    (out / "smoke" / "qa.json").write_text(json.dumps(items[:8], indent=1))
    return out / "smoke" / "document.md", out / "smoke" / "qa.json"


def settings(args) -> dict:
    """Counts and sizes: the H200 defaults, or the CPU smoke run's; the seed prompts either way."""
    if args.smoke:
        return dict(conversations=16, steps=4, pack_len=256, batch_size=1, synth_batch=8, user_tokens=8,
                    answer_tokens=8, chunks=(32, 128), max_new_tokens=4, eval_batch=8, top_logprobs=5,
                    seeds=args.seeds)  # fmt: skip
    return dict(conversations=args.conversations, steps=args.steps, pack_len=2048, batch_size=4,
                synth_batch=args.synth_batch, user_tokens=64, answer_tokens=args.answer_tokens, chunks=(64, 512),
                max_new_tokens=32, eval_batch=128, top_logprobs=20, seeds=args.seeds)  # fmt: skip


def check_settings(out: Path, record: dict) -> None:
    """One run's settings per --out: the first run writes them to recipe_settings.json; a later one with other
    settings (another document, seeds, answer length, count of conversations or steps) stops with a one-line error,
    since its synthesis and trained arms would be taken for the earlier run's."""
    path = out / "recipe_settings.json"
    if path.is_file():
        before = json.loads(path.read_text())
        if before != record:
            changed = sorted(k for k in set(before) | set(record) if before.get(k) != record.get(k))
            raise SystemExit(f"{out}: holds a run with other settings ({', '.join(changed)}); give this one its own "
                             "--out")
        return
    atomic_write_text(path, json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/cartridges_recipe")
    p.add_argument(
        "--model",
        default=os.environ.get("CARTRIDGES_MODEL", "smollm2-135m-instruct"),
        help="a .gguf file, a directory holding one, an HF dir or a known name ($CARTRIDGES_MODEL)",
    )
    p.add_argument(
        "--document",
        choices=sorted(DOCUMENTS),
        default="merrowby",
        help="merrowby: the 1.25K-token benchmark; quellmere: the 4.6K-token hard case",
    )
    p.add_argument("--arms", nargs="+", choices=sorted([*ARMS, *UNTRAINED_ARMS]), default=DEFAULT_ARMS,
                   help="trained arms (ss_am: self-study from the am cartridge) and am, the untrained compaction")
    p.add_argument("--conversations", type=int, default=4096)
    p.add_argument("--seeds", nargs="+", default=RECIPE_SEEDS, choices=sorted(SEED_PROMPT_TYPES),
                   help="the seed prompt kinds of the self-study conversations (default: the recipe's)")
    p.add_argument("--answer-tokens", type=int, default=160, help="the longest answer a conversation's turn holds")
    p.add_argument("--steps", type=int, default=480, help="steps of every trained arm")
    p.add_argument("--synth-batch", type=int, default=512)
    p.add_argument("--size-ratio", type=int, default=14, help="p = context tokens // this")
    p.add_argument("--more-sizes", type=int, nargs="*", default=[], metavar="RATIO",
                   help="also train self-study at p = context tokens // RATIO (arm ss_p<p>, with truncated_<p> "
                   "beside it), on the same conversations: the cartridge-size lever")
    p.add_argument(
        "--time-limit",
        type=float,
        default=0,
        help="seconds after which no new arm starts training (0: none); the evaluation still runs on what is "
        "trained; re-run the same command to continue",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny random Llama on the CPU, tiny counts: seconds")
    p.add_argument(
        "--export",
        default="",
        help="also copy results.json, recipe.png, answers.jsonl and run.json (everything else a reader "
        "needs: summaries, metrics, timings) into this directory",
    )
    args = p.parse_args(argv)

    from cartridges import distill, self_study
    from cartridges import eval as ceval
    from cartridges.config import load_config
    from cartridges.corpus import context_ids
    from zoo.device import resolve_device
    from zoo.pretrained import TINY_MODEL, load_model, parse_dtype

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    s = settings(args)
    check_settings(out, {"document": "smoke" if args.smoke else args.document, "seeds": list(s["seeds"]),
                         "answer_tokens": s["answer_tokens"], "conversations": s["conversations"],
                         "steps": s["steps"], **({"turn_targets": True} if "ss_turns" in args.arms else {})})
    model_name = TINY_MODEL if args.smoke else resolve_model(args.model)
    device = resolve_device("cpu" if args.smoke else args.device)
    doc, qa = smoke_document(out) if args.smoke else DOCUMENTS[args.document]
    timings_path = out / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.is_file() else {}

    def timed(stage: str, fn):
        t0 = time.time()
        result = fn()
        timings[stage] = round(time.time() - t0, 2)
        atomic_write_text(timings_path, json.dumps(timings, indent=2))
        return result

    def out_of_time() -> bool:
        return bool(args.time_limit) and time.time() - t_start > args.time_limit

    model, tokenizer = timed(
        "load_model",
        lambda: load_model(model_name, dtype=parse_dtype("bf16" if device.type == "cuda" else "fp32"), device=device),
    )
    ctx_tokens = len(context_ids(tokenizer, doc.read_text()))
    size = ctx_tokens // args.size_ratio
    common = [f"model={model_name}", f"device={device.type}", "progress=false"]

    def synthesize() -> Path:
        target = out / "synth_recipe"
        if not (target / "summary.json").is_file() or not (target / "dataset").is_dir():
            chunks = s["chunks"]
            cfg, _ = load_config("synthesize", [
                *common, f"corpus.path={doc}", f"output={target}", f"num_conversations={s['conversations']}",
                f"corpus.min_tokens={chunks[0]}", f"corpus.max_tokens={chunks[1]}",
                f"seed_prompt_types=[{','.join(s['seeds'])}]", f"max_user_tokens={s['user_tokens']}",
                f"max_answer_tokens={s['answer_tokens']}", f"batch_size={s['synth_batch']}",
                f"top_logprobs={s['top_logprobs']}", "conversations_per_chunk=4",
                f"turn_targets={'ss_turns' in args.arms}",
            ])  # fmt: skip
            timed("synthesize/synth_recipe", lambda: self_study.synthesize(cfg, model, tokenizer))
        return target

    cartridges = {}
    stopped = []
    if "am" in args.arms:
        target = out / "c_am" / "cartridge.safetensors"
        if not target.is_file():

            def compact():
                from cartridges.compact import attention_matching, repeat_prefill_ids

                text = doc.read_text()
                ctx, reference = context_ids(tokenizer, text), repeat_prefill_ids(tokenizer, text)
                return attention_matching(model, ctx, size, reference, num_frozen=1).save(target)

            timed("compact/am", compact)
        cartridges["am"] = target
    # (arm, p, its overrides): the chosen arms at p in ARMS' order (baselines first), then self-study at each
    # further size
    sizes = [ctx_tokens // r for r in args.more_sizes]
    plan = [(a, size, ARMS[a]) for a in ARMS if a in args.arms] + [(f"ss_p{q}", q, ARMS["ss"]) for q in sizes]
    for arm, arm_size, lever in plan:
        target = out / f"c_{arm}"
        if not (target / "summary.json").is_file():
            if out_of_time():
                stopped.append(arm)
                continue
            # every arm reads the conversations: NTP trains on the document and is measured on them
            cfg, _ = load_config("distill", [
                *common, f"corpus.path={doc}", f"data={synthesize()}", f"output={target}", f"num_tokens={arm_size}",
                f"steps={s['steps']}", f"pack_len={s['pack_len']}", f"batch_size={s['batch_size']}",
                f"corpus.min_tokens={s['chunks'][0]}", f"corpus.max_tokens={s['chunks'][1]}",
                f"log_every={max(1, s['steps'] // 8)}", f"checkpoint_every={max(1, s['steps'] // 4)}",
                f"resume={(target / distill.CHECKPOINT).is_file()}", *training(arm, arm_size), *lever,
            ])  # fmt: skip
            timed(f"distill/{arm}", lambda cfg=cfg: distill.distill(cfg, model, tokenizer))
        cartridges[arm] = target / "cartridge.safetensors"

    if stopped:
        print(f"time limit reached; not trained yet: {', '.join(stopped)}. Re-run the same command to continue.")
    eval_args = [
        *common, f"corpus.path={doc}", f"qa={qa}", f"output={out / 'eval'}",
        f"truncated_tokens=[{','.join(str(q) for q in [size, *sizes])}]",
        f"max_new_tokens={s['max_new_tokens']}", f"batch_size={s['eval_batch']}",
        *[f"+cartridges.{arm}={path}" for arm, path in cartridges.items()],
    ]  # fmt: skip
    cfg, _ = load_config("eval", eval_args)
    timed("eval", lambda: ceval.evaluate(cfg, model, tokenizer))
    from experiments.cartridges_recipe.plot import collect, plot, targets

    rows = collect(out)
    try:
        plot(out)
    except ImportError as e:  # a GPU box without matplotlib: plot.py redraws it from results.json elsewhere
        print(f"no figure ({e}); run python -m experiments.cartridges_recipe.plot {out} where matplotlib is")
    print(ceval.format_table(json.loads((out / "eval" / "results.json").read_text())))
    print(format_levers(rows))
    final = {"document": args.document if not args.smoke else "smoke", "model": model_name, "p": size,
             "context_tokens": ctx_tokens, "steps": s["steps"], "training": TRAINING, "targets": targets(rows),
             "rows": rows, "timings_s": timings, "wall_s": round(time.time() - t_start, 1),
             "incomplete": stopped}  # fmt: skip
    if args.export:
        export(out, Path(args.export), final)
    print(json.dumps(final))
    return final


def export(out: Path, target: Path, final: dict) -> None:
    """A few files that hold the whole run's record: results, figure, answers, and run.json with the synthesis
    summaries and each arm's distillation summary and metrics."""
    target.mkdir(parents=True, exist_ok=True)
    for src, name in ((out / "results.json", "results.json"), (out / "recipe.png", "recipe.png"),
                      (out / "eval" / "answers.jsonl", "answers.jsonl")):  # fmt: skip
        if src.is_file():
            shutil.copy(src, target / name)
    record = {**final, "synthesis": {}, "distill": {}}
    if (out / "synth_recipe" / "summary.json").is_file():
        record["synthesis"]["synth_recipe"] = json.loads((out / "synth_recipe" / "summary.json").read_text())
    for run_dir in sorted(out.glob("c_*")):
        if (run_dir / "summary.json").is_file():
            record["distill"][run_dir.name[2:]] = {
                "summary": json.loads((run_dir / "summary.json").read_text()),
                "metrics": [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()],
            }
    atomic_write_text(target / "run.json", json.dumps(record, indent=1))


def format_levers(rows: list[dict]) -> str:
    """Held-out KL before → after training and the data's information KL, per trained arm."""
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    lines = [f"{'arm':<18}{'data info KL':>14}{'held-out KL start':>19}{'end':>9}{'train s':>9}"]
    for r in rows:
        if r.get("method"):
            lines.append(
                f"{r['arm']:<18}{fmt(r.get('data_info_kl')):>14}{fmt(r.get('initial_heldout_kl')):>19}"
                f"{fmt(r.get('final_heldout_kl')):>9}{r.get('train_s') or 0:>9.1f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
