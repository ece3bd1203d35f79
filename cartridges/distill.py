"""Cartridge training against a frozen model: context distillation and its baselines.

Methods (one loss, different targets; `loss = Σ_k p_k (log p_k − log q_k)` over target tokens, i.e. the KL
from the teacher's top-k to the student restricted to those k tokens):
- `self_study`: the teacher's top-k log-probs from `cartridges-synthesize` (the teacher read the chunk; the
  student reads only the cartridge).
- `hard_labels`: the same conversations, the teacher's chosen tokens as one-hot targets (k = 1, p = 1: CE).
- `ntp`: next-token prediction on the raw corpus (CE), the baseline that memorises.

Sequences are packed: each packed row holds several examples; every token sees the whole cartridge and the
earlier tokens of its own example (a block-diagonal mask), and each example's positions restart at p.

Both kinds of cartridge train here: a KV `Cartridge` for transformers LMs and a `StateCartridge` for Zoo models
(`ZooForCausalLM`, picked by the model's type). A recurrent state cannot be masked per example, so for a state
cartridge the examples of a step's packs become one row each (`collate_rows`, right-padded), every row
starting from its own copy of the state. The model stays frozen; only the cartridge's parameters are optimised.

The run dir `<output>/` holds `metrics.jsonl`, `ckpt/` (cartridge + optimizer, written atomically every
`checkpoint_every` steps; `resume=true` continues exactly), `cartridge.safetensors` and `summary.json`.
"""

import functools
import json
import logging
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cartridges.cache import Cartridge, cache_kwargs, load_cartridge
from cartridges.config import ConfigError, DistillConfig, run_command
from cartridges.corpus import Corpus, context_ids
from cartridges.state import StateCartridge, differentiable

log = logging.getLogger(__name__)


