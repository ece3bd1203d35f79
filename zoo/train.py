"""`zoo-train`: train a LanguageModel on synthetic recall data; one run directory per run.

    zoo-train model=based data=mqar_tiny optim.lr=3e-3
    zoo-train model=attention train.resume=true          # continue a killed run from its last checkpoint
    zoo-train model=based train.pack_lrs=[1e-4,1e-3,1e-2]  # three runs (one per lr) packed in one process

The config tree is composed by Hydra from zoo/configs/ (presets) over the schemas in zoo/config.py; a typo or an
impossible value fails here, before any work, with a one-line reason.
"""

import contextlib
import hashlib
import itertools
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from zoo.config import SPLITS, Config, ConfigError, compose_config, register_configs
from zoo.device import autocast, resolve_device, set_threads
from zoo.eval import QuerySegment, evaluate
from zoo.models import LanguageModel
from zoo.paths import config_dir
from zoo.runs import RunDir, find_resumable, identity_digest
from zoo.steps import PackedStep, PackError, check_pack, lr_lambda, make_strategy, several_seeds
from zoo.synthetics import cached_generate, generate

log = logging.getLogger("zoo.train")


class Interrupted(Exception):
    """The run stopped at train.stop_at or on SIGTERM after checkpointing every live member where it stood (mid-epoch
    included); train.resume=true continues it from there as if it had not stopped. `epochs_done`: the epochs it had
    finished (None when it stopped before starting)."""

    def __init__(self, message: str, epochs_done: int | None = None) -> None:
        super().__init__(message)
        self.epochs_done = epochs_done


# Graphs one compiled run may keep per compiled function: one per (batch shape, segment, pack width). Dynamo's
# default of 8 is below what a multi-segment mixture needs (the Based frontier trains 5 segments, each with a
# short last batch), and past it the function silently runs eagerly.
RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def compile_scope(compiling: bool):
    """While a run that compiles trains: an empty torch.compile cache to start from, and room for RECOMPILE_LIMIT
    graphs per function. A process that trains run after run (a zoo-sweep worker, a joblib launcher's worker)
    would otherwise fill dynamo's per-function cache with the graphs of earlier runs, whose models are gone: in
    one such process the fourth compiled pack already ran eagerly (experiments/LOG.md, 2026-12-06). Compiled
    kernels stay in inductor's on-disk cache, so a run of a shape seen before still compiles fast."""
    if not compiling:
        yield
        return
    torch.compiler.reset()
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7: the old name
    with config.patch(**{name: RECOMPILE_LIMIT}):
        yield


@contextlib.contextmanager
def stop_requests(stop_at: float):
    """A callable that says whether the run must stop now: train.stop_at passed (0: never) or a SIGTERM arrived.
    SIGTERM is caught only while the block runs, and only in the main thread (where Python delivers signals);
    the previous handler comes back after it."""
    received = threading.Event()
    handler_set = threading.current_thread() is threading.main_thread()
    if handler_set:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.set())
    try:
        yield lambda: received.is_set() or (stop_at > 0 and time.time() >= stop_at)
    finally:
        if handler_set:
            signal.signal(signal.SIGTERM, previous)


# Fields that change how a run is executed, not what it computes: left out of the run's identity.
EXECUTION_KEYS = {
    "train": ("resume", "overwrite", "progress", "device", "compile", "cuda_graph", "pack_lrs", "threads", "stop_at",
              "checkpoint_share", "pack_stop", "pack_seeds"),
    "logger": None,
}


def load_config(overrides: list[str] = (), config_name: str = "train") -> tuple[Config, str]:
    """Compose zoo/configs/<config_name>.yaml with `overrides`; return the typed config and its resolved YAML."""
    register_configs()
    return compose_config(config_dir(), config_name, overrides)


def run_name(cfg: Config) -> str:
    """`cfg.run`, or a readable name plus a hash of everything that changes the result."""
    if cfg.run:
        return cfg.run
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    digest = identity_digest(tree, EXECUTION_KEYS["train"])
    mixers = "-".join(dict.fromkeys(cfg.model.layers()))
    return f"{mixers}-d{cfg.model.d_model}-lr{cfg.optim.lr:g}-s{cfg.train.seed}-{digest}"


