"""Cartridge training against a frozen model: context distillation and its baselines.

Methods (one loss, different targets; `loss = Σ_k p_k (log p_k − log q_k)` over target tokens, the paper's
objective: cross-entropy of the student against the teacher's top-k, shifted to be 0 when they agree):
- `self_study`: the teacher's top-k log-probs from `cartridges-synthesize` (the teacher read the chunk; the
  student reads only the cartridge).
- `hard_labels`: the same conversations, the teacher's chosen tokens as one-hot targets (k = 1, p = 1: CE).
- `ntp`: next-token prediction on the raw corpus (CE), the baseline that memorises.

The targets are the answer's tokens; with `targets=conversation` the user turn's too (data synthesized with
`turn_targets=true`, whose records carry the teacher's top-k on the turn), as the reference implementation
distils the whole conversation. The held-out KL stays on the answers, comparable across arms.

Adam at `lr`, constant over the run (the paper's choice) or, with `lr_schedule=cosine`, decayed along a half
cosine from `lr` at the first step towards 0 after the last (`learning_rate`). With a fixed budget of steps and
small batches, a constant lr keeps moving the cartridge by full-size noisy steps to the end; the decay makes the
last steps small, so the run ends settled.

Sequences are packed: each packed row holds several examples; every token sees the whole cartridge and the
earlier tokens of its own example (a block-diagonal mask), and each example's positions restart at p.

Both kinds of cartridge train here: a KV `Cartridge` for transformers LMs and a `StateCartridge` for Zoo models
(`ZooForCausalLM`, picked by the model's type). A recurrent state cannot be masked per example, so for a state
cartridge the examples of a step's packs become one row each (`collate_rows`, right-padded), every row
starting from its own copy of the state. The model stays frozen; only the cartridge's parameters are optimised.

The loss restricted to k tokens is no divergence: it goes below 0 once the student puts more mass on the
teacher's top-k than the teacher did. What the run logs as `kl` (training batch) and `heldout_kl` (a held-out
slice of the conversations, `heldout_fraction`, never trained on) is a true KL ≥ 0: teacher and student are each
reduced to k + 1 outcomes, the top-k tokens and one tail bucket holding the rest of the mass (`tail_kl`). It is a
lower bound on the full KL and 0 exactly when the two agree on those k + 1 probabilities.

The run dir `<output>/` holds `metrics.jsonl`, `ckpt/state.pt` (step, cartridge and optimizer in one file,
written atomically every `checkpoint_every` steps; `resume=true` continues exactly and drops the metrics rows
logged after the checkpoint), `cartridge.safetensors` and `summary.json`; with `save_peft=true` also
`peft_adapter/`, the cartridge as a PEFT CARTRIDGE adapter. `init=peft peft_adapter=<dir>` starts from one.
"""

import functools
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from cartridges.cache import Cartridge, cache_kwargs
from cartridges.config import ConfigError, DistillConfig, run_command
from cartridges.corpus import Corpus, load_texts
from cartridges.init import init_cartridge
from cartridges.state import StateCartridge, differentiable
from zoo.atomic import atomic_torch_save, atomic_write_text

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


def conversation_examples(rows, method: str, targets: str = "answers") -> list[Example]:
    """Self-study records -> examples; token a is predicted from position a − 1. targets="answers": the answer's
    tokens; "conversation": the user turn's too, from its second token on (the first is predicted by the
    cartridge's last position, which is not trained on), with the teacher's top-k of `turn_top_ids`."""
    out = []
    for r in rows:
        ids, start = list(r["input_ids"]), int(r["answer_start"])
        first = 1 if targets == "conversation" else start
        positions = list(range(first - 1, len(ids) - 1))
        if method == "self_study":
            top_ids, top_lp = r["top_ids"], r["top_logprobs"]
            if len(top_ids) != len(ids) - start:
                raise ValueError(f"conversation {r.get('conversation_id')}: top-k rows != answer tokens")
            if targets == "conversation":
                if "turn_top_ids" not in r:
                    raise ConfigError("targets=conversation needs data synthesized with turn_targets=true")
                if len(r["turn_top_ids"]) != start - 1:
                    raise ValueError(f"conversation {r.get('conversation_id')}: top-k rows != user-turn tokens")
                top_ids, top_lp = r["turn_top_ids"] + top_ids, r["turn_top_logprobs"] + top_lp
        else:
            top_ids, top_lp = [[t] for t in ids[first:]], [[0.0] for _ in ids[first:]]
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
    """logq [N, V] student log-probs at the target positions -> mean over targets of Σ_k p_k (log p_k − log q_k).

    The training objective: its gradient is the paper's top-k cross-entropy. Not a divergence (see `tail_kl`)."""
    logq_top = logq.gather(1, batch["top_ids"])  # [N, k]
    logp = batch["top_logprobs"]
    p = logp.exp()
    per_token = torch.where(p > 0, p * (logp - logq_top), torch.zeros_like(p)).sum(-1)  # [N]
    return per_token.mean()


