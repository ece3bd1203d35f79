"""`zoo-pretrain`: causal-LM pretraining of a LanguageModel on text; one run directory per run.

    zoo-pretrain                                          # based_tiny on the embedded corpus, CPU, ~2 min
    zoo-pretrain model=based_360m data.source=/data/text data.tokenizer=smollm2
    torchrun --nproc_per_node=2 -m zoo.pretrain train.parallel=ddp     # or train.parallel=fsdp (FSDP2)
    zoo-pretrain train.resume=true                        # continue a killed run from its last checkpoint

The config tree is PretrainConfig (zoo/config.py) composed by Hydra from zoo/configs/pretrain.yaml. Each step
trains on a global batch of world_size·batch_size·grad_accum packed windows, chosen by (seed, step) alone
(zoo/lm_data.py): one process with batch 2b computes the same loss as two processes with batch b, and a
resumed run reads exactly the tokens it would have. The run dir (zoo/runs.py) holds config.yaml,
metrics.jsonl (train loss, lr, tokens/s, MFU; validation loss), summary.json, ckpt/last.pt, and hf/: the
model as ZooForCausalLM with its tokenizer, loadable by AutoModelForCausalLM.from_pretrained.

It shares with zoo-train the optimizer (`zoo.steps.build_optimizer`), the lr schedule (`lr_lambda`), the run dir,
resumption and the trackers, but keeps its own loop: one model trained for a number of steps over a token
stream, wrapped in DDP or FSDP2 across processes, with gradient accumulation, validation by loss and an HF
export, where zoo.train.train_runs trains one or more recall runs for a number of epochs over fixed synthetic
segments, with early stopping on accuracy, and packs or graphs them. Their needs meet in those shared parts.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from zoo.atomic import staged_dir
from zoo.config import PretrainConfig, register_pretrain_configs
from zoo.device import autocast, resolve_device, set_threads
from zoo.lm_data import PackedWindows, TokenData, prepare, valid_windows
from zoo.models import LanguageModel
from zoo.runs import RunDir, find_resumable, identity_digest
from zoo.steps import build_optimizer, lr_lambda
from zoo.train import ConfigError, load_config, start_tracker

log = logging.getLogger("zoo.pretrain")

EXECUTION_KEYS = (
    "resume",
    "overwrite",
    "progress",
    "threads",
    "device",
    "compile",
    "sample_tokens",
    "export_hf",
    "peak_tflops",
    "stop_after",
)
# Dense bf16 tensor-core peaks (TFLOP/s) for MFU, matched against torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}


def run_name(cfg: PretrainConfig) -> str:
    if cfg.run:
        return cfg.run
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    digest = identity_digest(tree, EXECUTION_KEYS)
    return f"lm-d{cfg.model.d_model}-L{cfg.model.n_layers}-lr{cfg.optim.lr:g}-s{cfg.train.seed}-{digest}"


def flops_per_token(model: LanguageModel) -> float:
    """Training FLOPs per token: 6 per matmul weight (the tied head counted, the embedding lookup not), plus the
    sequence mixing that weights don't count: 12·window·d per sliding-window layer (QKᵀ and AV, forward and
    backward) and 12·H·E·d_v per Based layer (state update and readout)."""
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embedding" not in n)
    if model.config.tie_embeddings:
        matmul += model.embedding.weight.numel()
    mixing = 0
    for block in model.blocks:
        m = block.mixer
        if m.name == "sliding_window":
            mixing += 12 * m.window * m.d_model
        elif m.name == "based":
            mixing += 12 * m.num_heads * m.expanded_dim * m.head_dim_v
        elif m.name == "attention":
            mixing += 6 * m.config.max_seq_len * m.d_model  # causal average over a full window
    return 6.0 * matmul + mixing


def peak_flops(device: torch.device, override_tflops: float) -> float | None:
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


class Dist:
    """The process group under torchrun (WORLD_SIZE > 1), or a single process."""

    def __init__(self, device_name: str) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world > 1:
            use_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
            if use_cuda:
                torch.cuda.set_device(local_rank)
                self.device = torch.device("cuda", local_rank)
            else:
                self.device = torch.device("cpu")
            if not dist.is_initialized():
                dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        else:
            self.device = resolve_device(device_name)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.world
        return value

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def wrap(model: LanguageModel, cfg: PretrainConfig, d: Dist) -> torch.nn.Module:
    """DDP or FSDP2 (fully_shard per block, then the root: embedding, head and final norm) across processes."""
    if d.world == 1:
        return model
    if cfg.train.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict on the CPU, for DDP, FSDP2 or a plain module alike."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(module, ckpt["model"], options=options)
    set_optimizer_state_dict(module, optimizer, ckpt["optimizer"], options=options)


def lm_loss(module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions whose target is not -100: inputs, targets [B, T]. A
    batch with no such position gives 0 (and no gradient), not NaN."""
    logits = module(inputs)  # [B, T, V]
    total = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return total / (targets != -100).sum().clamp(min=1)


