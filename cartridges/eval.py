"""QA accuracy and KV memory per arm: the corpus in context (ICL), a truncated context, no context, cartridges.

Every arm is a prefix KV: ICL is the model's own KV of the corpus in context (`Cartridge.from_prefix`, which
reproduces full-context generation exactly), so all arms run through the same batched generation. Memory is
the bytes of that prefix KV per sequence in the model's dtype: 2 · layers · kv_heads · head_dim · tokens · itemsize.

An answer counts as correct when the normalised reference answer (or one of its aliases) appears in the
normalised generation. Prints a table, then one line of JSON; `output` also gets results.json and
answers.jsonl.

Each arm of p KV tokens is also scored apart on the questions whose answer lies inside the truncated context of
p tokens (the same memory) and on those outside it (`in_prefix` per answer; `accuracy_in_prefix`,
`accuracy_outside_prefix` and `n_in_prefix` per arm). A cartridge that only keeps what its first tokens held
scores like truncation on both; one that learnt the rest of the document gains outside. ICL holds the whole
document, so all its questions count as inside.

    python -m cartridges.eval corpus.path=doc.md qa=qa.json +cartridges.ss256=runs/c256/cartridge.safetensors \
        truncated_tokens=[256]
"""

import json
import logging
import re
import unicodedata
from pathlib import Path

import torch

from cartridges.cache import Cartridge, generate
from cartridges.config import ConfigError, EvalConfig, run_command
from cartridges.corpus import Corpus, context_ids, left_pad, load_texts, turn_ids

log = logging.getLogger(__name__)


def load_qa(path: str | Path) -> list[dict]:
    """A JSON list (or JSON lines) of {"question", "answer", optional "aliases": [...]}."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read qa file {path}: {e.strerror or e}") from None
    try:
        items = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x]
    except ValueError as e:
        raise ConfigError(f"qa file {path} is not JSON or JSON lines: {e}") from None
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not item.get("question") or not item.get("answer"):
            raise ConfigError(f"qa file {path}: item {i} needs non-empty 'question' and 'answer'")
    return items


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(text.split())


def is_correct(output: str, item: dict) -> bool:
    out = f" {normalize(output)} "
    return any(f" {normalize(a)} " in out for a in [item["answer"], *item.get("aliases", [])])


def kv_bytes(model, num_tokens: int) -> int:
    """Bytes of KV cache for `num_tokens` tokens of one sequence, in the model's dtype."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return 2 * c.num_hidden_layers * kv_heads * head_dim * num_tokens * itemsize


@torch.no_grad()
def answer(
    model,
    tokenizer,
    prefix: Cartridge,
    questions: list[str],
    max_new_tokens: int,
    batch_size: int,
    progress: bool = False,
    desc: str = "",
) -> list[str]:
    """Greedy answers to `questions`, each asked after the prefix KV."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    outputs = []
    for start in tqdm(range(0, len(questions), batch_size), desc=desc, disable=not progress):
        prompts = [
            turn_ids(tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True)
            for q in questions[start : start + batch_size]
        ]
        ids, mask = left_pad(prompts, pad)
        width = ids.shape[1]
        out = generate(
            model,
            prefix,
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        outputs += [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out.cpu()]
    return outputs


def truncated_context(tokenizer, corpus: Corpus, max_tokens: int) -> list[int]:
    """The context prefix holding as much of the corpus' start as fits in `max_tokens` tokens."""
    doc = list(tokenizer.encode(corpus.full_text(), add_special_tokens=False))
    overhead = len(context_ids(tokenizer, ""))
    keep = max_tokens - overhead
    while keep > 0:
        ids = context_ids(tokenizer, tokenizer.decode(doc[:keep]))
        if len(ids) <= max_tokens:
            return ids
        keep -= len(ids) - max_tokens
    raise ConfigError(f"truncated_tokens={max_tokens} is below the chat template's own {overhead} tokens")


def in_prefix_flags(tokenizer, corpus: Corpus, items: list[dict], num_tokens: int, full: int) -> list[bool]:
    """Per question, whether its answer (or an alias) appears as whole words in the truncated context of
    `num_tokens` tokens: all True when that holds the whole context of `full` tokens, all False when it holds no
    document at all."""
    if num_tokens >= full:
        return [True] * len(items)
    if num_tokens <= len(context_ids(tokenizer, "")):
        return [False] * len(items)
    text = tokenizer.decode(truncated_context(tokenizer, corpus, num_tokens), skip_special_tokens=True)
    return [is_correct(text, it) for it in items]


def build_arms(cfg: EvalConfig, model, tokenizer, corpus: Corpus) -> dict[str, Cartridge]:
    arms = {}
    as_prefix = lambda ids, how: Cartridge.from_prefix(  # noqa: E731
        model, torch.tensor(ids), num_frozen=0, dtype=model.dtype, corpus_hash=corpus.hash, init_method=how
    )
    if "icl" in cfg.arms:
        arms["icl"] = as_prefix(context_ids(tokenizer, corpus.full_text()), "icl")
    for n in cfg.truncated_tokens:
        arms[f"truncated_{n}"] = as_prefix(truncated_context(tokenizer, corpus, n), f"truncated({n})")
    if "none" in cfg.arms:
        arms["none"] = as_prefix(context_ids(tokenizer, ""), "none")
    for name, path in cfg.cartridges.items():
        arms[name] = Cartridge.load(path, model)
        if arms[name].info.corpus_hash and arms[name].info.corpus_hash != corpus.hash:
            log.warning("cartridge %s was trained on another corpus than %s", name, cfg.corpus.path)
    return arms