def load_split(cfg: Config, split: str, device: torch.device) -> list[QuerySegment]:
    segments = []
    for i, seg in enumerate(getattr(cfg.data, split)):
        task_cfg = seg.task_config(cfg.data.vocab_size)
        seed = cfg.data.segment_seed(split, i)
        data = cached_generate(task_cfg, seed, cfg.data.cache_dir) if cfg.data.cache else generate(task_cfg, seed)
        segments.append(QuerySegment.from_segment(data, seg.batch_size, device))
    return segments


def epoch_plan(
    segments: list[QuerySegment], seed: int, epoch: int, order: str = "shuffle"
) -> list[tuple[int, torch.Tensor]]:
    """The batches of one epoch as (segment index, example indices): in a seeded random order (`order`
    "shuffle"), or ("fixed", Zoology's) segment after segment, each one's batches in example order, every epoch.

    A function of (seed, epoch) alone, so a resumed run replays exactly the batches it would have seen.
    """
    if order == "fixed":
        return [(s, torch.arange(i, min(i + seg.batch_size, len(seg))))
                for s, seg in enumerate(segments) for i in range(0, len(seg), seg.batch_size)]
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    batches = []
    for s, seg in enumerate(segments):
        perm = torch.randperm(len(seg), generator=g)
        batches += [(s, perm[i : i + seg.batch_size]) for i in range(0, len(seg), seg.batch_size)]
    shuffled = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in shuffled]


def member_batches(indices: list[torch.Tensor]) -> torch.Tensor:
    """One step of a pack of several seeds: each member's example indices, stacked [N, B]. A seed's epoch puts its
    last, shorter batch at its own step, so at that step a member's row is padded with -1: rows the step gives no
    loss (PackedStep.step), which is how that member trains alone on the shorter batch."""
    width = max(idx.numel() for idx in indices)
    return torch.stack([idx if idx.numel() == width else torch.cat([idx, idx.new_full((width - idx.numel(),), -1)])
                        for idx in indices])


def epoch_batches(segments: list[QuerySegment], seed: int, epoch: int, device: torch.device, order: str = "shuffle"):
    """(segment, example indices on `device`) per batch of `epoch_plan`, after one host-to-device copy of the
    whole epoch's indices: no transfer inside the step loop."""
    plan = epoch_plan(segments, seed, epoch, order)
    flat = torch.cat([idx for _, idx in plan]).to(device, non_blocking=True)
    start = 0
    for s, idx in plan:
        yield segments[s], flat[start : start + idx.numel()]
        start += idx.numel()


