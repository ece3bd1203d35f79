"""State cartridges vs KV cartridges: a Based LM and an attention LM of equal size, recall of an unseen fact sheet.

1. Data: synthetic fact sheets ("Mirelo: city Tolmi, color amber, job baker.") each followed by questions in
   the chat format the cartridges code renders ("Q: city of Mirelo?" / "A: Tolmi"); names and values are drawn
   afresh per sheet, so a model can only answer by recalling the sheet in its context.
2. Pretraining (zoo.pretrain, one run per model, BPE tokenizer trained on the sheets): the Based hybrid
   (BaseConv, Based, sliding window, as configs/model/based_tiny.yaml) and an attention LM with the same
   d_model and layer count.
3. The corpus: a fresh sheet; the QA set: every (entity, attribute) of it.
4. Self-study with each model (the model writes questions about the sheet, then answers them with the sheet
   in context; its top-k log-probs are the targets), then `cartridges.distill` trains
   - for the Based LM, a StateCartridge initialised by prefilling the sheet;
   - for the attention LM, KV cartridges (a StateCartridge of an attention model *is* its KV) of p tokens, p
     chosen so the KV takes the bytes of the Based state (and 4x that), initialised with the sheet's first p.
5. Arms, per model: icl (sheet + question through plain `model.generate`), none (no sheet), prefill (the
   cartridge before training: for the Based LM the whole sheet's state, so it must equal icl), self_study.
   Accuracy = the first generated line equals the value. Bytes = the state (or KV) per sequence at fp32.

    python -m experiments.state_cartridges.run --out runs/state_cartridges            # H200, ~5-7 min
    python -m experiments.state_cartridges.run --quick --out runs/state_cartridges_quick  # CPU, ~2-3 min

Writes <out>/summary.json (every arm: accuracy, bytes, tokens), <out>/accuracy_vs_bytes.png, the pretraining
runs (<out>/pretrain/...), self-study data, cartridges and per-question answers (<out>/answers.jsonl).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("state_cartridges")

SYLLABLES = "ka lo mi ra ze tu vo ni sa pe dor vel mar qui tan bri hol sen gar fen lu ish om ba".split()
ATTRIBUTES = {
    "city": "Tolmi Varne Osk Keld Pirra Amsel Dunmo Rhee Sotra Ulvik Brask Nemo Corra Iffe Jalta Quell".split(),
    "color": "amber teal crimson ivory olive violet saffron slate coral indigo ochre jade rust pearl plum mint".split(),
    "job": "baker mason tailor cooper fisher potter weaver smith miller carter glazer tanner dyer joiner".split(),
}
# The chat format of the sheets (cartridges.corpus renders context and turns through it).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\n"
    "{% else %}A: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)


@dataclass
class Scale:
    entities: int  # per sheet
    sheets: int  # pretraining documents
    d_model: int
    n_layers: int
    steps: int
    batch_size: int
    seq_len: int
    conversations: int
    distill_steps: int


FULL = Scale(entities=16, sheets=40_000, d_model=128, n_layers=10, steps=1500, batch_size=64, seq_len=512,
             conversations=1024, distill_steps=300)  # fmt: skip
QUICK = Scale(entities=6, sheets=3000, d_model=64, n_layers=5, steps=150, batch_size=16, seq_len=256,
              conversations=48, distill_steps=20)  # fmt: skip


def make_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize())
    return sorted(names, key=lambda _: rng.random())


def make_sheet(rng: random.Random, entities: int) -> tuple[str, list[dict]]:
    """(sheet text, QA items) of one fact sheet with fresh names and values."""
    names = make_names(rng, entities)
    lines, qa = [], []
    for name in names:
        values = {attr: rng.choice(vals) for attr, vals in ATTRIBUTES.items()}
        lines.append(f"{name}: " + ", ".join(f"{attr} {value}" for attr, value in values.items()) + ".")
        qa += [{"question": f"{attr} of {name}?", "answer": value} for attr, value in values.items()]
    return "\n".join(lines), qa


def pretraining_text(rng: random.Random, entities: int, questions: int) -> str:
    """A sheet as the model reads it in context, then `questions` turns: the chat format of the cartridges code."""
    from cartridges.corpus import CONTEXT_INSTRUCTION

    sheet, qa = make_sheet(rng, rng.randint(max(2, entities // 2), entities))
    turns = "".join(f"Q: {it['question']}\nA: {it['answer']}\n" for it in rng.sample(qa, min(questions, len(qa))))
    return f"{CONTEXT_INSTRUCTION}{sheet}\n{turns}"


def write_pretraining_data(out: Path, scale: Scale, seed: int) -> Path:
    import datasets

    target = out / "data" / "sheets"
    if not (target / "state.json").is_file() and not (target / "dataset_info.json").is_file():
        rng = random.Random(seed)
        docs = [pretraining_text(rng, scale.entities, 2 * scale.entities) for _ in range(scale.sheets)]
        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(target))
    return target


def pretrain_model(name: str, model_args: list[str], data: Path, out: Path, scale: Scale, device: str) -> Path:
    """One zoo.pretrain run; returns its exported HF dir (skipped when it exists)."""
    from zoo.config import register_pretrain_configs
    from zoo.pretrain import pretrain
    from zoo.train import load_config

    run_dir = out / "pretrain" / name
    if (run_dir / "hf" / "config.json").is_file():
        return run_dir / "hf"
    register_pretrain_configs()
    cfg, resolved = load_config(
        [
            *model_args,
            "lm_data@data=files",
            f"data.source={data}",
            "data.tokenizer=bpe",
            "data.bpe_vocab_size=1024",
            f"data.seq_len={scale.seq_len}",
            "data.valid_frac=0.02",
            f"data.cache_dir={out / 'data' / 'cache'}",
            f"model.d_model={scale.d_model}",
            f"model.n_layers={scale.n_layers}",
            f"train.steps={scale.steps}",
            f"train.batch_size={scale.batch_size}",
            f"train.eval_every={max(1, scale.steps // 4)}",
            f"train.device={device}",
            "train.progress=false",
            "train.sample_tokens=0",
            "train.overwrite=true",
            "optim.lr=3e-3",
            f"runs_root={out}",
            "experiment_name=pretrain",
            f"run={name}",
        ],
        config_name="pretrain",
    )
    summary = pretrain(cfg, resolved)
    log.info("%s: %d parameters, valid loss %.3f, %.0f s", name, summary["parameters"], summary["valid/loss"],
             summary["wall_time_s"])  # fmt: skip
    return run_dir / "hf"


def load(hf_dir: Path, device: torch.device):
    from cartridges.models import load_model

    # fp32 on every device: these models are tiny, and fp32 keeps cartridge training and the arms exact.
    model, tok = load_model(str(hf_dir), dtype=torch.float32, device=device)
    tok.chat_template = CHAT_TEMPLATE
    return model, tok


def first_line(text: str) -> str:
    return text.strip().split("\n")[0].strip()


def stop_at_newline(tok, ids: list[int]) -> int:
    """Length of `ids` up to and including the first token whose text holds a newline (all of it if none)."""
    for i, t in enumerate(ids):
        if "\n" in tok.decode([t]):
            return i + 1
    return len(ids)


def self_study(model, tok, corpus_path: Path, out: Path, n: int, seed: int, batch: int = 64) -> Path:
    """Self-study for a base model: A (the model, sampling at temperature 1) writes a question after the sheet in
    the sheet's own format; B (the same model, greedy) answers it with the sheet in context, its top-k log-probs
    kept. Written in `cartridges-synthesize`'s dataset format, so `cartridges.distill` reads it."""
    from cartridges.clients import TransformersClient
    from cartridges.corpus import Corpus, context_ids, turn_ids
    from cartridges.self_study import _atomic_write_text, write_dataset

    if (out / "dataset").is_dir():
        return out
    out.mkdir(parents=True, exist_ok=True)
    corpus = Corpus.from_path(corpus_path, tok, 1, 1 << 20)
    ctx = context_ids(tok, corpus.full_text())
    client = TransformersClient(model, tok)
    q_prefix = tok.encode("Q:", add_special_tokens=False)
    shards = []
    for start in range(0, n, batch):
        size = min(batch, n - start)
        a = client.complete([ctx + q_prefix] * size, 16, 1.0, 0, seed=seed * 1000 + start)
        questions = [first_line(tok.decode(c.token_ids[: stop_at_newline(tok, c.token_ids)])) for c in a]
        turns = [turn_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
        b = client.complete([ctx + t for t in turns], 8, 0.0, 20, seed=seed)
        rows = []
        for i, (q, turn, ans) in enumerate(zip(questions, turns, b)):
            keep = stop_at_newline(tok, ans.token_ids)
            if not q or keep == 0:
                continue
            rows.append(
                {
                    "conversation_id": start + i,
                    "chunk_id": "0:all",
                    "seed_type": "question",
                    "user": q,
                    "assistant": tok.decode(ans.token_ids[:keep]),
                    "input_ids": turn + ans.token_ids[:keep],
                    "answer_start": len(turn),
                    "top_ids": ans.top_ids[:keep],
                    "top_logprobs": ans.top_logprobs[:keep],
                    "context_tokens": len(ctx),
                }
            )
        shard = out / "shards" / f"{start:08d}.jsonl"
        shard.parent.mkdir(exist_ok=True)
        _atomic_write_text(shard, "".join(json.dumps(r) + "\n" for r in rows))
        shards.append(shard)
    meta = {"config": {"self_study": "experiments.state_cartridges", "n": n, "seed": seed}, "corpus_hash": corpus.hash}
    _atomic_write_text(out / "meta.json", json.dumps(meta, indent=2))
    write_dataset(out, shards)
    return out


def train_cartridge(model, tok, corpus_path: Path, data: Path, out: Path, num_tokens: int, steps: int, device):
    """`cartridges.distill` (self-study top-k KL) of a state cartridge of the first `num_tokens` context tokens."""
    from cartridges import distill
    from cartridges.config import load_config

    if not (out / "cartridge.safetensors").is_file():
        cfg, _ = load_config(
            "distill",
            [
                "model=in-process",
                f"data={data}",
                f"corpus.path={corpus_path}",
                "corpus.min_tokens=1",
                "corpus.max_tokens=100000",
                f"output={out}",
                f"num_tokens={num_tokens}",
                f"steps={steps}",
                "pack_len=1024",
                "batch_size=2",
                "lr=2e-2",
                f"log_every={max(1, steps // 10)}",
                f"checkpoint_every={steps}",
                f"device={device}",
                "progress=false",
                "overwrite=true",
            ],
        )
        distill.distill(cfg, model, tok)
    return out / "cartridge.safetensors"


@torch.no_grad()
def answer(model, tok, qa: list[dict], cartridge=None, context: list[int] | None = None, batch: int = 64):
    """Greedy first-line answers to every question, after a cartridge (cartridges.generate) or after `context`
    in the prompt itself (plain model.generate: in-context learning)."""
    from cartridges.cache import generate
    from cartridges.corpus import turn_ids

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    outs = []
    for start in range(0, len(qa), batch):
        prompts = [
            (context or []) + turn_ids(tok, [{"role": "user", "content": it["question"]}], add_generation_prompt=True)
            for it in qa[start : start + batch]
        ]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": pad}
        if cartridge is None:
            seqs = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        else:
            seqs = generate(model, cartridge, ids, attention_mask=mask, **kwargs)
        outs += [first_line(tok.decode(row[width:], skip_special_tokens=True)) for row in seqs.cpu()]
    return outs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/state_cartridges")
    p.add_argument("--quick", action="store_true", help="CPU-sized run of the whole pipeline")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="pretraining steps (0: the scale's)")
    args = p.parse_args(argv)
    scale = QUICK if args.quick else FULL
    if args.steps:
        scale.steps = args.steps

    from cartridges.corpus import context_ids
    from cartridges.state import StateCartridge
    from zoo.device import resolve_device

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    t0 = time.time()
    timings = {}

    data = write_pretraining_data(out, scale, args.seed)
    heads = max(1, scale.d_model // 64)
    models = {
        "based": ["model=based_tiny"],
        "attention": ["model=attention", f"model.mixers.attention.num_heads={heads}"],
    }
    hf_dirs = {}
    for name, model_args in models.items():
        t = time.time()
        hf_dirs[name] = pretrain_model(name, model_args, data, out, scale, str(device))
        timings[f"pretrain/{name}"] = time.time() - t

    # The corpus: a fresh sheet (a seed no pretraining sheet used), and its QA set.
    sheet, qa = make_sheet(random.Random(f"eval:{args.seed}"), scale.entities)
    corpus_path = out / "corpus.md"
    corpus_path.write_text(sheet)
    (out / "qa.json").write_text(json.dumps(qa, indent=1))

    results, answers = {}, []
    based_bytes = None
    for name in ("based", "attention"):
        model, tok = load(hf_dirs[name], device)
        ctx = context_ids(tok, sheet)
        params = sum(p_.numel() for p_ in model.parameters())

        def record(arm: str, outs: list[str], nbytes: int, tokens: int, _name=name, _params=params) -> None:
            correct = [o == it["answer"] for o, it in zip(outs, qa)]
            results[f"{_name}/{arm}"] = {
                "model": _name,
                "arm": arm,
                "accuracy": sum(correct) / len(correct),
                "bytes_fp32": nbytes,
                "tokens": tokens,
                "parameters": _params,
                "n": len(qa),
            }
            answers.extend(
                {"model": _name, "arm": arm, "question": it["question"], "reference": it["answer"], "output": o}
                for it, o in zip(qa, outs)
            )
            log.info("%s/%s: accuracy %.3f at %d bytes", _name, arm, sum(correct) / len(correct), nbytes)

        t = time.time()
        full = StateCartridge.from_prefix(model, torch.tensor(ctx))
        record("icl", answer(model, tok, qa, context=ctx), full.memory_bytes(torch.float32), len(ctx))
        empty = StateCartridge.from_prefix(model, torch.tensor(context_ids(tok, "")))
        record("none", answer(model, tok, qa, cartridge=empty), empty.memory_bytes(torch.float32), empty.num_tokens)
        ss = self_study(model, tok, corpus_path, out / "self_study" / name, scale.conversations, args.seed)
        timings[f"self_study/{name}"] = time.time() - t
        if name == "based":
            sizes = {"": len(ctx)}  # the whole sheet: a state has the same size whatever it read
        else:
            per_token = 2 * scale.d_model * scale.n_layers * 4  # attention KV bytes per token at fp32
            p_eq = max(2, round(based_bytes / per_token))
            sizes = {f"_p{p_eq}": p_eq, f"_p{4 * p_eq}": min(4 * p_eq, len(ctx))}
        for suffix, num_tokens in sizes.items():
            t = time.time()
            prefill = StateCartridge.from_prefix(model, torch.tensor(ctx[:num_tokens]))
            nbytes = prefill.memory_bytes(torch.float32)
            if name == "based":
                based_bytes = nbytes
            record(f"prefill{suffix}", answer(model, tok, qa, cartridge=prefill), nbytes, num_tokens)
            path = train_cartridge(
                model, tok, corpus_path, ss, out / "cartridges" / f"{name}{suffix}", num_tokens,
                scale.distill_steps, str(device),
            )  # fmt: skip
            from cartridges.cache import load_cartridge

            trained = load_cartridge(path, model)
            record(f"self_study{suffix}", answer(model, tok, qa, cartridge=trained), nbytes, num_tokens)
            timings[f"distill/{name}{suffix}"] = time.time() - t

    summary = {
        "scale": scale.__dict__,
        "device": str(device),
        "results": results,
        "timings_s": timings,
        "wall_time_s": time.time() - t0,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    from experiments.state_cartridges.plot import plot, table

    figure = plot(out / "summary.json")
    print(table(summary))
    print(f"figure: {figure}")
    print(json.dumps({k: round(v["accuracy"], 3) for k, v in results.items()}))


if __name__ == "__main__":
    main()