def evaluate(cfg: EvalConfig, model=None, tokenizer=None) -> dict:
    from zoo.device import resolve_device
    from zoo.pretrained import load_model, parse_dtype

    items = load_qa(cfg.qa)  # the inputs are read before the model loads: a bad path fails at once
    if cfg.limit:
        items = items[: cfg.limit]
    texts = load_texts(cfg.corpus.path, cfg.corpus.text_field)
    if model is None or tokenizer is None:
        device = resolve_device(cfg.device)
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
        model, tokenizer = load_model(cfg.model, dtype=parse_dtype("bf16" if bf16 else "fp32"), device=device)
    corpus = Corpus(texts, tokenizer, 1, 1 << 30)
    arms = build_arms(cfg, model, tokenizer, corpus)
    if not arms:
        raise ConfigError("no arms to evaluate: set arms, truncated_tokens or cartridges")
    results, answers = {}, []
    full = len(context_ids(tokenizer, corpus.full_text()))
    flags: dict[int, list[bool]] = {}  # by KV tokens
    for name, prefix in arms.items():
        p = prefix.num_tokens
        if p not in flags:
            flags[p] = in_prefix_flags(tokenizer, corpus, items, p, full)
        inside = flags[p]
        outs = answer(
            model,
            tokenizer,
            prefix,
            [it["question"] for it in items],
            cfg.max_new_tokens,
            cfg.batch_size,
            progress=cfg.progress,
            desc=name,
        )
        correct = [is_correct(o, it) for o, it in zip(outs, items)]
        hits_in = [c for c, i in zip(correct, inside) if i]
        hits_out = [c for c, i in zip(correct, inside) if not i]
        results[name] = {
            "accuracy": sum(correct) / len(correct),
            "kv_tokens": prefix.num_tokens,
            "memory_bytes": kv_bytes(model, prefix.num_tokens),
            "n": len(correct),
            "n_in_prefix": len(hits_in),
            "accuracy_in_prefix": sum(hits_in) / len(hits_in) if hits_in else None,
            "accuracy_outside_prefix": sum(hits_out) / len(hits_out) if hits_out else None,
        }
        answers += [
            {"arm": name, "question": it["question"], "reference": it["answer"], "output": o, "correct": c,
             "in_prefix": i}
            for it, o, c, i in zip(items, outs, correct, inside)
        ]  # fmt: skip
        r = results[name]
        log.info("%s: accuracy %.3f (%d questions), %d kv tokens", name, r["accuracy"], r["n"], r["kv_tokens"])
        if cfg.output:  # after every arm: an eval stopped part-way keeps the arms it finished
            _write_results(Path(cfg.output), results, answers)
    return results


def _write_results(out: Path, results: dict, answers: list[dict]) -> None:
    from zoo.atomic import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=2))
    atomic_write_text(out / "answers.jsonl", "".join(json.dumps(a) + "\n" for a in answers))


def format_table(results: dict) -> str:
    icl = results.get("icl", {}).get("memory_bytes")
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [
        f"{'arm':<24}{'kv tokens':>10}{'memory MB':>12}{'vs ICL':>8}{'accuracy':>10}{'n':>6}"
        f"{'in prefix':>11}{'outside':>9}{'n in':>6}"
    ]
    for name, r in results.items():
        ratio = f"{icl / r['memory_bytes']:.1f}x" if icl else "-"
        lines.append(
            f"{name:<24}{r['kv_tokens']:>10}{r['memory_bytes'] / 2**20:>12.2f}{ratio:>8}"
            f"{r['accuracy']:>10.3f}{r['n']:>6}{fmt(r.get('accuracy_in_prefix')):>11}"
            f"{fmt(r.get('accuracy_outside_prefix')):>9}{r.get('n_in_prefix', '-'):>6}"
        )
    return "\n".join(lines)


USAGE = """usage: cartridges-eval [--cfg] [--threads N] [--version] KEY=VALUE ...

QA accuracy and KV memory per arm: the corpus in context (ICL), truncated contexts, no context, cartridges.
  cartridges-eval corpus.path=doc.md qa=qa.json +cartridges.ss256=runs/c256/cartridge.safetensors
  cartridges-eval corpus.path=doc.md qa=qa.json truncated_tokens=[256,1024] output=runs/eval
Keys: cartridges/config.py EvalConfig; preset cartridges/configs/eval.yaml. --threads: torch CPU threads
(default: the cores available). Prints a table, then one line of JSON."""


def main(argv: list[str] | None = None) -> None:
    results = run_command("cartridges-eval", "eval", USAGE, evaluate, argv)
    if results is not None:
        print(format_table(results))
        print(json.dumps(results))


if __name__ == "__main__":
    main()