@torch.no_grad()
def evaluate(module: torch.nn.Module, data: TokenData, cfg: PretrainConfig, d: Dist, amp) -> float:
    """Mean validation loss over the first `eval_windows` windows, each process taking every world-th one."""
    inputs, targets = valid_windows(data.valid, cfg.data.seq_len, cfg.train.eval_windows, data.valid_labels)
    total = torch.zeros(2, device=d.device, dtype=torch.float64)
    mine = torch.arange(d.rank, len(inputs), d.world)
    module.eval()
    for start in range(0, math.ceil(len(inputs) / d.world), cfg.train.batch_size):
        idx = mine[start : start + cfg.train.batch_size]
        with amp:
            # FSDP needs every rank in every forward: a rank without windows runs one and weighs it 0.
            x, y = (inputs[idx], targets[idx]) if len(idx) else (inputs[:1], targets[:1])
            loss = lm_loss(module, x.to(d.device), y.to(d.device))
        total[0] += loss.double() * len(idx)
        total[1] += len(idx)
    module.train()
    if d.world > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1])


def sample(model: LanguageModel, data: TokenData, n_tokens: int, device: torch.device) -> str:
    """A greedy continuation of the first validation tokens, decoded, through the recurrent step."""
    prompt = data.valid[:16].to(device)
    state = model.init_state(1)
    model.eval()
    with torch.no_grad():
        logits = model(prompt[None], state)[:, -1]
        out = []
        for _ in range(n_tokens):
            nxt = logits.argmax(-1)
            out.append(int(nxt))
            logits = model.step(nxt, state)
    model.train()
    tok = data.tokenizer
    return tok.decode(prompt.tolist()) + " ⟶ " + tok.decode(out)


def export_hf(model: LanguageModel, cfg: PretrainConfig, data: TokenData, path: Path) -> None:
    """The trained weights as a ZooForCausalLM checkpoint (safetensors) with its tokenizer."""
    from zoo.models.hf import ZooConfig, ZooForCausalLM

    tok = data.tokenizer
    config = ZooConfig.from_model_config(
        cfg.model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id
    )
    hf = ZooForCausalLM(config)
    hf.model.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    with staged_dir(path) as staging:  # a kill leaves the last export whole
        hf.save_pretrained(staging)
        tok.save_pretrained(staging)


def pretrain(cfg: PretrainConfig, resolved_yaml: str | None = None) -> dict[str, Any]:
    """Train one run; return its summary (also written to summary.json by the main process)."""
    d = Dist(cfg.train.device)
    try:
        return _pretrain(cfg, resolved_yaml, d)
    finally:
        d.close()


