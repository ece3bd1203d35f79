"""Packed training: runs that differ only in their learning rate, trained together as one vmapped model.

    zoo-train model=based train.pack_lrs=[1e-4,1e-3,1e-2]       # three runs in one process
    zoo-sweep experiments/zoology_fig2/sweep.py --pack-lrs        # each group of runs differing in optim.lr

A tiny MQAR model leaves a GPU idle between kernel launches. N models of one shape, stacked along a leading
member axis, run with the launches of one. Every member is still its own run: it lands in the run dir of its
unpacked config (same `run_name`, so a sweep skips it once finished) and writes the same config.yaml,
metrics.jsonl, summary.json (plus `pack_size`) and ckpt/last.pt, in zoo.train's format, so either path
resumes it. Each member stops early on its own: once it reaches train.early_stop it is evaluated, finalised
and dropped from the pack; the others go on.

How:
- The N members' parameters live in one flat tensor [N, P]; each named parameter is a view [N, *shape] of
  it. `torch.func.functional_call` under `torch.func.vmap` computes `zoo.eval.query_loss` of all members on
  the same batch; the sum of the N losses backpropagates into that tensor's grad [N, P].
- AdamW is written out on [N, P] with a per-member learning rate [N, 1]: zoo.train's update (torch AdamW),
  weight decay on matrices only, warmup + cosine (`zoo.train.lr_lambda`) and gradient-norm clipping per
  member, in a few ops whatever the number of parameter tensors.
- Evaluation and checkpoints copy a member's parameters into one plain LanguageModel, so the metrics are
  zoo.eval's own.

Limits, each a one-line PackError before any work:
- Members share train.seed: zoo.train draws the batch order from it, so runs of other seeds see other
  batches and cannot share a forward pass. Pack learning rates; run seeds as separate packs.
- Every mixer runs in PyTorch, at impl=naive (or impl=chunk for DeltaNet and Gated DeltaNet): the FLA and
  Triton kernels have no vmap rule.
- No train.compile (train.cuda_graph captures the whole step instead) and no wandb mirror yet.
- Before training, every row's loss and gradient on 8 examples must equal the plain model's (`check_agreement`):
  on the H200, vmapped attention trained to NaN within 50 steps (session 4), so a device whose vmap rules
  compute something else gets a PackError, and zoo-sweep trains those runs unpacked. Inside the pack,
  scaled_dot_product_attention uses its math backend.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from zoo.config import SPLITS, Config, ConfigError, OptimConfig
from zoo.device import autocast, resolve_device
from zoo.eval import evaluate, query_loss
from zoo.models import LanguageModel
from zoo.models.mixers import MIXERS
from zoo.models.mixers._common import PYTORCH_IMPLS, make_config
from zoo.runs import RunDir
from zoo.train import (
    Tracker,
    build_optimizer,
    checkpoint_state,
    epoch_batches,
    load_split,
    lr_lambda,
    run_name,
    run_summary,
)

log = logging.getLogger("zoo.packed")


class PackError(ConfigError):
    """These runs cannot be trained as one pack; the message (one line) says why."""


def pack_members(cfg: Config, lrs: list[float] | None = None) -> list[Config]:
    """The member configs of a pack: `cfg` with optim.lr set to each of `lrs` (default: cfg.train.pack_lrs)."""
    lrs = list(cfg.train.pack_lrs if lrs is None else lrs)
    if not lrs:
        raise PackError("a pack needs at least one learning rate (train.pack_lrs=[...])")
    return [
        dataclasses.replace(
            cfg, optim=dataclasses.replace(cfg.optim, lr=float(lr)), train=dataclasses.replace(cfg.train, pack_lrs=[])
        )
        for lr in lrs
    ]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _first_difference(a: Config, b: Config) -> str:
    fa, fb = (_flatten(OmegaConf.to_container(OmegaConf.structured(c))) for c in (a, b))
    for key in sorted(set(fa) | set(fb)):
        if fa.get(key) != fb.get(key):
            return f"{key}: {fa.get(key)!r} vs {fb.get(key)!r}"
    return "?"


def check_pack(members: list[Config]) -> None:
    """Raise PackError unless `members` can train as one pack (see the module docstring)."""
    if not members:
        raise PackError("a pack needs at least one run")
    first = members[0]
    lrs = [m.optim.lr for m in members]
    if len(set(lrs)) != len(lrs):
        raise PackError(f"the learning rates of a pack must be distinct, got {lrs}")
    for m in members:
        if m.train.pack_lrs:
            raise PackError("a pack member must not set train.pack_lrs itself (use zoo.packed.pack_members)")
        if dataclasses.replace(m, optim=dataclasses.replace(m.optim, lr=first.optim.lr)) != first:
            raise PackError(f"packed runs may differ only in optim.lr, but {_first_difference(first, m)}")
    if len({run_name(m) for m in members}) != len(members):
        raise PackError(f"the runs of a pack need distinct run dirs, but run={first.run!r} names them all")
    if first.train.compile:
        raise PackError("train.compile=true is not supported for packed runs; set train.compile=false")
    if first.logger.backend != "none":
        raise PackError(f"logger.backend={first.logger.backend} is not supported for packed runs; use logger=none")
    for name in dict.fromkeys(first.model.layers()):
        options = dict(first.model.mixers.get(name, {}))
        impl = getattr(make_config(name, MIXERS[name].Config, first.model.d_model, options), "impl", "naive")
        if impl not in PYTORCH_IMPLS:
            raise PackError(
                f"mixer {name} has impl={impl}, which has no torch.func.vmap rule; packed runs need impl=naive "
                "(or DeltaNet's impl=chunk)"
            )


class _QueryLoss(nn.Module):
    """query_loss as a module's forward, so `functional_call` can swap the LanguageModel's parameters."""

    def __init__(self, lm: LanguageModel) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs: torch.Tensor, query_pos: torch.Tensor, query_labels: torch.Tensor) -> torch.Tensor:
        return query_loss(self.lm, inputs, query_pos, query_labels)


class _Pack:
    """N members' parameters and AdamW moments as [N, P] tensors, and their vmapped loss and update."""

    def __init__(self, model: LanguageModel, lrs: list[float], optim: OptimConfig, total_steps: int) -> None:
        self.model = model
        self.total_steps = total_steps
        self.loss_module = _QueryLoss(model)
        # named_parameters() lists a tied weight once; functional_call ties it again (tie_weights=True).
        named = list(model.named_parameters())
        self.names = [name for name, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.offsets = [0]
        for p in (p for _, p in named):
            self.offsets.append(self.offsets[-1] + p.numel())
        n = len(lrs)
        one = torch.cat([p.detach().reshape(-1) for _, p in named])  # [P]
        self.flat = one.expand(n, -1).clone().requires_grad_(True)  # [N, P]
        self.exp_avg = torch.zeros_like(self.flat, requires_grad=False)
        self.exp_avg_sq = torch.zeros_like(self.flat, requires_grad=False)
        # zoo.train.build_optimizer: weight decay on matrices (ndim >= 2) only.
        self.decay = torch.cat(
            [torch.full((p.numel(),), optim.weight_decay if p.ndim >= 2 else 0.0, device=one.device) for _, p in named]
        )  # [P]
        self.lrs = torch.tensor(lrs, dtype=one.dtype, device=one.device)  # [N]
        self.optim = optim
        self.buffers = {f"lm.{k}": v for k, v in model.named_buffers()}
        self._batched_loss = vmap(self._member_loss, in_dims=(0, None, None, None))

    def __len__(self) -> int:
        return self.flat.shape[0]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> [N, *shape] views of a [N, P] tensor."""
        # One split, not a slice per parameter: split's backward is one cat into [N, P], where slices would
        # each scatter into a zero-filled [N, P] and add.
        sizes = [b - a for a, b in zip(self.offsets, self.offsets[1:])]
        pieces = torch.split(flat, sizes, dim=1)
        return {name: x.view(flat.shape[0], *shape) for name, shape, x in zip(self.names, self.shapes, pieces)}

    def _member_loss(self, params, inputs, query_pos, query_labels):
        params = {f"lm.{k}": v for k, v in params.items()}
        return functional_call(self.loss_module, (params, self.buffers), (inputs, query_pos, query_labels))

    def losses(self, inputs: torch.Tensor, query_pos: torch.Tensor, query_labels: torch.Tensor) -> torch.Tensor:
        """The loss of every member on one batch: [N].

        scaled_dot_product_attention runs its math backend here: under vmap on the H200 the fused kernels gave
        NaN losses within the first 50 steps at every lr (session 4), where the unpacked model trains."""
        with sdpa_kernel(SDPBackend.MATH):
            return self._batched_loss(self.views(self.flat), inputs, query_pos, query_labels)

    def check_agreement(self, model: LanguageModel, batch: tuple[torch.Tensor, ...], amp, rtol: float) -> None:
        """PackError unless every row's loss and gradient on `batch` equal those of the plain `model` holding that
        row's parameters, within `rtol` (relative to the gradient's norm): a vmap rule that computes something else
        on this device, for any member, must not train the pack silently. A vmapped forward or backward that raises
        is a PackError too (on the H200, sliding-window attention's masked math SDPA under vmap and bf16 autocast
        raised "expected input and grad types to match" in its backward), so that zoo-sweep trains those runs
        unpacked."""
        try:
            with amp:
                losses = self.losses(*batch)
            # members do not interact, so the gradient of the sum holds each member's own gradient in its row
            (grad,) = torch.autograd.grad(losses.sum(), self.flat)
        except RuntimeError as e:  # e.g. a vmapped backward with no rule for this dtype on this device
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PackError(
                f"the vmapped model fails on {self.flat.device} ({first}); train these runs unpacked"
            ) from e
        for row in range(len(self)):
            self.to_model(row, model)
            with amp:
                loss = query_loss(model, *batch)
            ref = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
            ref = torch.cat([g.reshape(-1) for g in ref]).float()
            got = grad[row].float()
            err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
            loss_err = abs(float(losses[row]) - float(loss)) / max(abs(float(loss)), 1e-30)
            if not (torch.isfinite(got).all() and err <= rtol and loss_err <= rtol):
                raise PackError(
                    f"the vmapped model disagrees with the plain one on {self.flat.device} for member {row} (loss "
                    f"{float(losses[row]):.4g} vs {float(loss):.4g}, gradient relative error {err:.3g} > {rtol:g}); "
                    "train these runs unpacked"
                )

    @torch.no_grad()
    def adamw_step(self, lr_factor: float | torch.Tensor, t: int | torch.Tensor) -> None:
        """torch.optim.AdamW's update at step t (1-based) with lr = lrs·lr_factor, after clipping per member.

        `lr_factor` and `t` may be 0-dim device tensors: then the update reads no host value, so a CUDA graph
        can capture it and replay it at every step (`_CapturedSteps`)."""
        o = self.optim
        g = self.flat.grad  # [N, P]
        if o.grad_clip > 0:
            # torch.nn.utils.clip_grad_norm_, one norm per member.
            norm = torch.linalg.vector_norm(g, dim=1, keepdim=True)  # [N, 1]
            g = g * (o.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        lr = (self.lrs * lr_factor)[:, None]  # [N, 1]
        self.flat.mul_(1 - lr * self.decay)
        self.exp_avg.lerp_(g, 1 - o.beta1)
        self.exp_avg_sq.mul_(o.beta2).addcmul_(g, g, value=1 - o.beta2)
        denom = (self.exp_avg_sq.sqrt() / (1 - o.beta2**t) ** 0.5).add_(o.eps)
        self.flat.sub_(lr / (1 - o.beta1**t) * self.exp_avg / denom)

    def keep(self, rows: list[int]) -> None:
        """Drop every member not in `rows` (members that stopped early leave the pack)."""
        index = torch.tensor(rows, device=self.flat.device)
        self.flat = self.flat.detach()[index].requires_grad_(True)
        self.exp_avg, self.exp_avg_sq, self.lrs = self.exp_avg[index], self.exp_avg_sq[index], self.lrs[index]

    @torch.no_grad()
    def to_model(self, row: int, model: LanguageModel) -> LanguageModel:
        """Copy member `row`'s parameters into a plain `model` (same config) and return it."""
        views = self.views(self.flat.detach())
        for name, p in model.named_parameters():
            p.copy_(views[name][row])
        return model

    def optimizer_state(self, row: int, model: LanguageModel, cfg: Config, step: int) -> tuple[dict, dict]:
        """Member `row`'s optimizer and scheduler state dicts in zoo.train's format (`model` holds its params)."""
        optimizer = build_optimizer(model, cfg)
        f = lr_lambda(self.total_steps, cfg.optim.warmup_frac, cfg.optim.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, f)
        m, v = self.views(self.exp_avg), self.views(self.exp_avg_sq)
        params = dict(model.named_parameters())
        for name in self.names:
            optimizer.state[params[name]] = {
                "step": torch.tensor(float(step)),
                "exp_avg": m[name][row].clone(),
                "exp_avg_sq": v[name][row].clone(),
            }
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * f(step)
        sched = scheduler.state_dict()
        sched.update(last_epoch=step, _step_count=step + 1, _last_lr=[g["lr"] for g in optimizer.param_groups])
        return optimizer.state_dict(), sched

    @torch.no_grad()
    def load(self, row: int, ckpt: dict, model: LanguageModel, cfg: Config) -> None:
        """Member `row` from a zoo.train checkpoint (`model` is scratch space of the same config)."""
        model.load_state_dict(ckpt["model"])
        optimizer = build_optimizer(model, cfg)
        optimizer.load_state_dict(ckpt["optimizer"])
        params = dict(model.named_parameters())
        flat, m, v = self.views(self.flat.detach()), self.views(self.exp_avg), self.views(self.exp_avg_sq)
        for name in self.names:
            flat[name][row].copy_(params[name])
            state = optimizer.state.get(params[name])
            if state:
                m[name][row].copy_(state["exp_avg"])
                v[name][row].copy_(state["exp_avg_sq"])


