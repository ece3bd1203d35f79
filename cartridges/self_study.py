"""Self-study: synthetic conversations about corpus chunks, with the teacher's top-k log-probs.

For conversation i: pick a chunk (consecutive conversations share one, so a server reuses the prefix) and a
seed-prompt type. Model A reads the chunk and the seed instruction and writes a user message (sampled at
`temperature`). Model B, the same model, reads the chunk and that message and answers greedily; the top-k
log-probs of its distribution at each answer token are kept. One round. Types in `DIRECT_TYPES` skip model A:
their seed prompt, which names the chunk by its opening words, is the user message itself, so a small model
that writes poor questions still makes the teacher state the chunk's facts.

How much a conversation can teach is measured on the data itself: `info_kl` is the mean per-token KL (top-k
plus a tail bucket, `distill.tail_kl`) between the teacher, who read the chunk, and the same model answering the
same turn after an empty document. No cartridge can recover more than that from the data: it is the gap
distillation closes. `<output>/summary.json` holds its token-weighted mean, overall and per seed type, and how
often the chunks covered each corpus token.

Each record holds the student's view of the conversation: `input_ids` = the user turn (rendered to follow a
context, ending in the assistant header) + B's answer tokens, with `answer_start` where the answer begins, and
`top_ids` / `top_logprobs` `[answer_len, k]`. A cartridge trained on it stands in for the chunk. With
`turn_targets=true` a record also holds `turn_top_ids` / `turn_top_logprobs` `[answer_start - 1, k]`: the teacher's
top-k on the user turn's tokens from the second on (`turn_targets`), for `cartridges-distill targets=conversation`.

Output: `<output>/dataset` (an HF dataset saved with `save_to_disk`), `<output>/meta.json` and
`<output>/summary.json`. Work is written per batch to `<output>/shards/`, atomically, so an interrupted run
continues where it stopped; each batch also writes the seconds of its stages beside it, and summary.json sums
them (`timing_s`: the questions' and answers' generation, the information KL, the user-turn targets when asked
for, the serialisation).
"""

import json
import logging
import random
import time
from dataclasses import asdict
from pathlib import Path

from cartridges.config import ConfigError, SynthesizeConfig, run_command
from cartridges.corpus import Corpus, context_ids, load_texts, turn_ids
from zoo.atomic import atomic_write_text, staged_dir

log = logging.getLogger(__name__)

SEED_PROMPTS: dict[str, list[str]] = {
    "structuring": [
        "Write a message asking for part of the document above to be reorganised as JSON. Name the part and the "
        "fields you want. Output only the message.",
        "Write a message asking for one section of the document above to be turned into a YAML outline or a "
        "table. Be specific about which section. Output only the message.",
    ],
    "summarization": [
        "Write a message asking for a summary of a specific part of the document above, naming that part "
        "precisely. Output only the message.",
        "Write a message asking for the key facts of the document above in a few bullet points. Output only the "
        "message.",
    ],
    "question": [
        "Write one factual question that can be answered only with details from the document above (a name, "
        "number, date or place). Output only the question.",
        "Write a question that needs two separate facts from the document above to answer. Output only the question.",
    ],
    "use_case": [
        "Think of someone who would need the document above for their work. Write the message they would send "
        "to an assistant that has read it. Output only the message.",
    ],
    "creative": [
        "Write a message asking for a short poem or story that uses specific details from the document above. "
        "Output only the message.",
    ],
    "generic": ["Write a message about the document above. Output only the message."],
    "quiz": [
        "Write a quiz of three short questions about the names, numbers, dates and places in the document above. "
        "Output only the questions.",
        "Write two questions whose answers are single facts stated in the document above, such as who, when, "
        "how many or where. Output only the questions.",
    ],
    # direct: the user message itself; {start} is the chunk's opening words
    "extraction": [
        'List every name, date, number and place in the part of the document that begins "{start}", each with '
        "what it refers to.",
        'Rewrite the part of the document that begins "{start}" as short factual statements, one fact per line.',
        "Answer as a JSON object: the people, places, dates and numbers in the part of the document that begins "
        '"{start}", and what the text says about each.',
    ],
}
# direct: the teacher restates the chunk itself, from its opening words
SEED_PROMPTS["recall"] = [
    'Repeat the part of the document that begins "{start}", word for word.',
    'Continue the document from "{start}", exactly as it is written.',
]
DIRECT_TYPES = ("extraction", "recall")
OPENING_WORDS = 8  # how a direct seed prompt names its chunk