@dataclass
class Tracker:
    """Writes metrics to the run dir and mirrors them to wandb when enabled."""

    run: RunDir
    wandb_run: Any = None

    def log(self, record: dict[str, Any]) -> None:
        self.run.append_metrics(record)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def finish(self, summary: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            for k, v in summary.items():
                if isinstance(v, (int, float, str)):
                    self.wandb_run.summary[k] = v
            self.wandb_run.finish()


def start_tracker(cfg: Config, run: RunDir, name: str) -> Tracker:
    if cfg.logger.backend != "wandb":
        return Tracker(run)
    import wandb

    wandb_run = wandb.init(
        project=cfg.logger.project,
        name=f"{cfg.experiment_name}/{name}",
        id=hashlib.sha1(str(run.path).encode()).hexdigest()[:16],
        dir=str(run.path),
        mode=cfg.logger.mode,
        resume="allow",
        config=OmegaConf.to_container(OmegaConf.structured(cfg)),
    )
    return Tracker(run, wandb_run)


def checkpoint_state(model, optimizer_state, scheduler_state, epoch, step, best, wall_time_s, tokens) -> dict:
    """The contents of ckpt/last.pt: everything a resume needs, whatever strategy trained the run."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer_state,
        "scheduler": scheduler_state,
        "epoch": epoch,
        "step": step,
        "best_valid_accuracy": best,
        "wall_time_s": wall_time_s,
        "train_tokens": tokens,
        "rng_cpu": torch.get_rng_state(),
    }


def run_summary(
    cfg: Config,
    name: str,
    model: LanguageModel,
    final_valid: dict,
    test: dict,
    best: float,
    epoch: int,
    step: int,
    stopped_early: bool,
    train_time: float,
    tokens: int,
    device: torch.device,
) -> dict[str, Any]:
    """summary.json of a finished run."""
    max_len = max(seg.seq_len for seg in cfg.data.train)
    lengths = sorted({seg.seq_len for split in SPLITS for seg in getattr(cfg.data, split)})
    return {
        "experiment": cfg.experiment_name,
        "run": name,
        "layers": cfg.model.layers(),
        "d_model": cfg.model.d_model,
        "lr": cfg.optim.lr,
        "seed": cfg.train.seed,
        "parameters": model.num_parameters(),
        "state_size": {str(L): model.state_size(L) for L in lengths},
        "state_bytes_fp32": 4 * model.state_size(max_len),
        "state_bytes_seq_len": max_len,
        **final_valid,
        **test,
        "best_valid_accuracy": best,
        "epochs": epoch,
        "steps": step,
        "stopped_early": stopped_early,
        "wall_time_s": train_time,
        "train_tokens_per_s": tokens / train_time if train_time > 0 else 0.0,
        "device": str(device),
    }


class CheckpointClock:
    """When the checkpoints after evaluations are due: at most `share` of the wall goes to writing them.

    The first evaluation checkpoints; each later one does once the time since the last checkpoint ended is at least
    that checkpoint's cost / share. So a run whose checkpoints are cheap against an epoch checkpoints after every
    evaluation, and a wide pack whose checkpoints cost a large part of an epoch spaces them out: a kill -9 loses
    at most about cost / share seconds of training. A run that finishes (early stop or its last epoch) writes its
    final checkpoint whatever the clock says, and a stopped run (stop_at, SIGTERM) where it stops."""

    def __init__(self, share: float, clock=time.perf_counter) -> None:
        self.share, self.clock = share, clock
        self.cost = 0.0  # seconds the last due checkpoint took (all members)
        self.last = None  # when it ended

    def due(self) -> bool:
        if self.last is None or self.share >= 1:
            due = True
        else:
            due = self.clock() - self.last >= self.cost / self.share
        if due:
            self.cost = 0.0
        return due

    @contextlib.contextmanager
    def timed(self):
        """Wrap each member's checkpoint of a due evaluation: their times add up to its cost."""
        start = self.clock()
        try:
            yield
        finally:
            self.last = self.clock()
            self.cost += self.last - start


def train(cfg: Config, resolved_yaml: str | None = None) -> dict[str, Any]:
    """Train one run; return its summary (also written to summary.json)."""
    if cfg.train.pack_lrs or cfg.train.pack_seeds:
        raise ConfigError(
            "train.pack_lrs or train.pack_seeds is set: train its runs with train_runs(pack_members(cfg))"
        )
    return train_runs([cfg], [resolved_yaml])[0]


def train_runs(members: list[Config], resolved: list[str | None] | None = None) -> list[dict[str, Any]]:
    """The training loop: train `members` together; return their summaries, in order.

    One member is a plain run (or, with train.cuda_graph=true on CUDA, a graphed pack of one); several members
    must differ only in optim.lr and train as one pack (zoo/steps.py). Every member is its own run: its run dir
    (`run_name`), config.yaml, metrics.jsonl, checkpoints and summary.json are those of the member alone, so a
    run resumes under any strategy. Each member stops early on its own: once it reaches train.early_stop it is
    finalised and leaves; the others go on.

    `resolved`: each member's resolved YAML for its config.yaml (default: the dataclass tree as YAML).
    Interrupted: train.stop_at passed or a SIGTERM arrived; every live member was checkpointed where it stood.
    """
    with stop_requests(members[0].train.stop_at) as must_stop, compile_scope(members[0].train.compile):
        return _train_runs(members, resolved, must_stop)


def _setup(members: list[Config]):
    """What training `members` needs: (device, autocast, {split: segments}, model, step strategy)."""
    cfg = members[0]
    device = resolve_device(cfg.train.device)
    amp = autocast(device, cfg.train.precision)
    if cfg.train.threads:  # 0: as the process has it (zoo-train sets the cores available; sweep workers split them)
        set_threads(cfg.train.threads)
    # Seed, then data, then the model: a member starts from the same initial weights however it is trained.
    torch.manual_seed(cfg.train.seed)
    data = {split: load_split(cfg, split, device) for split in SPLITS}
    model = LanguageModel(cfg.model).to(device)
    init = None
    if several_seeds(members):  # each member from its own seed's init (data draws no torch RNG)
        init = [model]  # the first member's, drawn above
        for m in members[1:]:
            torch.manual_seed(m.train.seed)
            init.append(LanguageModel(cfg.model).to(device))
    total_steps = sum(seg.num_batches() for seg in data["train"]) * cfg.train.epochs
    strategy = make_strategy(model, members, total_steps, device, init)
    if isinstance(strategy, PackedStep):
        first = data["train"][0]
        strategy.check((first.inputs[:8], first.query_pos[:8], first.query_labels[:8]))
    return device, amp, data, model, strategy


def compile_warmup(members: list[Config]) -> int:
    """Compile `members`' training step (one run, or a pack that differs only in optim.lr) into the on-disk
    compile caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), with nothing written to any run dir: one step of
    every batch shape an epoch holds (each training segment's full batch and its last, partial one), on a
    throwaway model. A run of the same shape started afterwards, in any process, loads the compiled graphs and
    kernels instead of compiling them; a run's lr and seed are not part of its graphs. The data it generates
    lands in data.cache_dir too. Returns the number of batch shapes stepped (0 without train.compile)."""
    if not members[0].train.compile:
        return 0
    with compile_scope(True):
        device, _, data, _, strategy = _setup(members)
        shapes = 0
        for seg in data["train"]:
            sizes = dict.fromkeys([min(seg.batch_size, len(seg)), len(seg) % seg.batch_size or seg.batch_size])
            for size in sizes:
                idx = torch.arange(size, device=device)
                if strategy.seeded:  # a pack of several seeds steps on [N, B] batches
                    idx = idx.expand(len(strategy), -1)
                strategy.step(seg, idx, 0)
                shapes += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return shapes


def _open_runs(members: list[Config], resolved: list[str | None]) -> tuple[list[str], list[RunDir], list[int]]:
    """The members' names and run dirs, and which of them (`todo`, indices into members) still train. A pack's
    members must be able to pack (`check_pack`). With train.resume=true a member without its dir continues the
    latest run of its config whatever its name, and a finished one is left out of `todo`; without it (or
    train.overwrite=true) an existing run dir is a ConfigError."""
    cfg = members[0]
    names = [run_name(m) for m in members]
    if len(members) > 1:
        check_pack(members, names)
    runs = [RunDir(Path(cfg.runs_root) / cfg.experiment_name / name) for name in names]
    if cfg.train.resume:
        for i, member in enumerate(members):
            if not runs[i].exists():
                text = resolved[i] or OmegaConf.to_yaml(OmegaConf.structured(member))
                try:
                    runs[i] = find_resumable(runs[i].path.parent, text, EXECUTION_KEYS["train"])
                except ValueError as e:
                    raise ConfigError(str(e)) from None
                names[i] = runs[i].path.name
    for run in runs:
        if run.exists() and not (cfg.train.resume or cfg.train.overwrite):
            raise ConfigError(
                f"{run.path} already holds a run: pass train.resume=true to continue it or train.overwrite=true"
            )
    todo = []
    for i, run in enumerate(runs):
        if cfg.train.resume and run.is_finished():
            log.info("run %s already finished; nothing to resume", run.path)
            continue
        todo.append(i)
    return names, runs, todo


def _load_checkpoints(runs: list[RunDir], names: list[str], todo: list[int], resume: bool) -> list[dict | None]:
    """The checkpoint of each member of `todo` (None: none, or not resuming). A pack resumes as one: its members
    must all have stopped at the same epoch and step, or none have a checkpoint (a PackError otherwise)."""
    ckpts = [runs[i].load_checkpoint() if resume else None for i in todo]
    at = {(c["epoch"], c["step"]) for c in ckpts if c is not None}
    if len(at) > 1 or (at and any(c is None for c in ckpts)):
        where = ", ".join(names[i] + ("@" + str(c["epoch"]) if c else "@none") for i, c in zip(todo, ckpts))
        raise PackError(f"the runs of this pack stopped at different checkpoints ({where}); resume them unpacked")
    return ckpts


class _Training:
    """The runs that one strategy trains together (one run, or a pack) while they train.

    Per member (`j`, an index into the members given) it keeps the run dir, the tracker, the best validation
    accuracy and, once written, the summary; for all of them the loop's position (epoch, step, tokens, wall time),
    which summaries and checkpoints record. `live[row]` is the member that strategy row `row` trains; `drop`
    removes finished rows from the strategy and from `live` together.
    """

    def __init__(self, members: list[Config], names: list[str], runs: list[RunDir], trackers: list, strategy,
                 data: dict, amp, device, steps_per_epoch: int) -> None:
        self.cfg = members[0]
        self.members, self.names, self.runs, self.trackers = members, names, runs, trackers
        self.strategy, self.data, self.amp, self.device = strategy, data, amp, device
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = steps_per_epoch * self.cfg.train.epochs
        self.lr_factor = lr_lambda(self.cfg.optim, self.total_steps, self.cfg.train.epochs)
        n = len(members)
        self.best = [0.0] * n
        self.summaries: list[dict[str, Any] | None] = [None] * n
        self.live = list(range(n))
        self.epoch = self.step = self.tokens = 0
        self.wall_before = 0.0  # training time before this process (a resumed run's checkpoint holds it)
        self.t0 = time.perf_counter()
        self.saves = CheckpointClock(self.cfg.train.checkpoint_share)

    def resume_from(self, ckpts: list[dict]) -> None:
        """Continue where the members' (shared) checkpoint stopped."""
        for row, ckpt in enumerate(ckpts):
            self.strategy.load(row, ckpt)
            self.best[row] = ckpt["best_valid_accuracy"]
        c = ckpts[0]
        self.epoch, self.step, self.tokens = c["epoch"], c["step"], c["train_tokens"]
        self.wall_before = c["wall_time_s"]
        torch.set_rng_state(c["rng_cpu"])

    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.t0

    def is_stopped(self, accuracy: float) -> bool:
        return self.cfg.train.early_stop is not None and accuracy >= self.cfg.train.early_stop

    def finish(self, row: int, stopped_early: bool, by_pack: bool = False) -> None:
        """Evaluate strategy row `row`'s member on valid and test and write its summary (by_pack: stopped
        because a sibling reached early_stop, train.pack_stop=first)."""
        j = self.live[row]
        member = self.strategy.model_of(row)
        train_time = self.wall()
        final_valid = evaluate(member, self.data["valid"], "valid", self.amp)
        test = evaluate(member, self.data["test"], "test", self.amp)
        self.trackers[j].log({"step": self.step, "epoch": self.epoch, **test})
        summary = run_summary(
            self.members[j], self.names[j], member, final_valid, test, self.best[j], self.epoch, self.step,
            stopped_early, train_time, self.tokens, self.device,
        )
        if isinstance(self.strategy, PackedStep):
            summary["pack_size"] = len(self.members)
        if by_pack:
            summary["stopped_by_pack"] = True
        self.runs[j].write_summary(summary)
        self.trackers[j].finish(summary)
        self.summaries[j] = summary

    def checkpoint(self, row: int) -> None:
        """Row `row`'s member's checkpoint at the current epoch and step (mid-epoch when the run is stopped)."""
        optimizer_state, scheduler_state = self.strategy.optimizer_state(row, self.step)
        j = self.live[row]
        self.runs[j].save_checkpoint(checkpoint_state(
            self.strategy.model_of(row), optimizer_state, scheduler_state, self.epoch, self.step, self.best[j],
            self.wall(), self.tokens,
        ))

    def drop(self, done: list[int]) -> None:
        rows = [row for row in range(len(self.live)) if row not in done]
        self.live = [self.live[row] for row in rows]
        self.strategy.keep(rows)

    def finish_resumed(self) -> None:
        """A member whose checkpoint already met early_stop is finalised without training (with
        train.pack_stop=first, its whole pack: the run was killed while the pack was being finalised)."""
        done = [row for row in range(len(self.live)) if self.is_stopped(self.best[row])]
        for row in done:
            self.finish(row, True)
        if done and self.cfg.train.pack_stop == "first":
            for row in range(len(self.live)):
                if row not in done:
                    self.finish(row, False, by_pack=True)
            done = list(range(len(self.live)))
        if done:
            self.drop(done)

    def batches(self):
        """This epoch's (segment, indices, examples) batches from the current step on: a run resumed mid-epoch
        skips the batches it trained on (each epoch's order is fixed). A pack of several seeds steps each member
        on its own seed's batch, stacked [N, B] (one segment); `examples` counts one member's."""
        train, order = self.data["train"], self.cfg.train.batch_order
        if self.strategy.seeded:
            orders = [epoch_batches(train, self.members[j].train.seed, self.epoch, self.device, order)
                      for j in self.live]
            batches = ((steps[0][0], member_batches([idx for _, idx in steps]), steps[0][1].numel())
                       for steps in zip(*orders))
        else:
            batches = ((seg, idx, idx.numel()) for seg, idx in
                       epoch_batches(train, self.cfg.train.seed, self.epoch, self.device, order))
        return itertools.islice(batches, self.step - self.epoch * self.steps_per_epoch, None)

    def train_epoch(self, bar, must_stop) -> None:
        """One epoch of steps; at must_stop(), checkpoints every live member mid-epoch and raises Interrupted."""
        loss_sum = torch.zeros(len(self.live), device=self.device)
        loss_n = 0
        for seg, idx, examples in self.batches():
            losses = self.strategy.step(seg, idx, self.step)  # [N]
            self.step += 1
            self.tokens += examples * seg.inputs.shape[1]  # a member's tokens (every member's epoch holds as many)
            loss_sum += losses
            loss_n += 1
            bar.update(1)
            if self.step % self.cfg.train.log_every == 0:
                # The one host sync of the loop, every log_every steps.
                train_loss = (loss_sum / loss_n).tolist()
                loss_sum.zero_()
                loss_n = 0
                for row, j in enumerate(self.live):
                    lr = self.members[j].optim.lr * self.lr_factor(self.step - 1)  # the lr the last step trained at
                    self.trackers[j].log({"step": self.step, "epoch": self.epoch, "train/loss": train_loss[row],
                                          "lr": lr})
                bar.set_postfix(loss=f"{min(train_loss):.3f}", refresh=False)
            if must_stop():
                for row in range(len(self.live)):
                    self.checkpoint(row)
                bar.close()
                log.info("stopped at epoch %d, step %d (checkpointed: train.resume=true continues)", self.epoch,
                         self.step)
                raise Interrupted(f"stopped at epoch {self.epoch}, step {self.step}", epochs_done=self.epoch)
        self.epoch += 1

    def end_epoch(self, bar) -> None:
        """Evaluate every live member on valid, checkpoint when due, and finish those that reached early_stop
        (with train.pack_stop=first, their whole pack). A finished run keeps its final weights as a checkpoint."""
        last = self.epoch == self.cfg.train.epochs
        if not (self.epoch % self.cfg.train.eval_every == 0 or last):
            return
        done = []
        save = self.saves.due()
        for row, j in enumerate(self.live):
            member = self.strategy.model_of(row)
            metrics = evaluate(member, self.data["valid"], "valid", self.amp)
            self.best[j] = max(self.best[j], metrics["valid/accuracy"])
            self.trackers[j].log({"step": self.step, "epoch": self.epoch, **metrics})
            stopped = self.is_stopped(metrics["valid/accuracy"])
            if save:
                with self.saves.timed():
                    self.checkpoint(row)
            elif stopped or last:
                self.checkpoint(row)
            if stopped:
                self.finish(row, True)
                done.append(row)
        if done and self.cfg.train.pack_stop == "first":  # a member settled the point: its siblings stop here too
            for row in range(len(self.live)):
                if row not in done:
                    if not (save or last):  # not checkpointed above
                        self.checkpoint(row)
                    self.finish(row, False, by_pack=True)
                    done.append(row)
        bar.set_postfix(valid_acc=f"{max(self.best):.3f}", refresh=True)
        if done:
            self.drop(done)


def _train_runs(members: list[Config], resolved: list[str | None] | None, must_stop) -> list[dict[str, Any]]:
    """Train `members` (one run, or a pack that one strategy steps together) to their end; returns each member's
    summary (a finished run's is read back). Opens the run dirs, resumes from a shared checkpoint, then runs the
    epochs through `_Training`."""
    cfg = members[0]
    resolved = list(resolved) if resolved is not None else [None] * len(members)
    names, runs, todo = _open_runs(members, resolved)
    summaries: list[dict[str, Any] | None] = [
        None if i in todo else runs[i].read_summary() for i in range(len(members))
    ]
    if not todo:
        return summaries
    if must_stop():
        raise Interrupted("stopped before the run started (train.stop_at passed, or SIGTERM)")
    ckpts = _load_checkpoints(runs, names, todo, cfg.train.resume)
    at = any(c is not None for c in ckpts)
    device, amp, data, model, strategy = _setup([members[i] for i in todo])
    if cfg.train.overwrite:  # only once the data and the model are built: a failure there keeps the earlier run
        for i in todo:
            runs[i].clear()
    for i in todo:
        if cfg.train.resume:
            runs[i].truncate_metrics(ckpts[0]["step"] if at else 0)
        text = resolved[i] or OmegaConf.to_yaml(OmegaConf.structured(members[i]))
        runs[i].write_config(text + f"run_dir: {runs[i].path}\n")
    trackers = [start_tracker(members[i], runs[i], names[i]) for i in todo]
    t = _Training([members[i] for i in todo], [names[i] for i in todo], [runs[i] for i in todo], trackers, strategy,
                  data, amp, device, steps_per_epoch=sum(seg.num_batches() for seg in data["train"]))
    log.info(
        "%s: %d run(s) (lr %s), %d parameters each on %s",
        type(strategy).__name__, len(todo), [members[i].optim.lr for i in todo], model.num_parameters(), device,
    )
    if at:
        t.resume_from(ckpts)
        what = str(runs[todo[0]].path) if len(todo) == 1 else f"a pack of {len(todo)} runs"
        log.info("resuming %s at epoch %d, step %d", what, t.epoch, t.step)
        t.finish_resumed()
    desc = names[todo[0]] if len(todo) == 1 else f"pack of {len(todo)}"
    bar = tqdm(total=t.total_steps, initial=t.step, desc=desc, disable=not cfg.train.progress, dynamic_ncols=True)
    model.train()
    while t.epoch < cfg.train.epochs and t.live:
        t.train_epoch(bar, must_stop)
        t.end_epoch(bar)
        model.train()
    bar.close()
    for row in range(len(t.live)):
        t.finish(row, False)
    for j, i in enumerate(todo):
        summaries[i] = t.summaries[j]
    return summaries


USAGE = """usage: zoo-train [--cfg] [-m] [--version] [KEY=VALUE ...]

Train one model on synthetic recall data. Overrides use Hydra syntax over zoo/configs/train.yaml:
  zoo-train model=based data=mqar_tiny optim.lr=3e-3
  zoo-train model=based optim.lr=3e-3 train.resume=true   continue the latest run of this config
  zoo-train model=based train.pack_lrs=[1e-4,1e-3,1e-2]   one run per lr, trained as one vmapped pack
  zoo-train model=based train.pack_seeds=[0,1,2]          one run per seed, the same way (with pack_lrs: each pair)
  zoo-train --cfg [KEY=VALUE ...]     print the resolved config and exit
  zoo-train -m model=based,attention optim.lr=1e-3,3e-3 hydra/launcher=joblib hydra.launcher.n_jobs=4
                                      a Hydra multirun: every combination, through any Hydra launcher
                                      (joblib here; submitit or ray on a cluster). Finished runs are skipped,
                                      a failing run is recorded and the others go on; with GPUs, job i uses
                                      cuda:(i mod GPU count) unless train.device is given.
Main options (every field and default: zoo/config.py):
  model=PRESET data=PRESET optim.lr=X train.epochs=N train.early_stop=X train.seed=N
  train.device=auto|cpu|cuda|cuda:N   train.threads=N (0: the cores available)   train.progress=false
  train.resume=true | train.overwrite=true   runs_root=DIR   experiment_name=NAME   logger=wandb
  train.stop_at=UNIX_TIME   stop there (or on SIGTERM) with a checkpoint, mid-epoch too; exit status 75
Presets: model/, data/, optim/, logger/, experiment/ under zoo/configs/ ($ZOO_CONFIG_DIR replaces it).
Runs go to runs/<experiment_name>/<run>/."""