def tail_kl(logq: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token KL [N] ≥ 0 between teacher and student reduced to k + 1 outcomes: the teacher's top-k tokens
    and a tail bucket holding the rest of each distribution's mass.

    The teacher's top-k log-probs come from its full softmax, so its tail is 1 − Σ p_k; both (k + 1)-vectors are
    renormalised (rounding can push a sum past 1) and the arithmetic runs in float64, so the result is a KL of two
    distributions and never negative. One-hot targets (hard labels, NTP) give the cross-entropy."""
    valid = batch["top_logprobs"] > float("-inf")  # [N, k], padded entries excluded
    logq_top = logq.detach().gather(1, batch["top_ids"]).double()
    p = torch.where(valid, batch["top_logprobs"].double().exp(), 0.0)
    q = torch.where(valid, logq_top.exp(), 0.0)
    p = torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp_min(0)], dim=-1)  # [N, k + 1]
    q = torch.cat([q, (1 - q.sum(-1, keepdim=True)).clamp_min(0)], dim=-1)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    terms = torch.where(p > 0, p * (p.log() - q.clamp_min(1e-300).log()), 0.0)
    return terms.sum(-1).clamp_min(0).float()  # [N]


def learning_rate(cfg: DistillConfig, step: int) -> float:
    """The lr of the update made at 0-based `step`: a pure function of the step, so a resume continues exactly."""
    if cfg.lr_schedule == "cosine":
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
    return cfg.lr


def student_logprobs(model, cartridge: Cartridge | StateCartridge, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The student's log-probs [N, V] at the batch's target positions, reading only the cartridge."""
    cache = cartridge.as_cache(batch["input_ids"].shape[0], dtype=model.dtype, config=model.config)
    if isinstance(cartridge, StateCartridge):
        lm = model.model  # the LanguageModel inside ZooForCausalLM: hidden states, then logits at targets only
        with differentiable(cache):
            hidden = lm.hidden_states(batch["input_ids"], cache.states)  # [B, T, d]
            return lm.logits(hidden[batch["rows"], batch["cols"]]).float().log_softmax(-1)  # [N, V]
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    hidden = decoder(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
        use_cache=True,
        **cache_kwargs(model, cache),
    ).last_hidden_state  # [B, T, d]
    return head(hidden[batch["rows"], batch["cols"]]).float().log_softmax(-1)  # [N, V], only target positions


def distill_loss(model, cartridge: Cartridge | StateCartridge, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over target tokens of Σ_k p_k (log p_k − log q_k); 0 when the student matches the teacher's top-k."""
    return topk_kl(student_logprobs(model, cartridge, batch), batch)


@torch.no_grad()
def mean_kl(model, cartridge, examples: list["Example"], pack_len: int, batch_size: int, device) -> tuple[float, int]:
    """(token-weighted mean `tail_kl`, target tokens) of `examples` read after `cartridge`, without gradients."""
    packs = pack(examples, pack_len)
    total, count = 0.0, 0
    for start in range(0, len(packs), batch_size):
        batch = make_batch(cartridge, packs[start : start + batch_size], model, device)
        kl = tail_kl(student_logprobs(model, cartridge, batch), batch)
        total, count = total + float(kl.sum()), count + kl.numel()
    return (total / count if count else float("nan")), count


def load_examples(cfg: DistillConfig, corpus: Corpus) -> list[Example]:
    """Every example of the method, the held-out slice included (`load_split` separates it)."""
    return load_split(replace(cfg, heldout_fraction=0.0), corpus)[0]


def load_split(cfg: DistillConfig, corpus: Corpus) -> tuple[list[Example], list[Example]]:
    """(training examples, held-out examples). The held-out slice is `heldout_fraction` of the conversations (a
    seeded choice, at least 1 when there are 2 or more), kept as teacher top-k targets for every method; NTP trains
    on the corpus and is measured on the conversations when `data` is given."""
    rows = None
    if cfg.data:
        import datasets

        data = Path(cfg.data)
        meta_path = data / "meta.json"
        if not (data / "dataset").is_dir() or not meta_path.is_file():
            raise ConfigError(f"data={data} is not a cartridges-synthesize output (no dataset/ and meta.json)")
        meta = json.loads(meta_path.read_text())
        if meta["corpus_hash"] != corpus.hash:
            raise ConfigError(f"data={data} was synthesized from another corpus than corpus.path={cfg.corpus.path}")
        rows = datasets.load_from_disk(str(data / "dataset")).to_list()
    held: list[int] = []
    if rows and cfg.heldout_fraction > 0 and len(rows) >= 2:
        n = min(len(rows) - 1, max(1, round(cfg.heldout_fraction * len(rows))))
        held = sorted(random.Random(f"{cfg.seed}:heldout").sample(range(len(rows)), n))
    heldout = conversation_examples([rows[i] for i in held], "self_study") if held else []
    if cfg.method == "ntp":
        return ntp_examples(corpus.windows()), heldout
    keep = set(range(len(rows))) - set(held)
    return conversation_examples([rows[i] for i in sorted(keep)], cfg.method, cfg.targets), heldout


def truncate_metrics(path: Path, max_step: int) -> None:
    """Keep the metrics rows of steps ≤ `max_step` (a resume redoes the rest); a torn last line is dropped."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if row.get("step", 0) <= max_step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))


CHECKPOINT = "ckpt/state.pt"


def resume_state(cfg: DistillConfig, ckpt_path: Path, device) -> dict | None:
    """The checkpoint to continue from (None: not resuming, or nothing saved yet). It must have been trained with
    this lr schedule: a constant lr may run on to more steps, but a cosine one is a function of the total, which
    must not change (a ConfigError otherwise)."""
    if not (cfg.resume and ckpt_path.exists()):
        return None
    state = torch.load(ckpt_path, map_location=device, weights_only=True)
    if "cartridge" not in state:
        raise ConfigError(f"{ckpt_path} predates single-file checkpoints; rerun with overwrite=true")
    trained_with, total = state.get("schedule", ("constant", None))
    if trained_with != cfg.lr_schedule or (trained_with == "cosine" and total != cfg.steps):
        raise ConfigError(
            f"{ckpt_path} was trained with lr_schedule={trained_with} over {total} steps; resume with the same"
        )
    return state


def train_step(model, cartridge, optimizer, batch: dict[str, torch.Tensor], lr: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One Adam step of the cartridge on `batch` at `lr`; returns the loss (the top-k KL, a device scalar) and the
    per-target-token true KL (`tail_kl`), both without a host sync."""
    logq = student_logprobs(model, cartridge, batch)
    loss = topk_kl(logq, batch)
    kl = tail_kl(logq, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return loss, kl


def distill(cfg: DistillConfig, model=None, tokenizer=None) -> dict:
    """Train a cartridge; returns the summary (also written to `<output>/summary.json`)."""
    from tqdm.auto import tqdm

    from zoo.device import resolve_device
    from zoo.pretrained import load_model, parse_dtype

    out = Path(cfg.output)
    ckpt_path = out / CHECKPOINT
    if ckpt_path.exists() and not (cfg.resume or cfg.overwrite):
        raise ConfigError(f"{out} already holds a run: pass resume=true to continue or overwrite=true")
    texts = load_texts(cfg.corpus.path, cfg.corpus.text_field)  # a bad path fails before the model loads
    device = resolve_device(cfg.device)
    if model is None or tokenizer is None:
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
        model, tokenizer = load_model(cfg.model, dtype=parse_dtype("bf16" if bf16 else "fp32"), device=device)
    model.requires_grad_(False)  # frozen: gradients reach the cartridge only
    corpus = Corpus(texts, tokenizer, cfg.corpus.min_tokens, cfg.corpus.max_tokens)
    examples, heldout = load_split(cfg, corpus)
    if not examples:
        raise ConfigError("no training examples (empty dataset or corpus shorter than corpus.min_tokens)")
    # the inputs are good: only now may overwrite=true remove the earlier run's files
    if cfg.overwrite:
        for f in ("metrics.jsonl", "summary.json", "cartridge.safetensors", CHECKPOINT):
            (out / f).unlink(missing_ok=True)
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    steps = schedule(examples, cfg)

    cartridge = init_cartridge(cfg, model, tokenizer, corpus, device)
    state = resume_state(cfg, ckpt_path, device)
    if state is not None:
        cartridge.load_state_dict(state["cartridge"])
        log.info("resuming at step %d", state["step"])
    start = state["step"] if state is not None else 0
    truncate_metrics(out / "metrics.jsonl", start)
    cartridge.info.training_config = {"distill": asdict(cfg)}
    optimizer = torch.optim.Adam(cartridge.parameters(), lr=cfg.lr)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])

    wandb_run = None
    if cfg.logger.backend == "wandb":
        import wandb

        wandb_run = wandb.init(project=cfg.logger.project, mode=cfg.logger.mode, config=asdict(cfg), dir=str(out))

    def checkpoint(step: int) -> None:
        # One file: the cartridge, the optimizer and the step can never disagree after a kill.
        state = {"step": step, "cartridge": cartridge.state_dict(), "optimizer": optimizer.state_dict(),
                 "schedule": (cfg.lr_schedule, cfg.steps)}  # fmt: skip
        if initial_kl is not None:
            state["initial_heldout_kl"] = initial_kl
        atomic_torch_save(state, ckpt_path)

    def heldout_kl() -> dict:
        if not heldout:
            return {}
        kl, n = mean_kl(model, cartridge, heldout, cfg.pack_len, cfg.batch_size, device)
        return {"heldout_kl": kl, "heldout_tokens": n}

    if state is not None:
        initial_kl = state.get("initial_heldout_kl")
    else:
        initial_kl = heldout_kl().get("heldout_kl")
        if initial_kl is not None:
            log.info("initial cartridge: held-out KL %.4f over %d conversations", initial_kl, len(heldout))
    t0, tokens, loss_sum, kl_sum, kl_n, loss_n = time.time(), 0, 0.0, 0.0, 0, 0
    bar = tqdm(total=cfg.steps, initial=start, desc=f"distill {cfg.method}", disable=not cfg.progress)
    with open(out / "metrics.jsonl", "a") as metrics:
        for step in range(start, cfg.steps):
            batch = make_batch(cartridge, steps[step], model, device)
            loss, kl = train_step(model, cartridge, optimizer, batch, learning_rate(cfg, step))
            tokens += int(batch["input_ids"].numel())
            # losses are read back only at log lines, so the host collates the next batch while the GPU works
            loss_sum, loss_n = loss_sum + loss.detach(), loss_n + 1
            kl_sum, kl_n = kl_sum + kl.sum(), kl_n + kl.numel()
            bar.update(1)
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                row = {
                    "step": step + 1,
                    "loss": float(loss_sum) / loss_n,
                    "kl": float(kl_sum) / max(kl_n, 1),
                    "lr": learning_rate(cfg, step),
                    **heldout_kl(),
                    "tokens": tokens,
                    "time_s": time.time() - t0,
                }
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                bar.set_postfix(loss=f"{row['loss']:.4f}", kl=f"{row['kl']:.4f}")
                if "heldout_kl" in row:
                    log.info("step %d: loss %.4f, KL %.4f, held-out KL %.4f", row["step"], row["loss"], row["kl"],
                             row["heldout_kl"])  # fmt: skip
                if wandb_run is not None:
                    wandb_run.log(row, step=step + 1)
                loss_sum, kl_sum, kl_n, loss_n = 0.0, 0.0, 0, 0
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                checkpoint(step + 1)
    bar.close()
    final = cartridge.save(out / "cartridge.safetensors")
    if cfg.save_peft:
        from cartridges.peft import save_adapter

        save_adapter(cartridge, model, out / "peft_adapter")
    wall = time.time() - t0
    last = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        last.update({k: v for k, v in json.loads(line).items() if k in ("loss", "kl", "heldout_kl")})
    summary = {
        "kind": cartridge.KIND,
        "method": cfg.method,
        "num_tokens": cartridge.num_tokens,
        "steps": cfg.steps,
        "examples": len(examples),
        "heldout_examples": len(heldout),
        "initial_heldout_kl": initial_kl,
        **{f"final_{k}": v for k, v in last.items()},
        "memory_bytes": cartridge.memory_bytes(model.dtype),
        "wall_time_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "cartridge": str(final),
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
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