def _load_data(cfg: PretrainConfig, d: Dist) -> TokenData:
    """The tokenized corpus, on every process: the main process tokenizes (and caches) first, so the others read
    its cache instead of racing it. Sets model.vocab_size from the tokenizer where the config asks; a vocabulary
    or a validation split too small for the config is a ConfigError, found before any step."""
    dc = cfg.data

    def load() -> TokenData:
        return prepare(dc.source, dc.tokenizer, dc.bpe_vocab_size, dc.valid_frac, dc.text_field, dc.cache_dir)

    if d.main:
        data = load()
    d.barrier()
    if not d.main:
        data = load()
    if cfg.vocab_from_tokenizer:
        cfg.model.vocab_size = 64 * math.ceil(data.vocab_size / 64)
    elif cfg.model.vocab_size < data.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} < the tokenizer's {data.vocab_size} tokens")
    if len(data.valid) < cfg.data.seq_len + 1:
        raise ConfigError(
            f"the validation split has {len(data.valid)} tokens, fewer than one window of data.seq_len+1="
            f"{cfg.data.seq_len + 1}: lower data.seq_len or raise data.valid_frac"
        )
    return data


def _open_run(cfg: PretrainConfig, d: Dist) -> tuple[str, RunDir, dict[str, Any] | None]:
    """The run's name and dir, and its summary where train.resume=true finds it finished (else None). With
    train.resume=true a run without its dir continues the latest run of its config, whatever its dir's name;
    without it (or train.overwrite=true) an existing run dir is a ConfigError. Every process checks the dir
    before the main one clears it (train.overwrite=true)."""
    tc = cfg.train
    name = run_name(cfg)
    run = RunDir(Path(cfg.runs_root) / cfg.experiment_name / name)
    if tc.resume and not run.exists():
        yaml_text = OmegaConf.to_yaml(OmegaConf.structured(cfg))  # what config.yaml holds
        try:
            run = find_resumable(run.path.parent, yaml_text, EXECUTION_KEYS)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        name = run.path.name
    if run.exists() and not (tc.resume or tc.overwrite):
        raise ConfigError(f"{run.path} already holds a run: pass train.resume=true or train.overwrite=true")
    if tc.resume and run.is_finished():
        log.info("run %s already finished; nothing to resume", run.path)
        return name, run, run.read_summary()
    d.barrier()
    if tc.overwrite and d.main:
        run.clear()
    return name, run, None


def _optimizer_step(cfg: PretrainConfig, d: Dist, module, forward, optimizer, scheduler, windows: PackedWindows,
                    step: int, amp) -> torch.Tensor:
    """One optimizer step over `train.grad_accum` micro-batches of this process's rows of the global batch
    `step`; returns the mean micro-batch loss (a device scalar: no host sync). Under DDP the gradients are
    all-reduced once, on the last micro-batch."""
    tc = cfg.train
    loss_sum = 0.0  # the first micro-batch's loss makes it a device scalar: no zero tensor to allocate each step
    for micro in range(tc.grad_accum):
        inputs, targets = windows.batch(step, (micro * d.world + d.rank) * tc.batch_size, tc.batch_size)
        sync = contextlib.nullcontext()
        if d.world > 1 and tc.parallel == "ddp" and micro < tc.grad_accum - 1:
            sync = module.no_sync()
        with sync, amp:
            loss = lm_loss(forward, inputs.to(d.device), targets.to(d.device))
        (loss / tc.grad_accum).backward()
        loss_sum = loss_sum + loss.detach() / tc.grad_accum
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.optim.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum


