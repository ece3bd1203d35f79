"""Step strategies of the one training loop (`zoo.train.train_runs`): how one optimizer step of its runs is made.

The loop owns everything a run is (run dirs, data order, evaluation, early stopping, checkpoints, summaries);
a strategy owns the parameters and optimizer state of the runs it trains and makes their steps:

- `PlainStep`: one run, a `LanguageModel` and torch's AdamW; `train.compile=true` compiles its loss.
- `PackedStep`: N runs that differ only in their learning rate and seed, as one vmapped model (`PackedParams`):
  the N members' parameters live in one flat tensor [N, P] and `torch.func.vmap` computes every member's loss
  with the launches of one; AdamW is written out on [N, P] with a per-member learning rate. Members of one seed
  share each batch; members of several seeds each start from their own seed's init and see their own seed's
  batch order, stacked as [N, B, ...] batches.
  `train.cuda_graph=true` (on CUDA) captures the whole step, forward, backward and update, as a CUDA graph per
  batch shape (`zoo.graphs.StaticGraph`). A pack of one is not vmapped, so a single run can be graphed with
  any impl, the Triton and FLA kernels included.

Several runs on one GPU at the same time (the concurrent strategy) are separate processes under CUDA MPS,
started by `zoo-sweep` (zoo/sweep.py).

Every strategy reads and writes the same checkpoint format (`zoo.train.checkpoint_state`), so a run resumes
under any of them. A pack's limits are each a one-line PackError before any work (`check_pack`):
- Members differ only in optim.lr and train.seed, each (lr, seed) once. Members of several seeds need one
  training segment: each seed's epoch interleaves a mixture's segments in its own order, so at one step the
  members' batches would come from segments of other shapes.
- In a pack of several, every mixer runs an impl that torch.func.vmap can batch (its class's `vmap_impls`): the
  PyTorch forms (impl=naive, or impl=chunk for DeltaNet and Gated DeltaNet), and the Triton kernels of Mamba,
  RWKV-4 and Based, whose custom ops have vmap rules (one launch for the whole pack). The FLA kernels have none.
- No wandb mirror. train.compile=true compiles the members' vmapped loss (forward and backward); with
  train.cuda_graph=true too, the compiled step is what the graph captures.
- Before training, every row's loss and gradient on 8 examples must equal the plain model's
  (`PackedParams.check_agreement`), so a device whose vmap rules compute something else fails loudly and
  zoo-sweep trains those runs unpacked.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from zoo.config import Config, ConfigError, OptimConfig
from zoo.device import autocast
from zoo.eval import query_loss
from zoo.graphs import StaticGraph
from zoo.models import LanguageModel
from zoo.models.mixers import MIXERS
from zoo.models.mixers._common import PYTORCH_IMPLS, make_config

log = logging.getLogger("zoo.steps")


def lr_lambda(optim: OptimConfig, total_steps: int, epochs: int | None = None):
    """The factor of the peak lr at each step, by `optim.schedule`:
    - "cosine": linear warmup over `warmup_frac` of the steps, then cosine down to `min_lr_ratio` of the peak;
    - "cosine_epoch": Zoology's CosineAnnealingLR(T_max=epochs) stepped after each epoch: epoch e of `epochs`
      (total_steps // epochs steps each) trains at min + (1 - min)·(1 + cos(π e / epochs)) / 2 throughout."""
    min_ratio = optim.min_lr_ratio
    if optim.schedule == "cosine_epoch":
        if not epochs:
            raise ConfigError("optim.schedule=cosine_epoch needs an epoch count; this trainer counts steps only")
        per_epoch = max(1, total_steps // epochs)

        def by_epoch(step: int) -> float:
            epoch = min(step // per_epoch, epochs - 1)
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * epoch / epochs))

        return by_epoch
    warmup = int(total_steps * optim.warmup_frac)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def decayed(p: torch.Tensor, optim: OptimConfig) -> bool:
    """Whether AdamW decays this parameter: matrices only (`optim.decay="matrices"`), or every one ("all")."""
    return optim.decay == "all" or p.ndim >= 2


def build_optimizer(model: torch.nn.Module, cfg: Config, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW; weight decay on the parameters `decayed` picks. `fused`: torch's fused implementation on CUDA
    parameters, one kernel for every parameter instead of a few per parameter group."""
    o = cfg.optim
    decay = [p for p in model.parameters() if p.requires_grad and decayed(p, o)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not decayed(p, o)]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = fused and all(p.is_cuda for p in decay + no_decay) or None
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)


class PackError(ConfigError):
    """These runs cannot be trained as one pack; the message (one line) says why."""


def pack_members(cfg: Config, lrs: list[float] | None = None, seeds: list[int] | None = None) -> list[Config]:
    """The member configs of a pack: `cfg` at each (seed, lr) of `seeds` × `lrs`, seed by seed (defaults:
    cfg.train.pack_seeds and cfg.train.pack_lrs; an empty list keeps cfg's own train.seed or optim.lr)."""
    lrs = list(cfg.train.pack_lrs if lrs is None else lrs)
    seeds = list(cfg.train.pack_seeds if seeds is None else seeds)
    if not lrs and not seeds:
        raise PackError("a pack needs learning rates or seeds (train.pack_lrs=[...], train.pack_seeds=[...])")
    return [
        dataclasses.replace(
            cfg, optim=dataclasses.replace(cfg.optim, lr=float(lr)),
            train=dataclasses.replace(cfg.train, pack_lrs=[], pack_seeds=[], seed=int(seed)),
        )
        for seed in seeds or [cfg.train.seed] for lr in lrs or [cfg.optim.lr]
    ]


def several_seeds(members: list[Config]) -> bool:
    """Whether a pack's members differ in train.seed: then each starts from its own seed's init and steps on its
    own seed's batch ([N, B] batches)."""
    return len({m.train.seed for m in members}) > 1


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


def check_pack(members: list[Config], run_names: list[str] | None = None) -> None:
    """Raise PackError unless `members` can train as one pack (see the module docstring); `run_names`, when
    given, must be distinct."""
    if not members:
        raise PackError("a pack needs at least one run")
    first = members[0]
    pairs = [(m.optim.lr, m.train.seed) for m in members]
    if len(set(pairs)) != len(pairs):
        if not several_seeds(members):
            raise PackError(f"the learning rates of a pack must be distinct, got {[lr for lr, _ in pairs]}")
        raise PackError(f"the (lr, seed) pairs of a pack must be distinct, got {pairs}")
    for m in members:
        if m.train.pack_lrs or m.train.pack_seeds:
            raise PackError("a pack member must not set train.pack_lrs or train.pack_seeds itself (use "
                            "zoo.steps.pack_members)")
        same = dataclasses.replace(m, optim=dataclasses.replace(m.optim, lr=first.optim.lr),
                                   train=dataclasses.replace(m.train, seed=first.train.seed))
        if same != first:
            raise PackError(
                f"packed runs may differ only in optim.lr and train.seed, but {_first_difference(first, m)}"
            )
    if several_seeds(members) and len(first.data.train) != 1:
        raise PackError(
            f"runs of several seeds pack only with one training segment (data.train has {len(first.data.train)}): "
            "each seed interleaves a mixture's segments in its own order"
        )
    if run_names is not None and len(set(run_names)) != len(members):
        raise PackError(f"the runs of a pack need distinct run dirs, but run={first.run!r} names them all")
    if first.logger.backend != "none":
        raise PackError(f"logger.backend={first.logger.backend} is not supported for packed runs; use logger=none")
    if len(members) == 1:
        return
    for name in dict.fromkeys(first.model.layers()):
        options = dict(first.model.mixers.get(name, {}))
        impl = getattr(make_config(name, MIXERS[name].Config, first.model.d_model, options), "impl", "naive")
        packable = getattr(MIXERS[name], "vmap_impls", PYTORCH_IMPLS)
        if impl not in packable:
            raise PackError(
                f"mixer {name} has impl={impl}, which has no torch.func.vmap rule; packed runs need impl in "
                f"{{{', '.join(packable)}}}"
            )


class _QueryLoss(nn.Module):
    """query_loss as a module's forward, so `functional_call` can swap the LanguageModel's parameters."""

    def __init__(self, lm: LanguageModel) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs: torch.Tensor, query_pos: torch.Tensor, query_labels: torch.Tensor) -> torch.Tensor:
        return query_loss(self.lm, inputs, query_pos, query_labels)


def _adamw_update(flat: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  lrs: torch.Tensor, decay: torch.Tensor, lr_factor: float | torch.Tensor, t: int | torch.Tensor,
                  beta1: float, beta2: float, eps: float, clip: torch.Tensor | None) -> None:
    """AdamW on [N, P] rows in place (flat, exp_avg, exp_avg_sq), member n at lr lrs[n]·lr_factor, weight decay
    `decay` [P] per parameter, gradients `g` scaled by `clip` [N, 1] first (None: unclipped). Out of place, then
    one copy into each state tensor: what inductor fuses into a single pass over [N, P]."""
    with torch.no_grad():
        if clip is not None:
            g = g * clip
        lr = (lrs * lr_factor)[:, None]  # [N, 1]
        m = exp_avg + (g - exp_avg) * (1 - beta1)  # exp_avg.lerp(g, 1 - beta1)
        v = exp_avg_sq * beta2 + g * g * (1 - beta2)
        denom = v.sqrt() / (1 - beta2**t) ** 0.5 + eps
        flat.copy_(flat * (1 - lr * decay) - lr / (1 - beta1**t) * m / denom)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


class PackedParams:
    """N members' parameters and AdamW moments as [N, P] tensors, and their vmapped loss and update."""

    def __init__(self, model: LanguageModel, lrs: list[float], optim: OptimConfig, total_steps: int,
                 compile_mode: str | None = None, init: list[LanguageModel] | None = None) -> None:
        """compile_mode: torch.compile the members' loss (vmapped, or the one member's) in this mode; None: eager.
        init: each member's initial model (members of several seeds); None: every member starts from `model`."""
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
        def flat_params(m: LanguageModel) -> torch.Tensor:  # [P]
            return torch.cat([p.detach().reshape(-1) for _, p in m.named_parameters()])

        one = flat_params(model)
        rows = one.expand(n, -1) if init is None else torch.stack([flat_params(m) for m in init]).to(one)
        self.flat = rows.clone().requires_grad_(True)  # [N, P]
        self.exp_avg = torch.zeros_like(self.flat, requires_grad=False)
        self.exp_avg_sq = torch.zeros_like(self.flat, requires_grad=False)
        # as build_optimizer: weight decay on the parameters `decayed` picks
        self.decay = torch.cat(
            [torch.full((p.numel(),), optim.weight_decay if decayed(p, optim) else 0.0, device=one.device)
             for _, p in named]
        )  # [P]
        self.lrs = torch.tensor(lrs, dtype=one.dtype, device=one.device)  # [N]
        self.optim = optim
        self.buffers = {f"lm.{k}": v for k, v in model.named_buffers()}
        self.vmapped = n > 1
        # (the vmapped loss on one shared batch, the vmapped loss on a batch per member, one member's loss), eager
        # and as the step runs them
        self._eager = (vmap(self._member_loss, in_dims=(0, None, None, None), randomness="different"),
                       vmap(self._member_loss, in_dims=(0, 0, 0, 0), randomness="different"), self._member_loss)
        self._compiled = self._eager
        self._update = _adamw_update
        if compile_mode is not None:
            # static shapes: an epoch has at most two batch sizes per segment, each compiled once
            self._compiled = tuple(torch.compile(f, mode=compile_mode, dynamic=False) for f in self._eager)
            # the update's dozen elementwise passes over [N, P] (most of P the embedding) as one or two kernels;
            # dynamic shapes, so a sweep worker training pack after pack, and a pack that shrinks as members stop,
            # reuse one graph (dynamo's per-function cache would otherwise fill with every (N, P))
            self._update = torch.compile(_adamw_update, mode=compile_mode, dynamic=True)

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

    def losses(self, inputs: torch.Tensor, query_pos: torch.Tensor, query_labels: torch.Tensor,
               compiled: bool = True) -> torch.Tensor:
        """The loss of every member: [N], on one batch ([B, L] inputs) or on a batch per member ([N, B, L]);
        `compiled=False` runs eagerly even in a compiled pack.

        A pack of several members runs scaled_dot_product_attention's math backend: under vmap the fused kernels
        trained to NaN on the H200 where the unpacked model trains (experiments/LOG.md). A pack of one is not
        vmapped and keeps every kernel, the Triton and FLA impls included."""
        shared, each, single = self._compiled if compiled else self._eager
        per_member = inputs.dim() == 3
        if self.vmapped:
            with sdpa_kernel(SDPBackend.MATH):
                return (each if per_member else shared)(self.views(self.flat), inputs, query_pos, query_labels)
        params = {name: v[0] for name, v in self.views(self.flat).items()}
        if per_member:
            inputs, query_pos, query_labels = inputs[0], query_pos[0], query_labels[0]
        return single(params, inputs, query_pos, query_labels)[None]

    def check_agreement(self, model: LanguageModel, batch: tuple[torch.Tensor, ...], amp, rtol: float,
                        per_member: bool = False) -> None:
        """PackError unless every row's loss and gradient on `batch` equal those of the plain `model` holding that
        row's parameters, within `rtol` (relative to the gradient's norm): a vmap rule that computes something else
        on this device, for any member, must not train the pack silently. A vmapped forward or backward that raises
        is a PackError too (on the H200, sliding-window attention's masked math SDPA under vmap and bf16 autocast
        raised "expected input and grad types to match" in its backward), so that zoo-sweep trains those runs
        unpacked. It runs the vmapped loss eagerly: in a compiled pack (train.compile=true) a check in eval mode
        would compile a second graph, and what it checks, the vmap rules, is the same. `per_member`: check the
        loss that takes a batch per member (a pack of several seeds), each member given `batch`."""
        was_training = self.model.training
        self.model.eval()
        model.eval()
        try:
            stacked = tuple(x.expand(len(self), *x.shape) for x in batch) if per_member else batch
            with amp:
                losses = self.losses(*stacked, compiled=False)
            # members do not interact, so the gradient of the sum holds each member's own gradient in its row
            (grad,) = torch.autograd.grad(losses.sum(), self.flat)
            losses = losses.detach()
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
            loss = loss.detach()
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
        self.model.train(was_training)
        model.train(was_training)

    @torch.no_grad()
    def adamw_step(self, lr_factor: float | torch.Tensor, t: int | torch.Tensor) -> None:
        """torch.optim.AdamW's update at step t (1-based) with lr = lrs·lr_factor, after clipping per member;
        compiled in a compiled pack.

        `lr_factor` and `t` may be 0-dim device tensors: then the update reads no host value, so a CUDA graph
        can capture it and replay it at every step (`PackedStep`)."""
        o = self.optim
        g = self.flat.grad  # [N, P]
        clip = None
        if o.grad_clip > 0:
            # torch.nn.utils.clip_grad_norm_, one norm per member (a reduction, kept outside the compiled update)
            norm = torch.linalg.vector_norm(g, dim=1, keepdim=True)  # [N, 1]
            clip = (o.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        self._update(self.flat, g, self.exp_avg, self.exp_avg_sq, self.lrs, self.decay, lr_factor, t, o.beta1,
                     o.beta2, o.eps, clip)

    def keep(self, rows: list[int]) -> None:
        """Drop every member not in `rows` (members that stopped early leave the pack)."""
        index = torch.tensor(rows, device=self.flat.device)
        self.flat = self.flat.detach()[index].requires_grad_(True)
        self.exp_avg, self.exp_avg_sq, self.lrs = self.exp_avg[index], self.exp_avg_sq[index], self.lrs[index]
        self.vmapped = self.vmapped or len(rows) > 1

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
        f = lr_lambda(cfg.optim, self.total_steps, cfg.train.epochs)
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


class PlainStep:
    """One run: its LanguageModel, torch's AdamW and the warmup + cosine schedule; `train.compile` compiles the
    loss (forward and backward)."""

    seeded = False  # one run: one batch a step

    def __init__(self, model: LanguageModel, cfg: Config, total_steps: int, amp) -> None:
        self.model, self.cfg, self.amp = model, cfg, amp
        self.optimizer = build_optimizer(model, cfg, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.optim, total_steps, cfg.train.epochs)
        )
        t = cfg.train
        # static shapes: an epoch has at most two batch sizes per segment (full and last), each compiled once
        self.loss_fn = torch.compile(query_loss, mode=t.compile_mode, dynamic=False) if t.compile else query_loss
        self.rows = 1

    def __len__(self) -> int:
        return self.rows

    def step(self, seg, idx: torch.Tensor, step: int) -> torch.Tensor:
        with self.amp:
            loss = self.loss_fn(self.model, seg.inputs[idx], seg.query_pos[idx], seg.query_labels[idx])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach()[None]

    def model_of(self, row: int) -> LanguageModel:
        return self.model

    def optimizer_state(self, row: int, step: int) -> tuple[dict, dict]:
        return self.optimizer.state_dict(), self.scheduler.state_dict()

    def load(self, row: int, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])

    def keep(self, rows: list[int]) -> None:
        self.rows = len(rows)


class PackedStep:
    """N runs differing only in optim.lr and train.seed as one `PackedParams`; with `graph=True` each step is a
    replayed CUDA graph per (segment, batch shape), otherwise the same static-buffer step runs eagerly (the CPU
    tests' path). `init`: each member's initial model where the members' seeds differ."""

    def __init__(self, model: LanguageModel, members: list[Config], total_steps: int, device: torch.device,
                 graph: bool, init: list[LanguageModel] | None = None) -> None:
        cfg = members[0]
        self.members, self.device, self.graph = members, device, graph
        self.scratch = copy.deepcopy(model)  # a plain model for one member at a time: checks, eval, checkpoints
        self.precision = cfg.train.precision
        self.amp = autocast(device, self.precision)
        compile_mode = cfg.train.compile_mode if cfg.train.compile else None
        self.pack = PackedParams(model, [m.optim.lr for m in members], cfg.optim, total_steps, compile_mode, init)
        self.seeded = several_seeds(members)  # a batch per member
        self.f = lr_lambda(cfg.optim, total_steps, cfg.train.epochs)
        self.lr_factor = torch.zeros((), device=device)
        self.t = torch.zeros((), device=device)
        self.graphs: dict[tuple[int, int], StaticGraph] = {}
        self.live = list(range(len(members)))  # row -> index into members

    def __len__(self) -> int:
        return len(self.pack)

    def check(self, batch: tuple[torch.Tensor, ...]) -> None:
        """PackError unless the vmapped pack agrees with the plain model on `batch` (a pack of one always does)."""
        if self.pack.vmapped:
            # bf16 autocast rounds the two computations differently; fp32 agrees to rounding
            rtol = 5e-2 if self.device.type == "cuda" else 1e-3
            self.pack.check_agreement(self.scratch, batch, self.amp, rtol=rtol, per_member=self.seeded)

    def _body(self, inputs: torch.Tensor, query_pos: torch.Tensor, query_labels: torch.Tensor) -> torch.Tensor:
        pack = self.pack
        # Autocast's weight cache would hold casts across replays; the pack's views are no leaves anyway.
        with autocast(self.device, self.precision, cache=False):
            losses = pack.losses(inputs, query_pos, query_labels)
        pack.flat.grad = None
        losses.sum().backward()
        pack.adamw_step(self.lr_factor, self.t)
        return losses.detach()

    def _snapshot(self) -> list[torch.Tensor]:
        return [x.detach().clone() for x in (self.pack.flat, self.pack.exp_avg, self.pack.exp_avg_sq)]

    @torch.no_grad()
    def _restore(self, saved: list[torch.Tensor]) -> None:
        for x, old in zip((self.pack.flat, self.pack.exp_avg, self.pack.exp_avg_sq), saved):
            x.copy_(old)

    def _before_capture(self) -> None:
        self.pack.flat.grad = None  # so the captured gradient lives in the graph's pool

    def step(self, seg, idx: torch.Tensor, step: int) -> torch.Tensor:
        """One step of every member: on the examples `idx` [B] of `seg`, or with a batch per member, `idx` [N, B]
        (row n: member n's examples; -1 pads a member's shorter batch: those rows' labels are ignored, so they add
        nothing to its loss or gradient)."""
        self.lr_factor.fill_(self.f(step))
        self.t.fill_(step + 1)
        labels = seg.query_labels[idx]
        if idx.dim() == 2:
            labels = labels.masked_fill((idx < 0)[..., None], -100)
        batch = (seg.inputs[idx], seg.query_pos[idx], labels)
        key = (id(seg), tuple(idx.shape))
        if key not in self.graphs:
            self.graphs[key] = StaticGraph(
                self._body, batch, eager=not self.graph, snapshot=self._snapshot, restore=self._restore,
                before_capture=self._before_capture, name=f"the training step of a pack of {len(self)}",
            )
        return self.graphs[key](*batch)

    def model_of(self, row: int) -> LanguageModel:
        return self.pack.to_model(row, self.scratch)

    def optimizer_state(self, row: int, step: int) -> tuple[dict, dict]:
        return self.pack.optimizer_state(row, self.scratch, self.members[self.live[row]], step)

    def load(self, row: int, ckpt: dict) -> None:
        self.pack.load(row, ckpt, self.scratch, self.members[self.live[row]])

    def keep(self, rows: list[int]) -> None:
        self.live = [self.live[r] for r in rows]
        if rows:
            self.pack.keep(rows)
            self.graphs.clear()  # keep() replaced the tensors they captured


def make_strategy(model: LanguageModel, members: list[Config], total_steps: int, device: torch.device,
                  init: list[LanguageModel] | None = None) -> PlainStep | PackedStep:
    """The step strategy for `members` (see the module docstring): several members are a pack; one member is a
    plain run, or a graphed pack of one with train.cuda_graph=true on CUDA. `init`: each member's initial model
    where their seeds differ (`model` is the first's)."""
    cfg = members[0]
    graph = cfg.train.cuda_graph and device.type == "cuda"
    if cfg.train.cuda_graph and device.type != "cuda":
        log.warning("train.cuda_graph=true needs CUDA: on %s the step runs without a graph", device)
    if len(members) == 1 and not graph:
        return PlainStep(model, cfg, total_steps, autocast(device, cfg.train.precision))
    return PackedStep(model, members, total_steps, device, graph, init)
