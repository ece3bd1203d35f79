"""State cartridges vs KV cartridges: a Based LM and an attention LM of equal size, recall of an unseen fact sheet.

1. Data: synthetic fact sheets, one fact per line ("Mirelo city Tolmi"), each followed by questions in the
   chat format KV_TEMPLATE renders: the question is the key ("Mirelo city"), the answer the next word ("Tolmi").
   Names come from a fixed pool of one-token names and values are drawn afresh per sheet, so a model can only
   answer by recalling the sheet in its context: Zoology's MQAR with two-token keys, in text. Pretraining
   sheets have 1..entities entities and their questions repeat until the window is full; every document is
   exactly one packed window (README: the recipe search that led here).
2. Pretraining (zoo.pretrain, one run per model, a BPE trained on the sheets): the Based hybrid
   (BaseConv, Based, sliding window, as zoo/configs/model/based_tiny.yaml) and an attention LM with the same
   d_model and layer count. Each model's ICL recall over 8 fresh sheets goes to summary.json.
3. The corpus: a fresh sheet; the QA set: every (entity, attribute) of it.
4. Self-study with each model (the model writes questions about the sheet, then answers them with the sheet
   in context; its top-k log-probs are the targets), then `cartridges.distill` trains
   - for the Based LM, a StateCartridge initialised by prefilling the sheet;
   - for the attention LM, KV cartridges (a StateCartridge of an attention model *is* its KV) of p tokens, p
     chosen so the KV takes the bytes of the Based state (and 4x that), initialised with the sheet's first p.
5. Arms, per model: icl (sheet + question through plain `model.generate`), none (no sheet), prefill (the
   cartridge before training: for the Based LM the whole sheet's state, so it must equal icl), self_study.
   Accuracy = the first generated line equals the value. Bytes = the state (or KV) per sequence at fp32.

    python -m experiments.state_cartridges.run --out runs/state_cartridges            # H200, est. 6-8 min
    python -m experiments.state_cartridges.run --quick --out runs/state_cartridges_quick  # CPU, ~6 min

Writes <out>/summary.json (every arm: accuracy, bytes, tokens), <out>/accuracy_vs_bytes.png, the pretraining
runs (<out>/pretrain/...), self-study data, cartridges and per-question answers (<out>/answers.jsonl).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
# layout "kv": a turn is "Mirelo city Tolmi", the very form of a sheet line: a question is a two-token key
# (Zoology's MQAR with a short conv's bigram keys) and the answer the token after it.
KV_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}{{ m['content'] }}"
    "{% else %} {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
)


@dataclass
class Scale:
    entities: int  # per sheet (every sheet has exactly this many)
    sheets: int  # pretraining documents
    d_model: int
    n_layers: int
    steps: int
    batch_size: int
    conversations: int
    distill_steps: int
    passes: int = 1  # times each (entity, attribute) is asked after a pretraining sheet, each pass shuffled
    lr: float = 3e-3
    warmup_frac: float = 0.05
    names: int = 128  # the name pool (each name one BPE token)
    # kv: "Mirelo city Tolmi" per line, questions "Mirelo city" (KV_TEMPLATE); facts: "Mirelo city Tolmi." per
    # line, lines: "Mirelo: city Tolmi, color amber, job baker." (both with "Q: Mirelo city?" / "A: Tolmi" turns)
    layout: str = "kv"
    seq_len: int = 0  # 0: one whole document per window (set from the tokenized documents)
    curriculum: bool = True  # sheets of 1..entities entities, their questions repeated to fill the window
    precision: str = "auto"  # pretraining train.precision: auto (bf16 autocast on CUDA), fp32 or bf16
    answer_loss: bool = False  # pretrain on the answers' tokens only (a tokenized dataset with labels)
    # kv1: one-token keys per entity (3: as many facts as kv). 1 gives sheets of `entities` facts (1..entities
    # with the curriculum), the size at which the attention LM learns recall on the CPU (README, "Recipe search")
    names_per_entity: int = 3
    corpora: int = 1  # fresh sheets every arm is evaluated on (each with its own self-study and cartridges)
    # the query region: "iid" draws each question uniformly from the sheet's (with replacement); "passes" asks
    # every question once per pass, each pass a permutation. Passes leak answers: with the values written in
    # the query lines, a pass's later answers follow by elimination (the values not yet given in this pass),
    # a shortcut that lowers the answer loss below guessing without any recall (README, "Recipe search").
    queries: str = "iid"
    # --answer-loss: also take the loss on the newline after each answer (the runs before). Off: the labels are
    # the answer's words alone, as MQAR's; with the newline labelled the attention LM learnt no recall on the CPU
    # (README, "Recipe search"). Answers are then read as the first token after the key (`read_answer`).
    label_newline: bool = False
    # the attention LM: "hybrid" (Based's block with global attention as its memory mixer) or "plain"
    # (attention in every layer); `attention_model_args`
    attention: str = "hybrid"

    def validate(self) -> None:
        """One-line errors for settings that cannot make an experiment."""
        for field in ("entities", "sheets", "steps", "batch_size", "corpora", "names_per_entity", "passes"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        keys = self.entities * (self.names_per_entity if self.layout == "kv1" else 1)
        if keys > self.names:
            raise ValueError(f"a sheet needs {keys} distinct names but the pool has {self.names}")
        for field, allowed in (
            ("layout", ("kv", "kv1", "facts", "sheet")),
            ("queries", ("iid", "passes")),
            ("attention", ("hybrid", "plain")),
            ("precision", ("auto", "fp32", "bf16")),
        ):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {', '.join(allowed)}, got {getattr(self, field)!r}")


# Recipe (README, "Recipe search"): sheets of one-token names, each with one one-token value
# ("Mirelo Tolmi" lines: MQAR in text), every pretraining sheet of `entities` facts followed by i.i.d. questions
# of the same form, one document per window, the loss on the answers only, lr 3e-3 with 2% warmup. Based's block
# recalls 4-fact sheets on the CPU with it (0.98), the plain attention LM of the runs before did not (0.27).
RECIPE = dict(layout="kv1", names_per_entity=1, curriculum=False, answer_loss=True, queries="iid", lr=3e-3,
              warmup_frac=0.02)  # fmt: skip
# Full scale: 16-fact sheets need the curriculum (pretraining sheets of 1..16 facts, their questions repeated to
# fill the window): without it the hybrid recalls 0.10 of fresh 16-fact sheets after 3,000 CPU steps, with it
# 0.96 (README, "Recipe search" rows 21-22). fp32 on the GPU too: bf16 autocast delays the jump to recall about
# 2x (rows 19-20), and these models are too small for bf16 to matter for speed.
FULL = Scale(entities=16, sheets=40_000, d_model=128, n_layers=10, steps=3000, batch_size=128,
             conversations=1024, distill_steps=300, corpora=4, precision="fp32",
             **(RECIPE | {"curriculum": True}))  # fmt: skip
QUICK = Scale(entities=4, sheets=10_000, d_model=64, n_layers=5, steps=2000, batch_size=64,
              conversations=48, distill_steps=20, corpora=4, **RECIPE)  # fmt: skip


@functools.cache
def name_pool(n: int) -> tuple[str, ...]:
    """A fixed pool of n two-syllable names; sheets draw their entities from it, so every name is a word the
    BPE sees thousands of times (one token) and recall is a lookup, not a spelling task."""
    rng = random.Random("names")
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize())
    return tuple(sorted(names))


def make_sheet(
    rng: random.Random, entities: int, names: int = 128, layout: str = "kv", names_per_entity: int = 3
) -> tuple[str, list[dict]]:
    """(sheet text, QA items) of one fact sheet: `entities` names from the pool, fresh values."""
    lines, qa = [], []
    if layout == "kv1":  # one-token keys: names_per_entity·entities names, one value each (3: kv's number of facts)
        values = [v for vals in ATTRIBUTES.values() for v in vals]
        for name in rng.sample(name_pool(names), names_per_entity * entities):
            value = rng.choice(values)
            lines.append(f"{name} {value}")
            qa.append({"question": name, "answer": value})
        return "\n".join(lines), qa
    for name in rng.sample(name_pool(names), entities):
        values = {attr: rng.choice(vals) for attr, vals in ATTRIBUTES.items()}
        if layout == "kv":
            lines += [f"{name} {attr} {value}" for attr, value in values.items()]
            qa += [{"question": f"{name} {attr}", "answer": value} for attr, value in values.items()]
        elif layout == "facts":
            lines += [f"{name} {attr} {value}." for attr, value in values.items()]
            qa += [{"question": f"{name} {attr}?", "answer": value} for attr, value in values.items()]
        else:
            lines.append(f"{name}: " + ", ".join(f"{attr} {value}" for attr, value in values.items()) + ".")
            qa += [{"question": f"{attr} of {name}?", "answer": value} for attr, value in values.items()]
    return "\n".join(lines), qa


def sheet_questions(rng: random.Random, scale: Scale, entities: int | None = None) -> tuple[str, list[str]]:
    """(prefix, questions) of one pretraining document: the sheet as the model reads it in context, and every
    (entity, attribute) question with its answer as a turn of the chat format of the cartridges code."""
    from cartridges.corpus import CONTEXT_INSTRUCTION

    sheet, qa = make_sheet(rng, entities or scale.entities, scale.names, scale.layout, scale.names_per_entity)
    turn = "{} {}\n" if scale.layout in ("kv", "kv1") else "Q: {}\nA: {}\n"
    return f"{CONTEXT_INSTRUCTION}{sheet}\n", [turn.format(it["question"], it["answer"]) for it in qa]


def draw_queries(rng: random.Random, questions: list[str], passes: int, mode: str) -> list[str]:
    """passes·len(questions) query turns (MQAR's query region): "iid", each drawn uniformly with replacement, or
    "passes", every question once per pass in random order (answerable by elimination: Scale.queries)."""
    if mode == "passes":
        return [q for _ in range(passes) for q in rng.sample(questions, len(questions))]
    if mode != "iid":
        raise ValueError(f"queries must be iid or passes, got {mode!r}")
    return [rng.choice(questions) for _ in range(passes * len(questions))]


def pretraining_text(rng: random.Random, scale: Scale, entities: int | None = None) -> tuple[str, list[str]]:
    """(prefix, turns) of one pretraining document: the sheet, then `passes`·(its questions) query turns."""
    prefix, questions = sheet_questions(rng, scale, entities)
    return prefix, draw_queries(rng, questions, scale.passes, scale.queries)


def write_pretraining_data(out: Path, scale: Scale, seed: int) -> tuple[Path, Path]:
    """(saved dataset, tokenizer dir): the documents and a byte-level BPE trained on them.

    Every document is exactly seq_len tokens with its end-of-text (scale.seq_len, when 0, is the length of a
    full-size sheet and its questions), so each packed window holds one whole document. With `curriculum`,
    a sheet has 1..entities entities and its questions repeat (new random order per pass) until the window is
    full, then <|pad|> tokens; small sheets are where recall is learnt first."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    from cartridges.corpus import CONTEXT_INSTRUCTION
    from zoo.lm_data import PAD, train_bpe

    root = out / "data"
    target, tok_dir = root / "sheets", root / "tokenizer"
    rng = random.Random(seed)
    if not (tok_dir / "tokenizer.json").is_file():
        sample = [p + "".join(t) for p, t in (pretraining_text(rng, scale) for _ in range(2000))]
        train_bpe(sample, 1024).save_pretrained(str(tok_dir))
    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))

    @functools.cache
    def length(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    def prefix_length(prefix: str) -> int:  # sheet lines tokenize apart (a name starts a pre-token): cached
        sheet = prefix[len(CONTEXT_INSTRUCTION) :]
        return length(CONTEXT_INSTRUCTION) + sum(length(line + "\n") for line in sheet.split("\n")[:-1])

    prefix, turns = pretraining_text(random.Random(seed), scale)
    # + one <|pad|> at least (zoo.lm_data strips the text, and a trailing newline with it) + end-of-text
    full = prefix_length(prefix) + sum(length(t) for t in turns) + 2
    if not scale.seq_len:
        scale.seq_len = full
    if scale.answer_loss:
        target = root / "sheets_answers"
    if not (target / "state.json").is_file():
        docs, pads, rows = [], 0, {"input_ids": [], "labels": []}
        for _ in range(scale.sheets):
            entities = rng.randint(1, scale.entities) if scale.curriculum else scale.entities
            prefix, questions = sheet_questions(rng, scale, entities)
            turns = draw_queries(rng, questions, scale.passes, scale.queries)
            n, text, used = prefix_length(prefix), prefix, []
            while True:
                for t in turns:
                    if n + length(t) > scale.seq_len - 1:
                        break
                    n, text = n + length(t), text + t
                    used.append(t)
                else:
                    if scale.curriculum:  # more queries until the window is full
                        if scale.queries == "passes":
                            turns = rng.sample(turns, len(turns))
                        else:
                            turns = draw_queries(rng, questions, 1, scale.queries)
                        continue
                break
            docs.append(text + PAD * (scale.seq_len - 1 - n))
            pads += scale.seq_len - 1 - n
            if scale.answer_loss:
                ids, labels = answer_labels(tok, prefix, used, scale.seq_len - 1, scale.label_newline)
                rows["input_ids"].append(ids)
                rows["labels"].append(labels)
        check = {length(d) + 1 for d in docs[:200]}
        if check != {scale.seq_len}:
            log.warning("documents of %s tokens, not all %d: windows cut documents", sorted(check), scale.seq_len)
        log.info("%d documents of %d tokens (%.1f%% padding)", len(docs), scale.seq_len,
                 100 * pads / (len(docs) * scale.seq_len))  # fmt: skip
        if scale.answer_loss:
            datasets.Dataset.from_dict(rows).save_to_disk(str(target))
        else:
            datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(target))
    return target, tok_dir