def conversation_plan(cfg: SynthesizeConfig, corpus: Corpus, index: int):
    """(chunk, seed type, seed prompt) of conversation `index`: a pure function of the seed and the index."""
    chunk_rng = random.Random(f"{cfg.seed}:chunk:{index // cfg.conversations_per_chunk}")
    chunk = corpus.sample_chunk(chunk_rng)
    rng = random.Random(f"{cfg.seed}:seed:{index}")
    seed_type = rng.choice(cfg.seed_prompt_types)
    return chunk, seed_type, rng.choice(SEED_PROMPTS[seed_type])


def opening(text: str, words: int = OPENING_WORDS) -> str:
    return " ".join(text.split()[:words])


def synthesize_batch(
    cfg: SynthesizeConfig, corpus: Corpus, client, tokenizer, indices: list[int], model=None,
    timing: dict[str, float] | None = None,
) -> list[dict]:
    """The records of conversations `indices`; with `model` (in-process) each gets its `info_kl`. `timing`, when
    given, receives the seconds this batch spent per stage (questions, answers, info_kl)."""
    clock = time.perf_counter()
    plans = [conversation_plan(cfg, corpus, i) for i in indices]
    contexts = [context_ids(tokenizer, chunk.text) for chunk, _, _ in plans]
    users = [prompt.format(start=opening(c.text)) if t in DIRECT_TYPES else "" for c, t, prompt in plans]
    ask = [j for j, (_, seed_type, _) in enumerate(plans) if seed_type not in DIRECT_TYPES]
    seed = cfg.seed * 1_000_003 + indices[0]
    if ask:
        a_prompts = [
            contexts[j] + turn_ids(tokenizer, [{"role": "user", "content": plans[j][2]}], add_generation_prompt=True)
            for j in ask
        ]
        a_out = client.complete(a_prompts, cfg.max_user_tokens, cfg.temperature, 0, seed=seed)
        for j, c in zip(ask, a_out):
            users[j] = tokenizer.decode(c.token_ids, skip_special_tokens=True).strip()
    clock = _lap(timing, "questions", clock)
    user_turns = [turn_ids(tokenizer, [{"role": "user", "content": u}], add_generation_prompt=True) for u in users]
    b_prompts = [ctx + turn for ctx, turn in zip(contexts, user_turns)]
    b_out = client.complete(b_prompts, cfg.max_answer_tokens, 0.0, cfg.top_logprobs, seed=seed)
    clock = _lap(timing, "answers", clock)
    records = []
    for i, (chunk, seed_type, _), user, turn, b in zip(indices, plans, users, user_turns, b_out):
        if not b.token_ids:
            continue
        records.append(
            {
                "conversation_id": i,
                "chunk_id": chunk.id,
                "seed_type": seed_type,
                "user": user,
                "assistant": tokenizer.decode(b.token_ids, skip_special_tokens=True),
                "input_ids": turn + b.token_ids,
                "answer_start": len(turn),
                "top_ids": b.top_ids,
                "top_logprobs": b.top_logprobs,
                "context_tokens": len(context_ids(tokenizer, chunk.text)),
            }
        )
    if model is not None and records:
        for r, kl in zip(records, information_kl(model, tokenizer, records)):
            r["info_kl"] = kl
    clock = _lap(timing, "info_kl", clock)
    if cfg.turn_targets and records:
        if model is None:
            raise ConfigError("turn_targets=true scores the user turns with the in-process model; none was given")
        chunk_text = {c.id: c.text for c, _, _ in plans}
        contexts = [context_ids(tokenizer, chunk_text[r["chunk_id"]]) for r in records]
        for r, (ids, lps) in zip(records, turn_targets(model, records, contexts, cfg.top_logprobs)):
            r["turn_top_ids"], r["turn_top_logprobs"] = ids, lps
        _lap(timing, "turn_targets", clock)
    return records