def _pretrain(cfg: PretrainConfig, resolved_yaml: str | None, d: Dist) -> dict[str, Any]:
    tc = cfg.train
    data = _load_data(cfg, d)
    name, run, finished = _open_run(cfg, d)
    if finished is not None:
        return finished

    torch.manual_seed(tc.seed)
    model = LanguageModel(cfg.model).to(d.device)
    n_params = model.num_parameters()
    fpt = flops_per_token(model)
    module = wrap(model, cfg, d)
    optimizer = build_optimizer(module, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.optim, tc.steps)
    )
    amp = autocast(d.device, tc.precision)
    forward = torch.compile(module, mode=tc.compile_mode) if tc.compile else module
    global_batch = d.world * tc.batch_size * tc.grad_accum
    windows = PackedWindows(data.train, cfg.data.seq_len, global_batch, tc.seed, data.train_labels)
    tokens_per_step = global_batch * cfg.data.seq_len

    step, wall_before, best_valid = 0, 0.0, float("inf")
    ckpt = run.load_checkpoint() if tc.resume else None
    if ckpt is not None:
        load_state(module, optimizer, ckpt)
        scheduler.load_state_dict(ckpt["scheduler"])
        step, wall_before, best_valid = ckpt["step"], ckpt["wall_time_s"], ckpt["best_valid_loss"]
        if d.main:
            run.truncate_metrics(step)
        log.info("resuming %s at step %d", run.path, step)
    if d.main:
        # The structured config, not Hydra's text: it carries the vocab size taken from the tokenizer.
        run.write_config(OmegaConf.to_yaml(OmegaConf.structured(cfg)) + f"run_dir: {run.path}\n")
        tracker = start_tracker(cfg, run, name)
        log.info(
            "run %s: %d parameters, %d train tokens (%.2f epochs), %d processes (%s) on %s",
            run.path,
            n_params,
            len(data.train),
            windows.epoch_of(tc.steps),
            d.world,
            tc.parallel if d.world > 1 else "single",
            d.device,
        )
    peak = peak_flops(d.device, tc.peak_tflops)

    def checkpoint() -> None:
        state = {"model": model_state(module), "optimizer": optimizer_state(module, optimizer)}
        if d.main:
            run.save_checkpoint(
                {
                    **state,
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "best_valid_loss": best_valid,
                    "wall_time_s": wall_before + time.perf_counter() - t0,
                    "world_size": d.world,
                }
            )

    t0 = time.perf_counter()
    bar = tqdm(total=tc.steps, initial=step, desc=name, disable=not (tc.progress and d.main), dynamic_ncols=True)
    loss_sum = torch.zeros((), device=d.device)
    loss_n, t_log, train_time_window = 0, time.perf_counter(), 0.0
    module.train()
    start_step = step
    while step < tc.steps:
        if tc.stop_after and step - start_step >= tc.stop_after:
            bar.close()
            log.info("stopping at step %d (train.stop_after=%d); resume with train.resume=true", step, tc.stop_after)
            return {}
        loss_sum += _optimizer_step(cfg, d, module, forward, optimizer, scheduler, windows, step, amp)
        step += 1
        loss_n += 1
        bar.update(1)
        if step % tc.log_every == 0 or step == tc.steps:
            train_loss = float(d.mean(loss_sum / loss_n))  # the one host sync of the loop, every log_every steps
            now = time.perf_counter()
            tokens_per_s = loss_n * tokens_per_step / (now - t_log)
            record = {
                "step": step,
                "train/loss": train_loss,
                "lr": scheduler.get_last_lr()[0],
                "tokens": step * tokens_per_step,
                "tokens_per_s": tokens_per_s,
                "mfu": tokens_per_s * fpt / (peak * d.world) if peak else None,
            }
            if d.main:
                tracker.log(record)
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            loss_sum.zero_()
            loss_n = 0
            train_time_window += now - t_log
            t_log = time.perf_counter()
        if step % tc.eval_every == 0 or step == tc.steps:
            valid_loss = evaluate(module, data, cfg, d, amp)
            best_valid = min(best_valid, valid_loss)
            if d.main:
                tracker.log({"step": step, "valid/loss": valid_loss, "valid/ppl": math.exp(min(valid_loss, 50.0))})
                bar.set_postfix(valid=f"{valid_loss:.3f}", refresh=True)
            if tc.ckpt_every == 0:
                checkpoint()
            t_log = time.perf_counter()  # evaluation and checkpoints stay out of tokens/s
        if tc.ckpt_every and step % tc.ckpt_every == 0:
            checkpoint()
            t_log = time.perf_counter()
    bar.close()
    wall = wall_before + time.perf_counter() - t0
    final_valid = evaluate(module, data, cfg, d, amp)
    full_state = model_state(module)  # collective under FSDP: every process takes part
    if not d.main:
        return {}
    metrics = run.read_metrics()
    rates = [r["tokens_per_s"] for r in metrics if "tokens_per_s" in r]
    tokens_per_s = sorted(rates)[len(rates) // 2] if rates else 0.0  # the median of the logged windows
    plain = LanguageModel(cfg.model)
    plain.load_state_dict(full_state)
    summary = {
        "experiment": cfg.experiment_name,
        "run": name,
        "layers": cfg.model.layers(),
        "d_model": cfg.model.d_model,
        "parameters": n_params,
        "vocab_size": cfg.model.vocab_size,
        "tokenizer": data.tokenizer_id,
        "train_tokens_available": len(data.train),
        "tokens_seen": step * tokens_per_step,
        "epochs": windows.epoch_of(step),
        "steps": step,
        "world_size": d.world,
        "parallel": tc.parallel if d.world > 1 else "single",
        "valid/loss": final_valid,
        "valid/ppl": math.exp(min(final_valid, 50.0)),
        "best_valid_loss": best_valid,
        "train/loss": next((r["train/loss"] for r in reversed(metrics) if "train/loss" in r), None),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "mfu": tokens_per_s * fpt / (peak * d.world) if peak else None,
        "state_bytes_fp32_per_seq": 4 * plain.state_size(cfg.data.seq_len),
        "wall_time_s": wall,
        "device": str(d.device),
    }
    if tc.sample_tokens:
        summary["sample"] = sample(plain.to(d.device), data, tc.sample_tokens, d.device)
    if tc.export_hf:
        export_hf(plain, cfg, data, run.path / "hf")
    run.write_summary(summary)
    tracker.finish(summary)
    return summary


USAGE = """usage: zoo-pretrain [--cfg] [--version] [--config-name NAME] [KEY=VALUE ...]

Pretrain a causal LM on text. Overrides use Hydra syntax over zoo/configs/pretrain.yaml (or NAME.yaml):
  zoo-pretrain                                   based_tiny on the embedded corpus (CPU, ~2 minutes)
  zoo-pretrain model=based_360m lm_data@data=files data.source=/data/text
  torchrun --nproc_per_node=2 -m zoo.pretrain train.parallel=fsdp
  zoo-pretrain train.resume=true                 continue the latest run of this config
  zoo-pretrain --cfg [KEY=VALUE ...]            print the resolved config and exit
Main options (every field and default: zoo/config.py PretrainConfig):
  model=PRESET lm_data@data=embedded|files data.source=PATH data.tokenizer=bpe|smollm2|PATH
  train.steps=N train.batch_size=N optim.lr=X train.device=auto|cpu|cuda train.threads=N (0: cores available)
  train.resume=true | train.overwrite=true   train.compile=true   runs_root=DIR
Runs go to runs/<experiment_name>/<run>/ (metrics.jsonl, summary.json, ckpt/, hf/)."""


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(USAGE)
        return
    show = "--cfg" in args
    args = [a for a in args if a != "--cfg"]
    config_name = "pretrain"
    if "--config-name" in args:
        i = args.index("--config-name")
        config_name = args[i + 1]
        del args[i : i + 2]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        register_pretrain_configs()
        cfg, resolved = load_config(args, config_name=config_name)
        if show:
            print(resolved, end="")
            return
        set_threads(cfg.train.threads)
        summary = pretrain(cfg, resolved)
    except ConfigError as e:
        print(f"zoo-pretrain: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if summary:
        keys = ["valid/loss", "valid/ppl", "tokens_per_s", "mfu", "parameters", "wall_time_s"]
        print(" ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else f"{k}={summary[k]}" for k in keys))
        if "sample" in summary:
            print("sample:", summary["sample"])


if __name__ == "__main__":
    main()