def answer_labels(
    tok, prefix: str, turns: list[str], n_tokens: int, newline: bool = False
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one document, padded to n_tokens: the labels keep each turn's answer (the words
    after its key, and with `newline` the newline) and are -100 on the sheet, the keys and the padding. Pieces
    tokenize apart (a name, and a word after a space, start a pre-token), so the ids equal the document's own
    tokenization."""
    ids = tok.encode(prefix, add_special_tokens=False)
    labels = [-100] * len(ids)
    for turn in turns:
        key, answer = turn.rsplit(" ", 1) if " " in turn.rstrip("\n") else ("", turn)
        k = tok.encode(key, add_special_tokens=False)
        a = tok.encode(" " + answer if key else answer, add_special_tokens=False)
        ids += k + a
        labels += [-100] * len(k) + [t if newline or "\n" not in tok.decode([t]) else -100 for t in a]
    pad = n_tokens - len(ids)
    return ids + [tok.pad_token_id] * pad, labels + [-100] * pad


def attention_model_args(scale: Scale) -> list[str]:
    """zoo.pretrain overrides of the attention LM. "hybrid": the Based LM's block (zoo/configs/model/based_tiny.yaml)
    with its two memory mixers, Based and the sliding window, replaced by global attention, so that the two
    models differ only in the mixer that holds the sheet; "plain": attention in every layer (the runs before
    the first recipe, which learnt no recall: README, "Recipe search"). Head dim 16."""
    heads = [f"+model.mixers.attention.num_heads={max(1, scale.d_model // 16)}"]
    if scale.attention == "plain":
        return ["model=attention", heads[0][1:]]
    if scale.attention != "hybrid":
        raise ValueError(f"attention must be hybrid or plain, got {scale.attention!r}")
    return [
        "model=based_tiny",
        "model.pattern=[base_conv,attention,attention,base_conv,base_conv]",
        "~model.mixers.based",
        "~model.mixers.sliding_window",
        *heads,
    ]


def pretrain_model(
    name: str, model_args: list[str], data: Path, tok_dir: Path, out: Path, scale: Scale, device: str
) -> Path:
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
            f"data.tokenizer={tok_dir}",
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
            f"optim.lr={scale.lr}",
            f"optim.warmup_frac={scale.warmup_frac}",
            f"train.precision={scale.precision}",
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


def load(hf_dir: Path, device: torch.device, layout: str = "kv"):
    from zoo.pretrained import load_model

    # fp32 on every device: these models are tiny, and fp32 keeps cartridge training and the arms exact.
    model, tok = load_model(str(hf_dir), dtype=torch.float32, device=device)
    tok.chat_template = KV_TEMPLATE if layout in ("kv", "kv1") else CHAT_TEMPLATE
    return model, tok


def first_line(text: str) -> str:
    return text.strip().split("\n")[0].strip()


def read_answer(tok, ids: list[int], kv: bool) -> str:
    """The answer in generated token ids. kv layouts: the first token (a value is one token, `check_values`),
    the only one the answer-only loss trains; what follows it was never a target (Scale.label_newline) and can be
    any token. Other layouts: the first line."""
    if kv:
        return tok.decode(ids[:1], skip_special_tokens=True).strip()
    return first_line(tok.decode(ids, skip_special_tokens=True))


def stop_at_answer(tok, ids: list[int], kv: bool) -> int:
    """Length of the answer in generated `ids`: kv layouts, the first token (`read_answer`); else up to and
    including the first newline token."""
    return min(1, len(ids)) if kv else stop_at_newline(tok, ids)


def check_values(tok) -> None:
    """Every value is one token after a space (what `read_answer` assumes for the kv layouts)."""
    long = [v for vals in ATTRIBUTES.values() for v in vals if len(tok.encode(" " + v, add_special_tokens=False)) != 1]
    if long:
        raise ValueError(f"values of more than one token in this tokenizer: {long[:5]}")


def stop_at_newline(tok, ids: list[int]) -> int:
    """Length of `ids` up to and including the first token whose text holds a newline (all of it if none)."""
    for i, t in enumerate(ids):
        if "\n" in tok.decode([t]):
            return i + 1
    return len(ids)


def self_study(
    model, tok, corpus_path: Path, out: Path, n: int, seed: int, batch: int = 64, key_words: int = 2
) -> Path:
    """Self-study for a base model: A (the model, sampling at temperature 1) writes a question after the sheet in
    the sheet's own format; B (the same model, greedy) answers it with the sheet in context, its top-k log-probs
    kept. Written in `cartridges-synthesize`'s dataset format, so `cartridges.distill` reads it."""
    from cartridges.clients import TransformersClient
    from cartridges.corpus import Corpus, context_ids, turn_ids
    from cartridges.self_study import write_dataset
    from zoo.atomic import atomic_write_text

    if (out / "dataset").is_dir():
        return out
    out.mkdir(parents=True, exist_ok=True)
    corpus = Corpus.from_path(corpus_path, tok, 1, 1 << 20)
    ctx = context_ids(tok, corpus.full_text())
    client = TransformersClient(model, tok)
    kv = tok.chat_template == KV_TEMPLATE  # a question is the key of a line the model writes ("Mirelo city")
    q_prefix = [] if kv else tok.encode("Q:", add_special_tokens=False)
    shards = []
    for start in range(0, n, batch):
        size = min(batch, n - start)
        a = client.complete([ctx + q_prefix] * size, 16, 1.0, 0, seed=seed * 1000 + start)
        questions = [first_line(tok.decode(c.token_ids[: stop_at_newline(tok, c.token_ids)])) for c in a]
        if kv:
            questions = [" ".join(q.split()[:key_words]) for q in questions]
        turns = [turn_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
        b = client.complete([ctx + t for t in turns], 8, 0.0, 20, seed=seed)
        rows = []
        for i, (q, turn, ans) in enumerate(zip(questions, turns, b)):
            keep = stop_at_answer(tok, ans.token_ids, kv)
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
        atomic_write_text(shard, "".join(json.dumps(r) + "\n" for r in rows))
        shards.append(shard)
    meta = {"config": {"self_study": "experiments.state_cartridges", "n": n, "seed": seed}, "corpus_hash": corpus.hash}
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=2))
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
    from cartridges.corpus import left_pad, turn_ids

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    kv = tok.chat_template == KV_TEMPLATE
    if kv:
        check_values(tok)
    outs = []
    for start in range(0, len(qa), batch):
        prompts = [
            (context or []) + turn_ids(tok, [{"role": "user", "content": it["question"]}], add_generation_prompt=True)
            for it in qa[start : start + batch]
        ]
        ids, mask = left_pad(prompts, pad)
        width = ids.shape[1]
        ids, mask = ids.to(model.device), mask.to(model.device)
        kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": pad}
        if cartridge is None:
            seqs = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        else:
            seqs = generate(model, cartridge, ids, attention_mask=mask, **kwargs)
        outs += [read_answer(tok, row[width:].tolist(), kv) for row in seqs.cpu()]
    return outs