def _lap(timing: dict[str, float] | None, stage: str, since: float) -> float:
    """Add the seconds since `since` to timing[stage] (when timing is given); returns now. On CUDA the clock waits
    for the device first, so a stage is charged its own kernels."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    now = time.perf_counter()
    if timing is not None:
        timing[stage] = timing.get(stage, 0.0) + now - since
    return now


def information_kl(model, tokenizer, records: list[dict], pack_len: int = 4096, batch_size: int = 8) -> list[float]:
    """Per record, the mean over its answer tokens of the KL (top-k + tail bucket) between the teacher's recorded
    distribution (it read the chunk) and the model reading the same turn after an empty document.

    The empty document is the chat context of "" as a prefix cache: the student's view with an uninformative
    cartridge. 0 when the chunk adds nothing the model did not already say."""
    import torch

    from cartridges.cache import Cartridge
    from cartridges.distill import conversation_examples, make_batch, pack, student_logprobs, tail_kl
    from cartridges.init import is_state_model
    from cartridges.state import StateCartridge

    ids = torch.tensor(context_ids(tokenizer, ""))
    if is_state_model(model):
        empty = StateCartridge.from_prefix(model, ids)
    else:
        empty = Cartridge.from_prefix(model, ids, num_frozen=0, dtype=model.dtype)
    examples = conversation_examples(records, "self_study")
    width = max(pack_len, max(len(ex.ids) for ex in examples))  # no example is cut
    packs = pack(examples, width)  # in order: the per-token KLs split back per record
    out: list[float] = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(packs), batch_size):
            rows = packs[start : start + batch_size]
            batch = make_batch(empty, rows, model, device)
            kl = tail_kl(student_logprobs(model, empty, batch), batch).cpu()
            sizes = [len(ex.positions) for row in rows for ex in row]
            out += [float(piece.mean()) for piece in kl.split(sizes)]
    return out


def turn_targets(model, records: list[dict], contexts: list[list[int]], k: int) -> list[tuple[list, list]]:
    """Per record, the teacher's top-k (ids, log-probs) for its user-turn tokens from the second on: the model with
    the record's chunk context as an exact prefix cache (`Cartridge.from_prefix`), which is what a cartridge learns
    to stand in for. The turn's first token is predicted by the context's last position, which a cartridge's student
    has no row for, so it gets no target. Consecutive records of one chunk share its prefill and one forward pass,
    a row each."""
    import itertools

    import torch

    from cartridges.cache import Cartridge
    from cartridges.distill import Example, make_batch, student_logprobs
    from cartridges.init import is_state_model
    from cartridges.state import StateCartridge

    device = next(model.parameters()).device
    out: list[tuple[list, list]] = []
    with torch.no_grad():
        for ctx, items in itertools.groupby(zip(records, contexts), key=lambda rc: tuple(rc[1])):
            rows = [r for r, _ in items]
            scored = [r for r in rows if int(r["answer_start"]) >= 2]  # a turn of one token has nothing to score
            tops: dict[int, tuple[list, list]] = {}
            if scored:
                prefix = torch.tensor(ctx)
                if is_state_model(model):
                    teacher = StateCartridge.from_prefix(model, prefix)
                else:
                    teacher = Cartridge.from_prefix(model, prefix, num_frozen=0, dtype=model.dtype)
                examples = [Example(list(r["input_ids"][: int(r["answer_start"])]), *_turn_placeholders(r))
                            for r in scored]
                top = student_logprobs(model, teacher, make_batch(teacher, [[ex] for ex in examples], model, device))
                top = top.topk(k, dim=-1)
                sizes = [len(ex.positions) for ex in examples]
                for r, ids, lps in zip(scored, top.indices.cpu().split(sizes), top.values.cpu().split(sizes)):
                    tops[id(r)] = (ids.tolist(), lps.tolist())
            out += [tops.get(id(r), ([], [])) for r in rows]
    return out


def _turn_placeholders(record: dict) -> tuple[list[int], list[list[int]], list[list[float]]]:
    """An Example's positions and empty targets for a record's user turn (only the positions are read)."""
    n = int(record["answer_start"]) - 1
    return list(range(n)), [[0]] * n, [[0.0]] * n


def batch_timings(shards: Path, starts) -> dict:
    """The batches' stage seconds summed (`timing_s`), over the batches whose timing file exists (`timed_batches`:
    a batch from before timing files, or whose write was cut between its two files, has none)."""
    total: dict[str, float] = {}
    timed = 0
    for s in starts:
        path = shards / f"{s:08d}.timing.json"
        if path.is_file():
            timed += 1
            for stage, seconds in json.loads(path.read_text()).items():
                total[stage] = total.get(stage, 0.0) + seconds
    return {"timing_s": total, "timed_batches": timed, "batches": len(starts)}


def summarize(out: Path, corpus: Corpus, rows: list[dict], timings: dict | None = None) -> dict:
    """summary.json of a synthesis output: counts, the information diagnostic, chunk coverage and (`timings`,
    from `batch_timings`) the seconds spent per stage: the questions' and answers' generation, the information KL
    and the shards' serialisation."""
    from cartridges.corpus import Chunk

    def weighted(rs):
        pairs = [(r["info_kl"], len(r["top_ids"])) for r in rs if "info_kl" in r]
        n = sum(w for _, w in pairs)
        return sum(k * w for k, w in pairs) / n if n else None

    chunks = []
    for chunk_id in sorted({r["chunk_id"] for r in rows}):
        doc, start, end = (int(x) for x in chunk_id.split(":"))
        chunks.append(Chunk(doc, start, end, ""))
    counts = {}
    for r in rows:
        counts.setdefault(r["seed_type"], []).append(r)
    summary = {
        "conversations": len(rows),
        "answer_tokens": sum(len(r["top_ids"]) for r in rows),
        "info_kl": weighted(rows),
        "info_kl_by_seed_type": {t: weighted(rs) for t, rs in sorted(counts.items())},
        "conversations_by_seed_type": {t: len(rs) for t, rs in sorted(counts.items())},
        "chunks": len(chunks),
        "chunk_coverage": corpus.coverage(chunks),
        **(timings or {}),
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


# Settings that may change between an interrupted run and its continuation without changing the data.
RESUMABLE_KEYS = ("num_conversations", "progress", "backend", "base_url", "server_model", "device")


def make_client(cfg: SynthesizeConfig, model, tokenizer):
    from cartridges.clients import OpenAIClient, TransformersClient

    if cfg.backend == "openai":
        return OpenAIClient(cfg.base_url, cfg.server_model or cfg.model)
    return TransformersClient(model, tokenizer)


def synthesize(cfg: SynthesizeConfig, model=None, tokenizer=None) -> Path:
    """Run (or continue) self-study into `cfg.output`; returns the dataset directory."""
    from tqdm.auto import tqdm

    from zoo.device import resolve_device
    from zoo.pretrained import load_model, parse_dtype

    out = Path(cfg.output)
    shards = out / "shards"
    texts = load_texts(cfg.corpus.path, cfg.corpus.text_field)  # a bad path fails before the model loads
    if model is None or tokenizer is None:
        device = resolve_device(cfg.device)
        dtype = parse_dtype(
            "bf16" if cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda") else "fp32"
        )
        model, tokenizer = load_model(cfg.model, dtype=dtype, device=device)
    corpus = Corpus(texts, tokenizer, cfg.corpus.min_tokens, cfg.corpus.max_tokens)
    meta = {"config": asdict(cfg), "corpus_hash": corpus.hash, "format": "zoo.cartridges.self_study/1"}
    meta_path = out / "meta.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        a = {k: v for k, v in old["config"].items() if k not in RESUMABLE_KEYS}
        b = {k: v for k, v in meta["config"].items() if k not in RESUMABLE_KEYS}
        if a != b or old["corpus_hash"] != corpus.hash:
            diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise ConfigError(f"{out} holds self-study with other settings ({diff or 'corpus'}); use another output")
    shards.mkdir(parents=True, exist_ok=True)
    atomic_write_text(meta_path, json.dumps(meta, indent=2))

    client = make_client(cfg, model, tokenizer)
    starts = range(0, cfg.num_conversations, cfg.batch_size)
    todo = [s for s in starts if not (shards / f"{s:08d}.jsonl").is_file()]
    if len(todo) < len(starts):
        log.info("resuming: %d of %d batches already done", len(starts) - len(todo), len(starts))
    bar = tqdm(total=cfg.num_conversations, desc="self-study", disable=not cfg.progress, unit="conv")
    bar.update(sum(min(cfg.batch_size, cfg.num_conversations - s) for s in starts if s not in todo))
    for start in todo:
        indices = list(range(start, min(start + cfg.batch_size, cfg.num_conversations)))
        timing: dict[str, float] = {}
        records = synthesize_batch(cfg, corpus, client, tokenizer, indices, model=model, timing=timing)
        clock = time.perf_counter()
        text = "".join(json.dumps(r) + "\n" for r in records)
        # the timing first: a shard without its timing file is still a finished batch, only untimed
        timing["write"] = time.perf_counter() - clock
        atomic_write_text(shards / f"{start:08d}.timing.json", json.dumps(timing))
        atomic_write_text(shards / f"{start:08d}.jsonl", text)
        bar.update(len(indices))
    bar.close()
    rows = [json.loads(line) for s in starts for line in (shards / f"{s:08d}.jsonl").read_text().splitlines() if line]
    if not rows:
        raise RuntimeError("self-study produced no conversations (every answer was empty)")
    summary = summarize(out, corpus, rows, batch_timings(shards, starts))
    log.info(
        "self-study: %d conversations, %d answer tokens; information KL (teacher with chunk vs without) %s nats/token",
        summary["conversations"],
        summary["answer_tokens"],
        "n/a" if summary["info_kl"] is None else f"{summary['info_kl']:.4f}",
    )
    return write_dataset(out, rows)


def write_dataset(out: Path, rows: list[dict]) -> Path:
    import datasets

    target = out / "dataset"
    with staged_dir(target) as staging:
        datasets.Dataset.from_list(rows).save_to_disk(str(staging))
    return target


USAGE = """usage: cartridges-synthesize [--cfg] [--threads N] [--version] KEY=VALUE ...

Self-study conversations about a corpus, with the teacher's top-k log-probs, saved as an HF dataset.
  cartridges-synthesize corpus.path=doc.md output=runs/ss num_conversations=512
  cartridges-synthesize ... backend=openai base_url=http://localhost:8000/v1 server_model=<name>
Keys: cartridges/config.py SynthesizeConfig; preset cartridges/configs/synthesize.yaml. Re-running the same
command continues an interrupted run. --threads: torch CPU threads (default: the cores available)."""


def main(argv: list[str] | None = None) -> None:
    path = run_command("cartridges-synthesize", "synthesize", USAGE, synthesize, argv)
    if path is not None:
        print(f"dataset: {path}")


if __name__ == "__main__":
    main()