class _CapturedSteps:
    """The pack's training step as one CUDA graph per (segment, batch size), captured once and replayed.

    The graph holds the batch gather from the segment's device tensors, the vmapped forward and backward and
    the AdamW update, which reads its lr factor and step count from device scalars: a step is three small
    device writes and one replay, where the eager step launches hundreds of kernels. Capture follows
    PyTorch's whole-network recipe: a warm-up on a side stream, then the capture with the gradient unset, so
    it lives in the graph's pool. The warm-up's updates (and its RNG draws) are undone, so the first replay is
    the eager step. `capture=False` runs the same static-buffer path eagerly (the CPU tests use it).
    """

    def __init__(self, pack: _Pack, device: torch.device, precision: str, capture: bool = True, warmup: int = 2):
        self.pack, self.device, self.precision = pack, device, precision
        self.capture, self.warmup = capture, warmup
        self.lr_factor = torch.zeros((), device=device)
        self.t = torch.zeros((), device=device)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor | None]] = {}

    def reset(self) -> None:
        """Forget the graphs: pack.keep() replaced the tensors they captured."""
        self.graphs.clear()

    def _body(self, seg, idx: torch.Tensor) -> torch.Tensor:
        pack = self.pack
        # Autocast's weight cache would hold casts across replays; the pack's views are no leaves anyway.
        with autocast(self.device, self.precision, cache=False):
            losses = pack.losses(seg.inputs[idx], seg.query_pos[idx], seg.query_labels[idx])
        pack.flat.grad = None
        losses.sum().backward()
        pack.adamw_step(self.lr_factor, self.t)
        return losses.detach()

    def step(self, seg, idx: torch.Tensor, lr_factor: float, t: int) -> torch.Tensor:
        """One training step of every member on `seg`'s examples `idx`; returns their losses [N]."""
        self.lr_factor.fill_(lr_factor)
        self.t.fill_(t)
        key = (id(seg), idx.numel())
        if key not in self.graphs:
            self.graphs[key] = self._capture(seg, idx)
        graph, static_idx, losses = self.graphs[key]
        static_idx.copy_(idx)
        if graph is None:
            return self._body(seg, static_idx)
        graph.replay()
        return losses

    def _capture(self, seg, idx: torch.Tensor):
        static_idx = idx.clone()
        if not self.capture:
            return None, static_idx, None
        pack, device = self.pack, self.device
        saved = [x.detach().clone() for x in (pack.flat, pack.exp_avg, pack.exp_avg_sq)]
        rng = torch.cuda.get_rng_state(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._body(seg, static_idx)
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.no_grad():
            for x, old in zip((pack.flat, pack.exp_avg, pack.exp_avg_sq), saved):
                x.copy_(old)
        torch.cuda.set_rng_state(rng, device)
        pack.flat.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            losses = self._body(seg, static_idx)
        log.info("captured the training step for batch %d of a %d-token segment", idx.numel(), seg.inputs.shape[1])
        return graph, static_idx, losses


def train_packed(members: list[Config], resolved: list[str | None] | None = None) -> list[dict[str, Any]]:
    """Train runs that differ only in optim.lr as one pack; return their summaries, in `members` order.

    `resolved`: each member's resolved YAML for its config.yaml (default: the dataclass tree as YAML).
    """
    check_pack(members)
    resolved = list(resolved) if resolved is not None else [None] * len(members)
    cfg = members[0]
    names = [run_name(m) for m in members]
    runs = [RunDir(Path(cfg.runs_root) / cfg.experiment_name / name) for name in names]
    for run in runs:
        if run.exists() and not (cfg.train.resume or cfg.train.overwrite):
            raise ConfigError(
                f"{run.path} already holds a run: pass train.resume=true to continue it or train.overwrite=true"
            )
    summaries: list[dict[str, Any] | None] = [None] * len(members)
    todo = []
    for i, run in enumerate(runs):
        if cfg.train.resume and run.is_finished():
            log.info("run %s already finished; nothing to resume", run.path)
            summaries[i] = run.read_summary()
            continue
        if cfg.train.overwrite:
            run.clear()
        todo.append(i)
    if not todo:
        return summaries
    ckpts = [runs[i].load_checkpoint() if cfg.train.resume else None for i in todo]
    at = {(c["epoch"], c["step"]) for c in ckpts if c is not None}
    if len(at) > 1 or (at and any(c is None for c in ckpts)):
        where = ", ".join(names[i] + ("@" + str(c["epoch"]) if c else "@none") for i, c in zip(todo, ckpts))
        raise PackError(f"the runs of this pack stopped at different checkpoints ({where}); resume them unpacked")

    device = resolve_device(cfg.train.device)
    amp = autocast(device, cfg.train.precision)
    # As zoo.train: seed, data, model, so a member starts from its unpacked run's initial weights.
    torch.manual_seed(cfg.train.seed)
    data = {split: load_split(cfg, split, device) for split in SPLITS}
    model = LanguageModel(cfg.model).to(device)
    scratch = copy.deepcopy(model)  # evaluation and checkpoints, one member at a time
    steps_per_epoch = sum(seg.num_batches() for seg in data["train"])
    total_steps = steps_per_epoch * cfg.train.epochs
    pack = _Pack(model, [members[i].optim.lr for i in todo], cfg.optim, total_steps)
    f = lr_lambda(total_steps, cfg.optim.warmup_frac, cfg.optim.min_lr_ratio)
    first = data["train"][0]
    check = first.inputs[:8], first.query_pos[:8], first.query_labels[:8]
    # bf16 autocast rounds the two computations differently; fp32 agrees to rounding
    pack.check_agreement(scratch, check, amp, rtol=5e-2 if device.type == "cuda" else 1e-3)

    n = len(todo)
    start_epoch, step, wall_before, tokens = 0, 0, 0.0, 0
    best = [0.0] * n
    if at:
        for row, (i, ckpt) in enumerate(zip(todo, ckpts)):
            pack.load(row, ckpt, scratch, members[i])
            best[row] = ckpt["best_valid_accuracy"]
        c = ckpts[0]
        start_epoch, step, wall_before, tokens = c["epoch"], c["step"], c["wall_time_s"], c["train_tokens"]
        torch.set_rng_state(c["rng_cpu"])
        log.info("resuming pack of %d runs at epoch %d, step %d", n, start_epoch, step)
    for i in todo:
        if cfg.train.resume:
            runs[i].truncate_metrics(step)
        text = resolved[i] or OmegaConf.to_yaml(OmegaConf.structured(members[i]))
        runs[i].write_config(text + f"run_dir: {runs[i].path}\n")
    trackers = [Tracker(runs[i]) for i in todo]
    log.info(
        "pack of %d runs (lr %s): %d parameters each on %s",
        n,
        [members[i].optim.lr for i in todo],
        model.num_parameters(),
        device,
    )

    t0 = time.perf_counter()

    def finish(row: int, j: int, stopped_early: bool) -> None:
        """Evaluate member j (pack row `row`) on valid and test and write its summary."""
        i = todo[j]
        member = pack.to_model(row, scratch)
        train_time = wall_before + time.perf_counter() - t0
        final_valid = evaluate(member, data["valid"], "valid", amp)
        test = evaluate(member, data["test"], "test", amp)
        trackers[j].log({"step": step, "epoch": epoch, **test})
        summary = run_summary(
            members[i],
            names[i],
            member,
            final_valid,
            test,
            best[j],
            epoch,
            step,
            stopped_early,
            train_time,
            tokens,
            device,
        )
        summary["pack_size"] = n
        runs[i].write_summary(summary)
        summaries[i] = summary

    def is_stopped(accuracy: float) -> bool:
        return cfg.train.early_stop is not None and accuracy >= cfg.train.early_stop

    # live[row] is the member (index into todo) in pack row `row`.
    epoch = start_epoch
    live = list(range(n))
    if at:
        # A member whose checkpoint already met early_stop is finalised without training, as in zoo.train.
        done = [row for row in range(n) if is_stopped(best[row])]
        for row in done:
            finish(row, live[row], True)
        if done:
            rows = [row for row in range(n) if row not in done]
            live = [live[row] for row in rows]
            if rows:
                pack.keep(rows)
    graphs = None
    if cfg.train.cuda_graph:
        if device.type != "cuda":
            log.warning("train.cuda_graph=true needs CUDA: on %s the same step runs without a graph", device)
        graphs = _CapturedSteps(pack, device, cfg.train.precision, capture=device.type == "cuda")
    bar = tqdm(total=total_steps, initial=step, desc=f"pack of {n}", disable=not cfg.train.progress, dynamic_ncols=True)
    while epoch < cfg.train.epochs and live:
        loss_sum = torch.zeros(len(live), device=device)
        loss_n = 0
        for seg, idx in epoch_batches(data["train"], cfg.train.seed, epoch, device):
            if graphs is not None:
                losses = graphs.step(seg, idx, f(step), step + 1)
            else:
                with amp:
                    losses = pack.losses(seg.inputs[idx], seg.query_pos[idx], seg.query_labels[idx])  # [N]
                pack.flat.grad = None
                losses.sum().backward()
                pack.adamw_step(f(step), step + 1)
            step += 1
            tokens += idx.numel() * seg.inputs.shape[1]
            loss_sum += losses.detach()
            loss_n += 1
            bar.update(1)
            if step % cfg.train.log_every == 0:
                train_loss = (loss_sum / loss_n).tolist()
                loss_sum.zero_()
                loss_n = 0
                for row, j in enumerate(live):
                    lr = members[todo[j]].optim.lr * f(step)
                    trackers[j].log({"step": step, "epoch": epoch, "train/loss": train_loss[row], "lr": lr})
        epoch += 1
        if epoch % cfg.train.eval_every == 0 or epoch == cfg.train.epochs:
            rows = []
            for row, j in enumerate(live):
                member = pack.to_model(row, scratch)
                metrics = evaluate(member, data["valid"], "valid", amp)
                best[j] = max(best[j], metrics["valid/accuracy"])
                trackers[j].log({"step": step, "epoch": epoch, **metrics})
                optimizer_state, scheduler_state = pack.optimizer_state(row, member, members[todo[j]], step)
                wall = wall_before + time.perf_counter() - t0
                runs[todo[j]].save_checkpoint(
                    checkpoint_state(member, optimizer_state, scheduler_state, epoch, step, best[j], wall, tokens)
                )
                if is_stopped(metrics["valid/accuracy"]):
                    finish(row, j, True)
                else:
                    rows.append(row)
            if len(rows) < len(live):
                live = [live[row] for row in rows]
                if rows:
                    pack.keep(rows)
                    if graphs is not None:
                        graphs.reset()
    bar.close()
    for row, j in enumerate(live):
        finish(row, j, False)
    return summaries