def recall_accuracy(model, tok, scale: Scale, seed: int, sheets: int = 8) -> float:
    """ICL accuracy over `sheets` fresh sheets (every question of each): does the pretrained model recall?"""
    from cartridges.corpus import context_ids

    rng = random.Random(f"recall:{seed}")
    correct = total = 0
    for _ in range(sheets):
        sheet, qa = make_sheet(rng, scale.entities, scale.names, scale.layout, scale.names_per_entity)
        outs = answer(model, tok, qa, context=context_ids(tok, sheet))
        correct += sum(o == it["answer"] for o, it in zip(outs, qa))
        total += len(qa)
    return correct / total


def write_summary(
    out: Path, scale: Scale, device, results, recall, answers, timings, t0: float, complete: bool
) -> dict:
    """summary.json and answers.jsonl, each written whole (zoo.runs.atomic_write_text)."""
    from zoo.atomic import atomic_write_text

    summary = {
        "scale": scale.__dict__,
        "device": str(device),
        "complete": complete,
        "results": results,
        "icl_recall_8_sheets": recall,
        "timings_s": timings,
        "wall_time_s": time.time() - t0,
    }
    for name, text in (("summary.json", json.dumps(summary, indent=2)),
                       ("answers.jsonl", "".join(json.dumps(a) + "\n" for a in answers))):  # fmt: skip
        atomic_write_text(out / name, text)
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/state_cartridges")
    p.add_argument("--quick", action="store_true", help="CPU-sized run of the whole pipeline")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="pretraining steps (0: the scale's)")
    p.add_argument(
        "--layout",
        choices=["kv", "kv1", "facts", "sheet"],
        default=None,
        help="sheet layout (the scale's: kv); kv1 = one-token keys, 3·entities names with one value each",
    )
    p.add_argument("--entities", type=int, default=0, help="entities per sheet (0: the scale's)")
    p.add_argument("--lr", type=float, default=0.0, help="pretraining peak lr (0: the scale's)")
    p.add_argument("--conversations", type=int, default=0, help="self-study conversations (0: the scale's)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default=None, help="pretraining precision")
    p.add_argument("--answer-loss", action="store_true", help="pretrain on the answers' tokens only")
    p.add_argument("--batch-size", type=int, default=0, help="pretraining windows per step (0: the scale's)")
    p.add_argument("--names-per-entity", type=int, default=0, help="kv1: names (facts) per entity (0: the scale's, 3)")
    p.add_argument(
        "--queries",
        choices=["iid", "passes"],
        default=None,
        help="pretraining query region: iid questions (default) or permutation passes (the runs before)",
    )
    p.add_argument(
        "--curriculum",
        action="store_true",
        help="pretraining sheets of 1..entities entities, filled with queries (the full scale's default)",
    )
    p.add_argument(
        "--no-curriculum",
        action="store_true",
        help="every pretraining sheet has `entities` entities (the quick scale's default)",
    )
    p.add_argument(
        "--attention",
        choices=["hybrid", "plain"],
        default=None,
        help="the attention LM: Based's block with global attention (hybrid, default) or attention only",
    )
    p.add_argument("--corpora", type=int, default=0, help="fresh sheets the arms run on (0: the scale's)")
    p.add_argument("--sheets", type=int, default=0, help="pretraining sheets (0: the scale's)")
    p.add_argument("--warmup-frac", type=float, default=0.0, help="pretraining warmup fraction (0: the scale's)")
    p.add_argument(
        "--pretrain-only",
        choices=["based", "attention"],
        default=None,
        help="write the data and pretrain this model only, then stop (one GPU per model: run one "
        "process per model on the same --out, then the full command, which skips finished stages)",
    )
    args = p.parse_args(argv)
    scale = dataclasses.replace(QUICK if args.quick else FULL)
    for field, value in (
        ("steps", args.steps),
        ("layout", args.layout),
        ("entities", args.entities),
        ("lr", args.lr),
        ("conversations", args.conversations),
        ("precision", args.precision),
        ("answer_loss", args.answer_loss),
        ("batch_size", args.batch_size),
        ("names_per_entity", args.names_per_entity),
        ("queries", args.queries),
        ("warmup_frac", args.warmup_frac),
        ("sheets", args.sheets),
        ("corpora", args.corpora),
        ("attention", args.attention),
    ):
        if value:
            setattr(scale, field, value)
    if args.curriculum and args.no_curriculum:
        p.error("--curriculum and --no-curriculum exclude each other")
    if args.curriculum or args.no_curriculum:
        scale.curriculum = args.curriculum
    try:
        scale.validate()
    except ValueError as e:
        p.error(str(e))

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

    data, tok_dir = write_pretraining_data(out, scale, args.seed)
    models = {"based": ["model=based_tiny"], "attention": attention_model_args(scale)}
    hf_dirs = {}
    if args.pretrain_only:
        models = {args.pretrain_only: models[args.pretrain_only]}
    for name, model_args in models.items():
        t = time.time()
        hf_dirs[name] = pretrain_model(name, model_args, data, tok_dir, out, scale, str(device))
        timings[f"pretrain/{name}"] = time.time() - t
    if args.pretrain_only:
        return

    # The corpora: fresh sheets (seeds no pretraining sheet used), each with its QA set; every arm runs on each
    # (its own self-study and cartridges per sheet) and reports the accuracy over all their questions.
    corpora = []
    for c in range(scale.corpora):
        rng = random.Random(f"eval:{args.seed}" if c == 0 else f"eval:{args.seed}:{c}")
        sheet, qa = make_sheet(rng, scale.entities, scale.names, scale.layout, scale.names_per_entity)
        path = out / ("corpus.md" if c == 0 else f"corpus{c}.md")
        path.write_text(sheet)
        (path.with_suffix(".qa.json") if c else out / "qa.json").write_text(json.dumps(qa, indent=1))
        corpora.append((c, sheet, qa, path))

    from cartridges.cache import load_cartridge

    results, answers, recall = {}, [], {}
    based_bytes = None
    for name in ("based", "attention"):
        model, tok = load(hf_dirs[name], device, scale.layout)
        params = sum(p_.numel() for p_ in model.parameters())
        recall[name] = recall_accuracy(model, tok, scale, args.seed)
        log.info("%s: ICL recall over 8 fresh sheets %.3f", name, recall[name])
        for c, sheet, qa, corpus_path in corpora:
            ctx = context_ids(tok, sheet)

            def record(arm: str, outs: list[str], nbytes: int, tokens: int, _name=name, _qa=qa, _c=c, _p=params):
                r = results.setdefault(f"{_name}/{arm}", {
                    "model": _name, "arm": arm, "correct": 0, "n": 0, "bytes_fp32": nbytes, "tokens": tokens,
                    "parameters": _p,
                })  # fmt: skip
                r["correct"] += sum(o == it["answer"] for o, it in zip(outs, _qa))
                r["n"] += len(_qa)
                r["accuracy"] = r["correct"] / r["n"]
                answers.extend(
                    {"model": _name, "arm": arm, "corpus": _c, "question": it["question"], "reference": it["answer"],
                     "output": o}
                    for it, o in zip(_qa, outs)
                )  # fmt: skip

            t = time.time()
            full = StateCartridge.from_prefix(model, torch.tensor(ctx))
            record("icl", answer(model, tok, qa, context=ctx), full.memory_bytes(torch.float32), len(ctx))
            empty = StateCartridge.from_prefix(model, torch.tensor(context_ids(tok, "")))
            record("none", answer(model, tok, qa, cartridge=empty), empty.memory_bytes(torch.float32), empty.num_tokens)
            sub = name if c == 0 else f"{name}/c{c}"
            ss = self_study(
                model, tok, corpus_path, out / "self_study" / sub, scale.conversations, args.seed + c,
                key_words=1 if scale.layout == "kv1" else 2,
            )  # fmt: skip
            timings[f"self_study/{name}"] = timings.get(f"self_study/{name}", 0.0) + time.time() - t
            if name == "based":
                sizes = {"": len(ctx)}  # the whole sheet: a state has the same size whatever it read
            else:
                # KV bytes per token at fp32 (the attention layers'; the convs' state is the same for any p)
                one, two = (
                    StateCartridge.from_prefix(model, torch.tensor(ctx[:n])).memory_bytes(torch.float32) for n in (1, 2)
                )
                per_token, fixed = two - one, 2 * one - two
                p_eq = max(2, round((based_bytes - fixed) / per_token))
                # equal bytes, and 4x (capped at the sheet: the label names the tokens it really holds)
                sizes = {f"_p{p}": p for p in dict.fromkeys((min(p_eq, len(ctx)), min(4 * p_eq, len(ctx))))}
            for suffix, num_tokens in sizes.items():
                t = time.time()
                prefill = StateCartridge.from_prefix(model, torch.tensor(ctx[:num_tokens]))
                nbytes = prefill.memory_bytes(torch.float32)
                if name == "based":
                    based_bytes = nbytes
                record(f"prefill{suffix}", answer(model, tok, qa, cartridge=prefill), nbytes, num_tokens)
                target = out / "cartridges" / (f"{name}{suffix}" if c == 0 else f"{name}{suffix}/c{c}")
                path = train_cartridge(
                    model, tok, corpus_path, ss, target, num_tokens, scale.distill_steps, str(device)
                )  # fmt: skip
                trained = load_cartridge(path, model)
                record(f"self_study{suffix}", answer(model, tok, qa, cartridge=trained), nbytes, num_tokens)
                key = f"distill/{name}{suffix}"
                timings[key] = timings.get(key, 0.0) + time.time() - t
            # after every corpus: a run cut short keeps the arms it finished (summary["complete"] is False)
            summary = write_summary(out, scale, device, results, recall, answers, timings, t0, complete=False)
        for key, r in results.items():
            if r["model"] == name:
                log.info("%s: accuracy %.3f (%d questions) at %d bytes", key, r["accuracy"], r["n"], r["bytes_fp32"])

    summary = write_summary(out, scale, device, results, recall, answers, timings, t0, complete=True)
    from experiments.state_cartridges.plot import plot, table

    figure = plot(out / "summary.json")
    print(table(summary))
    print(f"figure: {figure}")
    print(json.dumps({k: round(v["accuracy"], 3) for k, v in results.items()}))


if __name__ == "__main__":
    main()