@dataclass
class Example:
    """One training sequence: token ids, and for each target the position whose logits predict it."""

    ids: list[int]
    positions: list[int]  # indices into ids
    top_ids: list[list[int]]  # [len(positions), k]
    top_logprobs: list[list[float]]

    @functools.cached_property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [n], positions [m], top_ids [m, k], top_logprobs [m, k]) as CPU tensors, built once: an example
        recurs in every epoch, and per-token Python in the step loop would starve the GPU. Rows shorter than
        the longest are padded with probability-0 entries (log p = -inf contributes 0 to the loss)."""
        k = max((len(t) for t in self.top_ids), default=1)
        top_ids = [t + [0] * (k - len(t)) for t in self.top_ids]
        top_lp = [t + [float("-inf")] * (k - len(t)) for t in self.top_logprobs]
        return (
            torch.tensor(self.ids, dtype=torch.long),
            torch.tensor(self.positions, dtype=torch.long),
            torch.tensor(top_ids, dtype=torch.long).reshape(len(self.positions), k),
            torch.tensor(top_lp, dtype=torch.float32).reshape(len(self.positions), k),
        )


def _targets(pieces: list[tuple[int, int, Example]], device) -> dict[str, torch.Tensor]:
    """rows, cols, top_ids [N, k], top_logprobs [N, k] of the examples placed at (row, column offset)."""
    k = max(ex.tensors[2].shape[1] for _, _, ex in pieces)
    rows, cols, top_ids, top_lp = [], [], [], []
    for b, offset, ex in pieces:
        _, positions, ti, tl = ex.tensors
        rows.append(torch.full_like(positions, b))
        cols.append(positions + offset)
        top_ids.append(torch.nn.functional.pad(ti, (0, k - ti.shape[1])))
        top_lp.append(torch.nn.functional.pad(tl, (0, k - tl.shape[1]), value=float("-inf")))
    return {
        "rows": torch.cat(rows).to(device),
        "cols": torch.cat(cols).to(device),
        "top_ids": torch.cat(top_ids).to(device),  # [N, k]
        "top_logprobs": torch.cat(top_lp).to(device),
    }


def conversation_examples(rows, method: str) -> list[Example]:
    """Self-study records -> examples; answer token a is predicted from position a − 1."""
    out = []
    for r in rows:
        ids, start = list(r["input_ids"]), int(r["answer_start"])
        positions = list(range(start - 1, len(ids) - 1))
        if method == "self_study":
            top_ids, top_lp = r["top_ids"], r["top_logprobs"]
            if len(top_ids) != len(ids) - start:
                raise ValueError(f"conversation {r.get('conversation_id')}: top-k rows != answer tokens")
        else:
            top_ids, top_lp = [[t] for t in ids[start:]], [[0.0] for _ in ids[start:]]
        out.append(Example(ids, positions, top_ids, top_lp))
    return out


def ntp_examples(windows: list[list[int]]) -> list[Example]:
    return [
        Example(w, list(range(len(w) - 1)), [[t] for t in w[1:]], [[0.0]] * (len(w) - 1)) for w in windows if len(w) > 1
    ]


def pack(examples: list[Example], pack_len: int) -> list[list[Example]]:
    """Greedy packing in the given order; an example longer than pack_len is cut to it."""
    packs, current, used = [], [], 0
    for ex in examples:
        if len(ex.ids) > pack_len:
            keep = [i for i, p in enumerate(ex.positions) if p < pack_len - 1]
            ex = Example(
                ex.ids[:pack_len],
                [ex.positions[i] for i in keep],
                [ex.top_ids[i] for i in keep],
                [ex.top_logprobs[i] for i in keep],
            )
        if used + len(ex.ids) > pack_len and current:
            packs.append(current)
            current, used = [], 0
        current.append(ex)
        used += len(ex.ids)
    if current:
        packs.append(current)
    return packs


def schedule(examples: list[Example], cfg: DistillConfig) -> list[list[list[Example]]]:
    """The batches of every step: packs of fresh permutations (epochs) of the examples; a function of the seed."""
    rng = random.Random(cfg.seed)
    packs: list[list[Example]] = []
    need = cfg.steps * cfg.batch_size
    while len(packs) < need:
        order = examples[:]
        rng.shuffle(order)
        packs.extend(pack(order, cfg.pack_len))
    return [packs[s * cfg.batch_size : (s + 1) * cfg.batch_size] for s in range(cfg.steps)]


def collate(batch: list[list[Example]], num_prefix: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Tensors of packed rows. mask `[B, 1, T, p + T]` additive: 0 where a token may attend, dtype-min elsewhere.

    The mask is built on `device` from the per-token example index: a [B, T] copy instead of [B, T, p + T]."""
    width = max(sum(len(ex.ids) for ex in row) for row in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    pos = torch.full((len(batch), width), num_prefix, dtype=torch.long)
    seg = torch.full((len(batch), width), -1, dtype=torch.long)  # example index within the row; -1 padding
    arange = torch.arange(width)
    pieces = []
    for b, row in enumerate(batch):
        offset = 0
        for e, ex in enumerate(row):
            n = len(ex.ids)
            ids[b, offset : offset + n] = ex.tensors[0]
            pos[b, offset : offset + n] = num_prefix + arange[:n]
            seg[b, offset : offset + n] = e
            pieces.append((b, offset, ex))
            offset += n
    seg = seg.to(device)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # [T, T]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)  # [B, T, T]
    prefix = torch.ones(len(batch), width, num_prefix, dtype=torch.bool, device=device)
    allowed = torch.cat([prefix, same & causal], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return {
        "input_ids": ids.to(device),
        "position_ids": pos.to(device),
        "attention_mask": mask[:, None],  # [B, 1, T, p + T]
        **_targets(pieces, device),
    }


def collate_rows(batch: list[list[Example]], device) -> dict[str, torch.Tensor]:
    """One row per example (the packs flattened), right-padded with id 0: for state cartridges.

    Padding after an example never reaches its targets (causal), so no mask is needed.
    """
    examples = [ex for row in batch for ex in row]
    width = max(len(ex.ids) for ex in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    for b, ex in enumerate(examples):
        ids[b, : len(ex.ids)] = ex.tensors[0]
    return {"input_ids": ids.to(device), **_targets([(b, 0, ex) for b, ex in enumerate(examples)], device)}


def make_batch(cartridge, batch: list[list[Example]], model, device) -> dict[str, torch.Tensor]:
    """The tensors of one step for this kind of cartridge: packed rows (KV) or one row per example (state)."""
    if isinstance(cartridge, StateCartridge):
        return collate_rows(batch, device)
    return collate(batch, cartridge.num_tokens, model.dtype, device)


def topk_kl(logq: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """logq [N, V] student log-probs at the target positions -> mean over targets of Σ_k p_k (log p_k − log q_k)."""
    logq_top = logq.gather(1, batch["top_ids"])  # [N, k]
    logp = batch["top_logprobs"]
    p = logp.exp()
    per_token = torch.where(p > 0, p * (logp - logq_top), torch.zeros_like(p)).sum(-1)  # [N]
    return per_token.mean()


def state_distill_loss(model, cartridge: StateCartridge, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`distill_loss` for a StateCartridge: every row continues its own copy of the state (`collate_rows`)."""
    lm = model.model  # the LanguageModel inside ZooForCausalLM: hidden states, then logits at targets only
    cache = cartridge.as_cache(batch["input_ids"].shape[0], dtype=model.dtype, config=model.config)
    with differentiable(cache):
        hidden = lm.hidden_states(batch["input_ids"], cache.states)  # [B, T, d]
        logq = lm.logits(hidden[batch["rows"], batch["cols"]]).float().log_softmax(-1)  # [N, V]
    return topk_kl(logq, batch)


def distill_loss(model, cartridge: Cartridge | StateCartridge, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over target tokens of Σ_k p_k (log p_k − log q_k); 0 when the student matches the teacher's top-k."""
    if isinstance(cartridge, StateCartridge):
        return state_distill_loss(model, cartridge, batch)
    cache = cartridge.as_cache(batch["input_ids"].shape[0], dtype=model.dtype, config=model.config)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    hidden = decoder(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
        use_cache=True,
        **cache_kwargs(model, cache),
    ).last_hidden_state  # [B, T, d]
    logq = head(hidden[batch["rows"], batch["cols"]]).float().log_softmax(-1)  # [N, V], only target positions
    return topk_kl(logq, batch)


def is_state_model(model) -> bool:
    """Zoo models (recurrent and hybrid) get state cartridges; every other causal LM a KV cartridge."""
    from zoo.models.hf import ZooForCausalLM

    return isinstance(model, ZooForCausalLM)


def init_cartridge(cfg: DistillConfig, model, tokenizer, corpus: Corpus, device) -> Cartridge | StateCartridge:
    """A KV cartridge of `num_tokens` tokens, or for a Zoo model the state after `num_tokens` tokens (`num_frozen`
    does not apply to states)."""
    state = is_state_model(model)
    if cfg.init == "random":
        if state:
            c = StateCartridge.random(model, cfg.num_tokens, seed=cfg.seed)
        else:
            c = Cartridge.random(model, cfg.num_tokens, num_frozen=cfg.num_frozen, seed=cfg.seed)
        c.info.corpus_hash = corpus.hash
        return c.to(device)
    ctx = context_ids(tokenizer, corpus.full_text())
    if len(ctx) < cfg.num_tokens:
        raise ConfigError(f"num_tokens={cfg.num_tokens} exceeds the corpus in context ({len(ctx)} tokens)")
    prefix = torch.tensor(ctx[: cfg.num_tokens])
    if state:
        return StateCartridge.from_prefix(model, prefix, corpus_hash=corpus.hash, init_method="first_tokens").to(device)
    return Cartridge.from_prefix(
        model, prefix, num_frozen=cfg.num_frozen, corpus_hash=corpus.hash, init_method="first_tokens"
    ).to(device)


def load_examples(cfg: DistillConfig, corpus: Corpus) -> list[Example]:
    if cfg.method == "ntp":
        return ntp_examples(corpus.windows())
    import datasets

    data = Path(cfg.data)
    meta_path = data / "meta.json"
    if not (data / "dataset").is_dir() or not meta_path.is_file():
        raise ConfigError(f"data={data} is not a cartridges-synthesize output (no dataset/ and meta.json)")
    meta = json.loads(meta_path.read_text())
    if meta["corpus_hash"] != corpus.hash:
        raise ConfigError(f"data={data} was synthesized from another corpus than corpus.path={cfg.corpus.path}")
    return conversation_examples(datasets.load_from_disk(str(data / "dataset")), cfg.method)


def _atomic_torch_save(obj, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def distill(cfg: DistillConfig, model=None, tokenizer=None) -> dict:
    """Train a cartridge; returns the summary (also written to `<output>/summary.json`)."""
    from tqdm.auto import tqdm

    from zoo.device import resolve_device
    from zoo.pretrained import load_model, parse_dtype

    out = Path(cfg.output)
    ckpt_dir = out / "ckpt"
    if (ckpt_dir / "state.pt").exists() and not (cfg.resume or cfg.overwrite):
        raise ConfigError(f"{out} already holds a run: pass resume=true to continue or overwrite=true")
    if cfg.overwrite:
        for f in (
            "metrics.jsonl",
            "summary.json",
            "cartridge.safetensors",
            "ckpt/state.pt",
            "ckpt/cartridge.safetensors",
        ):
            (out / f).unlink(missing_ok=True)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    if model is None or tokenizer is None:
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
        model, tokenizer = load_model(cfg.model, dtype=parse_dtype("bf16" if bf16 else "fp32"), device=device)
    model.requires_grad_(False)  # frozen: gradients reach the cartridge only
    corpus = Corpus.from_path(
        cfg.corpus.path, tokenizer, cfg.corpus.min_tokens, cfg.corpus.max_tokens, cfg.corpus.text_field
    )
    examples = load_examples(cfg, corpus)
    if not examples:
        raise ConfigError("no training examples (empty dataset or corpus shorter than corpus.min_tokens)")
    steps = schedule(examples, cfg)

    start = 0
    if cfg.resume and (ckpt_dir / "state.pt").exists():
        cartridge = load_cartridge(ckpt_dir / "cartridge.safetensors", model, device=device)
        state = torch.load(ckpt_dir / "state.pt", map_location=device, weights_only=True)
        start = state["step"]
        log.info("resuming at step %d", start)
    else:
        cartridge = init_cartridge(cfg, model, tokenizer, corpus, device)
        state = None
    cartridge.info.training_config = {"distill": asdict(cfg)}
    optimizer = torch.optim.Adam(cartridge.parameters(), lr=cfg.lr)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])

    wandb_run = None
    if cfg.logger.backend == "wandb":
        import wandb

        wandb_run = wandb.init(project=cfg.logger.project, mode=cfg.logger.mode, config=asdict(cfg), dir=str(out))

    def checkpoint(step: int) -> None:
        cartridge.save(ckpt_dir / "cartridge.safetensors")
        _atomic_torch_save({"step": step, "optimizer": optimizer.state_dict()}, ckpt_dir / "state.pt")

    metrics = open(out / "metrics.jsonl", "a")
    t0, tokens, loss_sum, loss_n = time.time(), 0, 0.0, 0
    bar = tqdm(total=cfg.steps, initial=start, desc=f"distill {cfg.method}", disable=not cfg.progress)
    for step in range(start, cfg.steps):
        batch = make_batch(cartridge, steps[step], model, device)
        loss = distill_loss(model, cartridge, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tokens += int(batch["input_ids"].numel())
        # the loss is read back only at log lines, so the host collates the next batch while the GPU works
        loss_sum, loss_n = loss_sum + loss.detach(), loss_n + 1
        bar.update(1)
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            row = {"step": step + 1, "loss": float(loss_sum) / loss_n, "tokens": tokens, "time_s": time.time() - t0}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            bar.set_postfix(loss=f"{row['loss']:.4f}")
            if wandb_run is not None:
                wandb_run.log(row, step=step + 1)
            loss_sum, loss_n = 0.0, 0
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            checkpoint(step + 1)
    bar.close()
    metrics.close()
    final = cartridge.save(out / "cartridge.safetensors")
    wall = time.time() - t0
    summary = {
        "kind": cartridge.KIND,
        "method": cfg.method,
        "num_tokens": cartridge.num_tokens,
        "steps": cfg.steps,
        "examples": len(examples),
        "memory_bytes": cartridge.memory_bytes(model.dtype),
        "wall_time_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "cartridge": str(final),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if wandb_run is not None:
        wandb_run.finish()
    return summary


USAGE = """usage: cartridges-distill [--cfg] [--threads N] [--version] KEY=VALUE ...

Train a cartridge for a frozen model.
  cartridges-distill data=runs/ss corpus.path=doc.md output=runs/c256 num_tokens=256
  cartridges-distill ... method=hard_labels | method=ntp
  cartridges-distill ... resume=true
Keys: cartridges/config.py DistillConfig; preset cartridges/configs/distill.yaml. --threads: torch CPU threads
(default: the cores available)."""


def main(argv: list[str] | None = None) -> None:
    summary = run_command("cartridges-distill", "distill", USAGE, distill, argv)
    if summary is not None:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
