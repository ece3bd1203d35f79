"""`zoo-sweep`: run many `zoo-train` configs, each in its own run dir, resumable and failure-tolerant.

    zoo-sweep experiments/zoology_fig2/sweep.py                  # every GPU, 4 runs per GPU
    zoo-sweep zoo/configs/sweep/tiny.yaml --workers 2 --device cpu
    zoo-sweep experiments/zoology_fig2/sweep.py --dry-run        # list the runs and what is already done
    zoo-sweep experiments/zoology_fig2/sweep.py --dry-run --skip-summaries experiments/zoology_fig2/summaries
    zoo-sweep experiments/zoology_fig2/sweep.py --emit           # one zoo-train command per line
    zoo-sweep experiments/zoology_fig2/sweep.py --pack-lrs       # the 4 lrs of each point as one packed job
    zoo-sweep experiments/zoology_fig2/sweep.py --pack-lrs --pack-max-d 256 --dry-run   # d = 512 unpacked: the jobs

A sweep file is either
- Python: it defines `sweep()` returning a list of runs, each a list of Hydra overrides
  (["model=based", "optim.lr=1e-3"]) or a dict {key: value} turned into overrides; or
- YAML: `base` (overrides shared by every run) and `grid` ({key: [values]}, the Cartesian product), or
  `grids`, a list of such {base, grid} blocks whose runs are concatenated.

What happens per run:
- The config is composed and validated first (`zoo.train.load_config`); a config that fails is listed as
  failed with its one-line reason, and the other runs go on.
- Its run dir is `<runs_root>/<experiment_name>/<run name>` (the name hashes the config, so the same config
  always lands in the same dir). A run dir holding summary.json is skipped; one without (a killed run)
  resumes from its last checkpoint (`train.resume=true`).
- A run that raises writes `error.txt` (the traceback) into its run dir and is listed as failed; the
  others continue. Running out of GPU memory beside other runs is not the run's failure: with several workers
  such a job (a run, or a whole pack) waits "pending" at the back of the queue, and from then on one job fewer
  runs at once (down to one per GPU). Out of memory beside others a second time, it runs after the rest with its
  GPU to itself, one job per GPU. Each time it resumes from its checkpoints, and its record keeps the first error
  as `retried_after`. Only a job that runs out of memory alone fails, a pack then training its members one at a
  time. Every job gives its cached GPU memory back when it ends, so the next job of the worker finds it free. A
  worker process that dies (a crash, the kernel's OOM killer) fails the jobs running in its pool; the jobs not
  started yet go on in a new pool.
  The sweep's record goes to `<runs_root>/_sweeps/<sweep name>.json`, rewritten (atomically)
  after every job, so a sweep that is stopped keeps the record of what finished (unstarted runs: "pending").
  A later call of the same sweep name keeps the earlier calls' walls and counts in the record's `calls` (their
  sum: `calls_wall_s`), and the runs they finished stay "finished" in its `runs` and top-level counts (each
  call's own counts are in `calls`), so a chain of time-limited jobs leaves one record of the whole grid.
  Where nvidia-smi runs, the record also says how busy each GPU was (`gpus`: the mean share of time a kernel
  ran, sampled every 2 s, and the peak memory; `zoo.gpus.GpuMonitor`), and the sweep's last line prints it: below 100%,
  more workers would have found the GPU idle.

Time-limited allocations (`--time-limit S`, or a SIGTERM from a scheduler or `timeout`): at S seconds every running
run checkpoints where it is, mid-epoch included, and is recorded "pending" with `interrupted` (and `epochs_done`,
the epochs it finished, which the last line sums up); no new run starts. The same command later resumes each from
that step, so a chain of limited jobs trains what one long job would (the runs' results are the same; only process
start, data and compile are paid again per job).

Committed results (`--skip-summaries DIR`, repeatable): a run whose point (`zoo.runs.config_point_key`:
experiment, resolved model, lr, seed, training length) matches a summary in DIR (a reproduction's committed
`summaries/`) is recorded "skipped" without a run dir, so a shard on a fresh machine trains only what is missing.

Compile cache (`--compile-cache DIR`, default `<runs_root>/_sweeps/compile_cache`): the sweep points
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR there (each unless the caller set it), for its workers and its own
process, so every run of a grid after the first of its shape finds torch.compile's graphs and the Triton kernels
compiled, and so does the next job of a chain, on another machine too, when the runs root is shared storage.
`--compile-cache none` leaves both at torch's and Triton's defaults (per machine, under /tmp and ~/.triton).
Compiled jobs started at once would each compile the same graphs side by side, before any of them finds the
cache. So with several workers and train.compile=true, every shape that more than one job shares (`shape_key`:
a job's overrides without lr and seed, and its number of runs) is first compiled by one warm-up in a worker
(`warm_job`: one training step of each batch shape on a throwaway model, no run dir), and that shape's jobs start
once it ends; jobs of other shapes start meanwhile. The record lists the warm-ups under `compile_warmups`.

Sharding (`--shard I/N`): only the I-th of every N groups of runs differing only in optim.lr (the packs of
`--pack-lrs`, whichever mode runs) — to split one grid over machines or job-array tasks, or to time a spread-out
subset of a grid. Each shard writes its own record (`<sweep name>.shard-I-of-N.json`).

Packing (`--pack-lrs`): runs whose overrides differ only in `optim.lr=` form one job, trained as one vmapped
pack in one process (zoo/steps.py); each still gets the run dir, files and `run_name` of its unpacked
config, so packed and unpacked sweeps skip each other's finished runs. A group that cannot pack (an FLA impl,
members killed at different checkpoints) runs one run at a time, and its records say why; so does a pack that
fails in training, whose unfinished members then train again one at a time from their checkpoints.
`--pack-seeds` also packs runs that differ in `train.seed=` (each member its own seed's init and batch order);
a group of several seeds over a mixture of training segments cannot share a step and trains as a pack per seed.
`--pack-max-d N` packs only groups whose `model.d_model` is at most N and trains wider runs one per job
(`unpack_wide`): a pack pays off where one run leaves the GPU idle between small kernels, and a wide compiled
run already fills it, so there the pack only adds the batched step's overhead (experiments/LOG.md has the
measurement). Single runs also finish one by one, which a time-limited job on a machine that keeps no
checkpoints needs.

Parallelism: a process pool (stdlib `concurrent.futures`, spawn) of `--workers` processes. Each worker owns
one device for its lifetime: worker i gets GPU i mod (number of GPUs), so with workers = runs_per_gpu·GPUs
several runs share every GPU and all GPUs are used. Every sweep says once (stderr and log) whether CUDA MPS runs
the kernels of workers sharing a GPU concurrently, and why not (`zoo.gpus.MPS.start`); serial sweeps and `zoo-train -m`
too. Runs never share one process's CUDA streams. The same skip/resume/record semantics are available through
Hydra's own sweeper and launchers: `zoo-train -m model=based,attention optim.lr=1e-3,3e-3
hydra/launcher=joblib hydra.launcher.n_jobs=8` (joblib locally; job i on GPU i mod count), or on a cluster
`hydra/launcher=submitit_slurm` (hydra-submitit-launcher) or `hydra/launcher=ray` (hydra-ray-launcher);
each job calls `run_one`. `zoo-sweep FILE --emit` prints one `zoo-train` command per run for any job array.

This module reads sweep files, runs the pool and keeps the record; what a job is and how a worker trains one
(`plan_jobs`, `order_jobs`, `run_one`, `run_pack`, `warm_job`) is zoo/jobs.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from zoo.atomic import atomic_write_text
from zoo.gpus import MPS, GpuMonitor, devices_for, visible_device
from zoo.jobs import (
    ORDERS,
    emit_jobs,
    emitted_run,
    lr_groups,
    order_jobs,
    pack_mode,
    plan_jobs,
    run_job,
    shape_key,
    shared_shapes,
    trains_compiled,
    unpack_wide,
    warm_job,
)

SWEEPS_DIR = "_sweeps"

log = logging.getLogger("zoo.sweep")


def _as_override(key: str, value: Any) -> str:
    """key=value in Hydra override syntax; lists and dicts go through JSON-like flow YAML."""
    if isinstance(value, (list, dict)):
        text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
        return f"{key}={text}"
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    return f"{key}={value}"


def normalize(run: Any) -> list[str]:
    """A run as a list of override strings (from a list of strings or a {key: value} dict)."""
    if isinstance(run, dict):
        return [_as_override(k, v) for k, v in run.items()]
    if isinstance(run, (list, tuple)) and all(isinstance(o, str) for o in run):
        return list(run)
    raise ValueError(f"a sweep run must be a list of override strings or a dict, got {run!r}")


def grid_runs(block: dict[str, Any]) -> list[list[str]]:
    """The Cartesian product of `block["grid"]`, each with `block["base"]` in front."""
    unknown = set(block) - {"base", "grid"}
    if unknown:
        raise ValueError(f"a sweep grid block has unknown keys {sorted(unknown)} (known: base, grid)")
    base = normalize(block.get("base", []))
    grid = block.get("grid", {}) or {}
    keys = list(grid)
    for key in keys:
        if not isinstance(grid[key], list) or not grid[key]:
            raise ValueError(f"sweep grid entry {key!r} must be a non-empty list, got {grid[key]!r}")
    return [base + [_as_override(k, v) for k, v in zip(keys, combo)] for combo in itertools.product(*grid.values())]


class SweepFileError(ValueError):
    """A sweep file that cannot be read, or whose runs cannot be built; zoo-sweep prints it as one line."""


def load_sweep(path: str | Path) -> list[list[str]]:
    """The runs of a sweep file (Python `sweep()` or a YAML grid), as override lists.

    A missing or malformed file, and a ValueError raised by the file's own `sweep()` (how a sweep rejects a bad
    environment variable such as `ZOO_FIG2`), come out as `SweepFileError` naming the file."""
    path = Path(path)
    if path.suffix not in (".py", ".yaml", ".yml"):
        raise SweepFileError(f"sweep file must be .py or .yaml, got {path}")
    if not path.is_file():
        raise SweepFileError(f"no sweep file at {path}")
    try:
        if path.suffix == ".py":
            spec = importlib.util.spec_from_file_location(f"_zoo_sweep_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            if not hasattr(module, "sweep"):
                raise ValueError("it must define sweep() returning a list of runs")
            runs = [normalize(run) for run in module.sweep()]
        else:
            data = yaml.safe_load(path.read_text()) or {}
            if not isinstance(data, dict):
                raise ValueError(f"expected a mapping with `grid` (and `base`) or `grids`, got {type(data).__name__}")
            if "grids" in data:
                if set(data) - {"grids"}:
                    raise ValueError("with `grids`, no other top-level keys are allowed")
                runs = [run for block in data["grids"] for run in grid_runs(block)]
            else:
                runs = grid_runs(data)
    except ValueError as e:
        raise SweepFileError(f"{path}: {' '.join(str(e).split())}") from e
    except yaml.YAMLError as e:
        raise SweepFileError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from e
    if not runs:
        raise SweepFileError(f"{path} defines no runs")
    return runs


def _worker_init(devices, threads: int) -> None:
    """Runs once per worker: take one device for the worker's lifetime; set the CPU threads. A SIGTERM that the
    sweep passes on is ignored between runs (the sweep starts no new job after it) and, inside a run, stops it at
    its next step with a checkpoint (zoo.train.stop_requests)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    device = devices.get()
    os.environ["ZOO_SWEEP_DEVICE"] = device
    if device.startswith("cuda:"):
        # Before torch initialises CUDA in this process: the worker sees its one GPU as cuda:0.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device(int(device.split(":", 1)[1]))
    import torch

    torch.set_num_threads(threads)


COMPILE_CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


@contextlib.contextmanager
def compile_cache(directory: Path | None):
    """While the block runs, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point into `directory` (its inductor/
    and triton/), each unless already set; None changes nothing. Workers spawned inside the block inherit them.
    Yields {variable: value} of what it set."""
    chosen = {} if directory is None else {
        var: str(Path(directory).resolve() / sub) for var, sub in COMPILE_CACHE_VARS.items() if var not in os.environ}
    os.environ.update(chosen)
    try:
        yield chosen
    finally:
        for var in chosen:
            os.environ.pop(var, None)


def run_sweep(
    runs: list[list[str]],
    name: str,
    workers: int = 1,
    device: str = "auto",
    extra: list[str] = (),
    runs_root: str | None = None,
    pack_lrs: bool = False,
    mps: str = "auto",
    order: str = "longest",
    cache: str = "runs",
    skip_summaries: list[str] = (),
    pack_seeds: bool = False,
    pack_max_d: int = 0,
) -> dict[str, Any]:
    """Run every run (see the module docstring); write and return the sweep record.

    pack_lrs: train each group of runs that differ only in optim.lr as one pack (`lr_groups`, `run_pack`).
    pack_seeds: the same for runs that differ only in optim.lr and train.seed (implies packing).
    pack_max_d: pack only runs whose model.d_model is at most this; wider ones train one per job (0: any width).
    mps: auto | on | off, CUDA MPS for workers that share a GPU (`MPS.start`).
    order: longest | shortest | file, the order jobs start in (`order_jobs`).
    cache: the compile cache (`compile_cache`): "runs" for `<runs_root>/_sweeps/compile_cache`, "none" for none,
    else a directory.
    skip_summaries: directories of committed summaries whose runs are skipped (`committed_runs`).
    The record is rewritten after every job (unstarted or unfinished runs are "pending").
    """
    extra = list(extra) + ([f"runs_root={runs_root}"] if runs_root else [])
    root = Path(runs_root) if runs_root else _runs_root_of(runs[0], extra)
    out = root / SWEEPS_DIR / f"{name}.json"
    directory = {"runs": root / SWEEPS_DIR / "compile_cache", "none": None}.get(cache, cache)
    with compile_cache(directory) as cache_vars:
        if cache_vars:
            log.info("zoo-sweep %s: compile cache %s", name, ", ".join(f"{k}={v}" for k, v in cache_vars.items()))
        done = committed_runs(runs, extra, skip_summaries) if skip_summaries else {}
        return _run_jobs(runs, name, workers, device, extra, pack_mode(pack_lrs, pack_seeds), mps, order, out, done,
                         pack_max_d)


def committed_runs(runs: list[list[str]], extra: list[str], directories: list[str]) -> dict[int, dict[str, Any]]:
    """{index: skipped record} of the runs whose point (`zoo.runs.config_point_key`) has a summary in one of
    `directories`, trained alike: a summary that records its data, optimiser and training settings
    (`zoo.runs.training_setup`) must record the run's (`zoo.runs.same_setup`: fields at their defaults aside); one
    collected before summaries held them matches on its point alone. A run whose config does not compose is left
    to the sweep, which records why."""
    import yaml

    from zoo.runs import config_point_key, same_setup, summary_point_key, training_setup
    from zoo.train import EXECUTION_KEYS, ConfigError, load_config

    have: dict[str, tuple[Path, dict | None]] = {}
    for directory in directories:
        if not Path(directory).is_dir():
            raise SystemExit(f"zoo-sweep: --skip-summaries {directory}: no such directory")
        for path in sorted(Path(directory).glob("*.json")):
            try:
                record = json.loads(path.read_text())
                have[summary_point_key(record)] = path, record.get("setup")
            except (KeyError, ValueError, TypeError):
                continue  # not a run's summary
    done = {}
    for i, run in enumerate(runs):
        try:
            _, resolved = load_config(run + extra)
        except ConfigError:
            continue
        tree = yaml.safe_load(resolved)
        path, setup = have.get(config_point_key(tree), (None, None))
        if path is None:
            continue
        if setup is not None and not same_setup(setup, training_setup(tree, EXECUTION_KEYS["train"])):
            print(f"zoo-sweep: {path.name} is this run's point trained otherwise (data, optimiser or training "
                  "settings); the run is not skipped", file=sys.stderr)
            continue
        done[i] = {"overrides": run, "run_dir": None, "status": "skipped", "summary": str(path)}
    return done


def _read_record(path: Path) -> dict[str, Any] | None:
    """The zoo-sweep record at `path`, or None where there is none (missing, torn or not a record)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "wall_s" in record else None


def earlier_calls(path: Path) -> list[dict[str, Any]]:
    """The calls an existing record at `path` lists (each: started, wall_s and its run counts), so a sweep run as a
    chain of time-limited jobs keeps every job's wall in its one record; [] where there is none. A record written
    before records listed their calls counts as one call."""
    record = _read_record(path)
    if record is None:
        return []
    if isinstance(record.get("calls"), list):
        return record["calls"]
    counts = {s: record.get(s, 0) for s in ("finished", "skipped", "failed", "pending")}
    return [{"started": None, "wall_s": record["wall_s"], **counts}]


def _row_key(row: dict[str, Any]) -> str:
    return row.get("run_dir") or " ".join(row["overrides"])


def earlier_finished(path: Path) -> dict[str, dict[str, Any]]:
    """{run key: row} of the runs an earlier call of the record at `path` finished. A later call finds their
    summaries and skips them, or selects other runs; either way the record keeps them "finished" (with that
    call's wall), so the chain's record says what the chain trained, not only what its last call did."""
    record = _read_record(path) or {}
    return {_row_key(r): r for r in record.get("runs", []) if r.get("status") == "finished"}


class SweepRecord:
    """The sweep's record at `out`, rewritten atomically by `write` after every job: a row per run (skipped,
    finished, failed, or "pending" while none came back), the earlier calls of the same record and the runs they
    finished (`earlier_calls`, `earlier_finished`), how busy the GPUs were (`monitor`, a `GpuMonitor` set once the
    sweep watches them) and the compile warm-ups (`warmups`)."""

    STATUSES = ("finished", "skipped", "failed", "pending")

    def __init__(self, name: str, runs: list[list[str]], out: Path, done: dict[int, dict[str, Any]]):
        self.name, self.runs, self.out = name, runs, out
        self.results: list[dict[str, Any] | None] = [done.get(i) for i in range(len(runs))]
        # the call's start, to the microsecond and before its clock starts: sweep_speed.py --grid-from takes the
        # union of the calls' [started, started + wall_s], so that side-by-side calls count their shared time once
        self.started = datetime.now(timezone.utc).isoformat(timespec="microseconds")
        self.t0 = time.perf_counter()
        self.earlier, self.finished_before = earlier_calls(out), earlier_finished(out)
        self.monitor: GpuMonitor | None = None
        self.warmups: list[dict[str, Any]] = []

    def write(self) -> dict[str, Any]:
        """Write the record as it stands now (atomically) and return it."""
        rows = [r if r is not None else {"overrides": self.runs[i], "run_dir": None, "status": "pending"}
                for i, r in enumerate(self.results)]
        this_call = {s: sum(r["status"] == s for r in rows) for s in self.STATUSES}
        rows = [self.finished_before.get(_row_key(r), r) if r["status"] == "skipped" else r for r in rows]
        # a run an earlier call finished outside this call's selection (other MIXERS, another shard) stays listed
        listed = {_row_key(r) for r in rows}
        rows += [r for key, r in self.finished_before.items() if key not in listed]
        counts = {s: sum(r["status"] == s for r in rows) for s in self.STATUSES}
        wall = time.perf_counter() - self.t0
        calls = [*self.earlier, {"started": self.started, "wall_s": wall, **this_call}]
        record = {"sweep": self.name, "runs": rows, **counts, "wall_s": wall, "calls": calls,
                  "calls_wall_s": sum(c["wall_s"] for c in calls)}
        gpus = self.monitor.summary() if self.monitor is not None else None
        if gpus:
            record["gpus"] = gpus
        if self.warmups:
            record["compile_warmups"] = self.warmups
        atomic_write_text(self.out, json.dumps(record, indent=1) + "\n")
        return record


def _run_jobs(runs, name, workers, device, extra, pack, mps, order, out: Path, done: dict,
              pack_max_d: int = 0) -> dict[str, Any]:
    """run_sweep's jobs, serially or in worker pools, with the record (`SweepRecord` at `out`) rewritten after
    each; `pack`: None, "lrs" or "seeds" (`pack_mode`); `done`: records of runs already skipped; `pack_max_d`: see
    `unpack_wide`."""
    from tqdm.auto import tqdm

    record = SweepRecord(name, runs, out, done)
    bar = tqdm(total=len(runs), initial=len(done), desc=f"sweep {name}", dynamic_ncols=True)
    jobs = [job for job in ([i for i in job if i not in done] for job in plan_jobs(runs, extra, pack, pack_max_d))
            if job]
    jobs = order_jobs(jobs, runs, order)
    record.monitor = GpuMonitor(device)
    try:
        if workers <= 1:
            _run_serial(jobs, extra, device, mps, record, bar)
        else:
            _WorkerPools(jobs, extra, device, workers, mps, record, bar).run()
    finally:
        record.monitor.stop()
    bar.close()
    written = record.write()
    for index, gpu in written.get("gpus", {}).items():
        print(f"zoo-sweep {name}: GPU {index} ran kernels {gpu['util_mean_pct']:.0f}% of the time "
              f"({gpu['samples']} samples), peak memory {gpu['mem_peak_mib'] / 1024:.1f} GiB", file=sys.stderr)
    written["path"] = str(out)
    return written


def _run_serial(jobs: list[list[int]], extra: list[str], device: str, mps: str, record: SweepRecord, bar) -> None:
    """The jobs one after the other in this process; a time limit or a SIGTERM (a run returned interrupted) starts
    nothing more."""
    _, why = MPS.start(device, 1, mps)  # one run at a time: never starts a daemon
    _say(record.name, why)
    serial_extra = extra + ([f"train.device={device}"] if device != "auto" else [])
    for job in jobs:
        for i, result in zip(job, run_job([record.runs[i] for i in job], serial_extra)):
            record.results[i] = result
        bar.update(len(job))
        record.write()
        if any("interrupted" in record.results[i] for i in job):
            break


class _WorkerPools:
    """The jobs on pools of spawned worker processes, each worker owning one device (`devices_for`).

    Compiled jobs of one shape started together would each compile the same graphs at once: one warm-up per shape
    that several jobs share compiles them first, and those jobs wait for it (`warm_job`). A job that runs out of
    device memory beside others goes to the back of the queue, with one job fewer at once from then on; out of
    memory beside others twice, it runs after the rest, one job per GPU (`run`). A pass (`one_pass`) keeps its
    queue in `waiting`, its jobs at once in `limit` (down to `floor`, one per GPU), the jobs requeued once in
    `requeued` and those to run alone in `retry`; `alone` says whether each worker has its GPU to itself."""

    def __init__(self, jobs, extra, device, workers, mps, record: SweepRecord, bar):
        import multiprocessing

        self.jobs, self.extra, self.device, self.workers, self.mps = jobs, extra, device, workers, mps
        self.record, self.bar, self.name, self.runs = record, bar, record.name, record.runs
        self.ctx = multiprocessing.get_context("spawn")
        self.manager = self.ctx.Manager()
        self.stop = self.manager.Event()
        self.first_oom: dict[int, str] = {}  # run index -> its first out-of-memory error beside other jobs
        self.keys = {tuple(job): shape_key([self.runs[i] for i in job]) for job in jobs}
        self.warming = {key: job for key, job in shared_shapes(jobs, self.runs).items()
                        if trains_compiled(self.runs[job[0]], extra)}

    def run(self) -> None:
        devices = devices_for(self.device, self.workers)
        daemon, why = MPS.start(self.device, self.workers, self.mps)
        _say(self.name, why)
        if self.warming:
            n = len(self.warming)
            _say(self.name, f"{n} shape{'s' * (n > 1)} that several compiled jobs share: one warm-up compiles each "
                            "before its jobs start")
        try:
            retry = self.one_pass(self.jobs, devices)
            if retry and not self.stop.is_set():
                # Out of memory beside other runs is the sweep's packing, not the run's fault: those jobs run
                # again after the others, one per GPU, from their checkpoints; only one that fails alone fails.
                n = sum(map(len, retry))
                _say(self.name, f"{n} run{'s' * (n > 1)} ran out of GPU memory twice beside other runs; run again "
                                f"now, one job per GPU")
                self.one_pass(retry, sorted(set(devices)))
            for i, why in self.first_oom.items():
                self.record.results[i] = self.record.results[i] | {"retried_after": why}
            self.record.write()
        finally:
            if daemon is not None:
                daemon.stop()

    def one_pass(self, todo: list[list[int]], devices: list[str]) -> list[list[int]]:
        """`todo` on a pool of one worker per entry of `devices`. A job that runs out of device memory beside
        others (its runs recorded pending meanwhile) lowers the number of jobs at once by one, down to one per
        GPU, and goes to the back of the queue; out of memory beside others again, it is returned. A worker process
        that dies takes the pool's running jobs with it (recorded failed); the jobs not started yet go on in a new
        pool."""
        self.alone = len(set(devices)) == len(devices)
        threads = max(1, (os.cpu_count() or 1) // len(devices))
        self.limit, self.floor = len(devices), len(set(devices))
        self.waiting, self.requeued, self.retry = collections.deque(todo), set(), []
        while self.waiting and not self.stop.is_set():
            queue = self.manager.Queue()
            for dev in devices:
                queue.put(dev)
            pool = ProcessPoolExecutor(len(devices), mp_context=self.ctx, initializer=_worker_init,
                                       initargs=(queue, threads))
            running: set = set()
            warm_futures: dict = {}
            with pool, _forward_sigterm(pool, self.stop) as futures:
                self.fill(pool, futures, warm_futures, running)
                while running:
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in finished:
                        running.discard(future)
                        if future in warm_futures:  # its shape's jobs may start now, warm or not
                            self.warmed(future, warm_futures.pop(future))
                        elif not future.cancelled():  # one not started before a SIGTERM stays pending
                            self.collect(futures[future], future)
                    self.fill(pool, futures, warm_futures, running)
        return self.retry

    def fill(self, pool: ProcessPoolExecutor, futures: dict, warm_futures: dict, running: set) -> None:
        """Start the shapes' warm-ups, then waiting jobs whose shape is not warming, up to `limit` running; after
        a SIGTERM nothing more starts (the jobs waiting stay pending), and a job the pool refuses (a worker died)
        waits for the next pool."""
        unstarted = [key for key in self.warming if key not in warm_futures.values()]
        while unstarted and len(running) < self.limit and not self.stop.is_set():
            key = unstarted.pop(0)
            try:
                future = pool.submit(warm_job, [self.runs[i] for i in self.warming[key]], self.extra)
            except BrokenProcessPool:
                return
            warm_futures[future] = key
            running.add(future)
        while len(running) < self.limit and not self.stop.is_set():
            job = next((job for job in self.waiting if self.keys[tuple(job)] not in self.warming), None)
            if job is None:
                return
            self.waiting.remove(job)
            try:
                future = pool.submit(run_job, [self.runs[i] for i in job], self.extra, self.stop, self.alone)
            except BrokenProcessPool:
                self.waiting.appendleft(job)
                return
            futures[future] = job
            running.add(future)

    def warmed(self, future, key) -> None:
        """A shape's warm-up ended: its jobs may start, and the record lists the warm-up (or its worker's death)."""
        self.warming.pop(key, None)
        try:
            self.record.warmups.append(future.result())
        except Exception as e:  # the worker process itself died
            self.record.warmups.append({"overrides": list(key), "error": repr(e)})

    def collect(self, job: list[int], future) -> None:
        """A job's results into the record; one that ran out of memory beside others is requeued (`one_pass`)."""
        results = self.record.results
        try:
            for i, result in zip(job, future.result()):
                results[i] = result
        except Exception as e:  # the worker process itself died
            for i in job:
                results[i] = {"overrides": self.runs[i], "run_dir": None, "status": "failed", "error": repr(e)}
        if not self.alone and any(results[i].get("oom") for i in job):
            for i in job:
                if results[i].get("oom"):
                    self.first_oom.setdefault(i, results[i]["error"])
                if results[i]["status"] == "failed":
                    results[i] = results[i] | {"status": "pending"}
            if self.limit > self.floor:
                self.limit -= 1
                _say(self.name, f"a job ran out of GPU memory beside others: at most {self.limit} "
                                f"job{'s' * (self.limit > 1)} at once from now")
            if tuple(job) in self.requeued:
                self.retry.append(job)
            else:
                self.requeued.add(tuple(job))
                self.waiting.append(job)
        else:
            self.bar.update(len(job))
        self.record.write()


def _say(name: str, line: str) -> None:
    """A line of the sweep (whether CUDA MPS is used, and why not) to its log and its stderr."""
    log.info("zoo-sweep %s: %s", name, line)
    print(f"zoo-sweep {name}: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _forward_sigterm(pool: ProcessPoolExecutor, stop):
    """While the block runs, a SIGTERM to the sweep sets `stop` (jobs that start later leave their runs pending:
    the pool may already have handed them to a worker), cancels the jobs not handed out, and passes the signal on
    to the workers, whose runs then checkpoint where they are and return as interrupted
    (zoo.train.stop_requests). Yields the {future: job} dict the block fills. Only the main thread may set a
    handler; elsewhere SIGTERM keeps its default."""
    futures: dict = {}

    def on_sigterm(signum, frame):
        stop.set()
        for future in futures:
            future.cancel()
        for process in list(getattr(pool, "_processes", {}).values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main else None
    try:
        yield futures
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def shard(runs: list[list[str]], spec: str) -> list[list[str]]:
    """The runs of shard "I/N": those of every N-th lr group (`lr_groups`) starting at group I."""
    try:
        i, n = (int(x) for x in spec.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise SystemExit(f"zoo-sweep: --shard must be I/N with 0 <= I < N, got {spec!r}") from None
    return [runs[r] for g, group in enumerate(lr_groups(runs)) if g % n == i for r in group]


def _runs_root_of(run: list[str], extra: list[str]) -> Path:
    for override in reversed(run + extra):
        if override.startswith("runs_root="):
            return Path(override.split("=", 1)[1])
    return Path("runs")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zoo-sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_file")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every run (e.g. train.epochs=2)")
    parser.add_argument("--workers", type=int, default=0, help="parallel runs (default: 4 per GPU, else 1)")
    parser.add_argument("--runs-per-gpu", type=int, default=4)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--runs-root", default=None)
    parser.add_argument("--name", default=None, help="sweep name (default: the file's directory or stem)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state, run nothing")
    parser.add_argument("--emit", action="store_true", help="print one zoo-train command per run (per pack)")
    parser.add_argument(
        "--pack-lrs", action="store_true", help="train runs differing only in optim.lr as one packed job each"
    )
    parser.add_argument("--pack-seeds", action="store_true",
                        help="train runs differing only in optim.lr and train.seed as one packed job each (each "
                        "member its own seed's init and batches; a mixture of segments packs per seed)")
    parser.add_argument("--pack-max-d", type=int, default=0, metavar="N",
                        help="with --pack-lrs/--pack-seeds: pack only runs whose model.d_model is at most N; wider "
                        "runs train one per job (0: pack every width)")
    parser.add_argument("--shard", default=None, help="I/N: only every N-th lr group, from group I")
    parser.add_argument("--mps", default="auto", choices=["auto", "on", "off"],
                        help="CUDA MPS for runs that share a GPU (auto: when several workers share one and the "
                        "machine allows it)")
    parser.add_argument("--order", default="longest", choices=ORDERS,
                        help="start the costliest jobs first (longest: the shortest grid wall), the cheapest first "
                        "(shortest: the most runs finished by a time-limited job on a machine that keeps no "
                        "checkpoints), or keep the sweep file's order")
    parser.add_argument("--skip-summaries", action="append", default=[], metavar="DIR",
                        help="skip the runs that have a summary in DIR (a reproduction's committed summaries/); "
                        "repeatable")
    parser.add_argument("--compile-cache", default="runs", metavar="DIR",
                        help="torch.compile's and Triton's cache for the sweep (default runs: <runs_root>/_sweeps/"
                        "compile_cache; none: their own defaults)")
    parser.add_argument("--time-limit", type=float, default=0, metavar="S",
                        help="stop after S seconds: running runs checkpoint where they are (mid-epoch too) and the "
                        "same command resumes them; for time-limited allocations (0: none)")
    args = parser.parse_intermixed_args(argv)
    if args.time_limit < 0:
        raise SystemExit(f"zoo-sweep: --time-limit must be >= 0 seconds, got {args.time_limit:g}")
    if args.pack_max_d < 0:
        raise SystemExit(f"zoo-sweep: --pack-max-d must be >= 0, got {args.pack_max_d}")
    if args.pack_max_d and not (args.pack_lrs or args.pack_seeds):
        raise SystemExit("zoo-sweep: --pack-max-d limits packing: pass it with --pack-lrs or --pack-seeds")
    try:
        runs = load_sweep(args.sweep_file)
    except SweepFileError as e:
        raise SystemExit(f"zoo-sweep: error: {e}") from None
    path = Path(args.sweep_file)
    name = args.name or (path.parent.name if path.stem == "sweep" else path.stem)
    if args.shard:
        runs = shard(runs, args.shard)
        name += ".shard-{}-of-{}".format(*args.shard.split("/"))
    extra = list(args.overrides) + ([f"runs_root={args.runs_root}"] if args.runs_root else [])
    if args.emit:
        import shlex

        packing = args.pack_lrs or args.pack_seeds
        jobs = emit_jobs(runs, args.pack_seeds) if packing else [[i] for i in range(len(runs))]
        for job in unpack_wide(jobs, runs, extra, args.pack_max_d):
            print(shlex.join(["zoo-train", *emitted_run([runs[i] for i in job]), *extra]))
        return
    if args.dry_run:
        _dry_run(runs, extra, args.skip_summaries, pack_mode(args.pack_lrs, args.pack_seeds), args.pack_max_d)
        return
    workers = args.workers
    if workers <= 0:
        import torch

        workers = args.runs_per_gpu * torch.cuda.device_count() if args.device != "cpu" else 1
        workers = max(1, workers)
    stop = [f"train.stop_at={time.time() + args.time_limit:.3f}"] if args.time_limit else []
    overrides = list(args.overrides) + stop
    record = run_sweep(runs, name, workers, args.device, overrides, args.runs_root, args.pack_lrs, args.mps, args.order,
                       args.compile_cache, args.skip_summaries, pack_seeds=args.pack_seeds,
                       pack_max_d=args.pack_max_d)
    call = record["calls"][-1]
    print(
        f"zoo-sweep {name}: {call['finished']} finished, {call['skipped']} skipped, "
        f"{call['failed']} failed, {call['pending']} pending in {record['wall_s']:.1f} s -> {record['path']}"
    )
    interrupted = [r for r in record["runs"] if "interrupted" in r]
    if interrupted:
        done = sorted({r["epochs_done"] for r in interrupted if r.get("epochs_done") is not None})
        where = "" if not done else f" after {done[0]}" + (f"–{done[-1]}" if len(done) > 1 else "") + " finished epochs"
        print(f"zoo-sweep {name}: {len(interrupted)} runs stopped at the time limit or on SIGTERM, checkpointed"
              f"{where}; the same command resumes them")
    for r in record["runs"]:
        if r["status"] == "failed":
            print(f"  failed: {' '.join(r['overrides'])}: {r['error']}", file=sys.stderr)
    if record["failed"]:
        raise SystemExit(1)


def _dry_run(runs: list[list[str]], extra: list[str], skip_summaries: list[str] = (), pack: str | None = None,
             pack_max_d: int = 0) -> None:
    """One line a run: done, partial (with the epoch its checkpoint resumes from), todo or invalid (its run dir), or
    committed (a summary in skip_summaries); then one line of counts, what a time-limited job has left to train at a
    glance. With `pack` (`pack_mode`) a last line counts the jobs the sweep would start for the partial and todo runs
    (`plan_jobs`): packs and single runs."""
    from collections import Counter

    from zoo.runs import RunDir
    from zoo.train import ConfigError, load_config, run_name

    committed = committed_runs(runs, extra, skip_summaries) if skip_summaries else {}
    states: Counter[str] = Counter()
    left: set[int] = set()
    for i, run in enumerate(runs):
        if i in committed:
            state, where = "committed", f"{' '.join(run)} -> {committed[i]['summary']}"
        else:
            try:
                cfg, _ = load_config(run + extra)
            except ConfigError as e:
                state, where = "invalid", f"{' '.join(run)}: {e}"
            else:
                run_dir = RunDir(Path(cfg.runs_root) / cfg.experiment_name / run_name(cfg))
                state = "done" if run_dir.is_finished() else ("partial" if run_dir.exists() else "todo")
                where = str(run_dir.path)
                if state == "partial":  # how far it will resume from, for planning a time-limited job
                    at = run_dir.checkpoint_position()
                    where += (f" (checkpoint after {at[0]} of {cfg.train.epochs} epochs, step {at[1]})" if at
                              else " (no checkpoint: trains from the start)")
        states[state] += 1
        if state in ("partial", "todo"):
            left.add(i)
        print(f"{state:9s} {where}")
    counts = ", ".join(f"{states[s]} {s}" for s in ("committed", "done", "partial", "todo", "invalid") if states[s])
    source = f" (committed: in {', '.join(skip_summaries)})" if committed else ""
    print(f"{len(runs)} runs: {counts}{source}")
    if pack:
        jobs = [job for job in ([i for i in job if i in left] for job in plan_jobs(runs, extra, pack, pack_max_d))
                if job]
        packs = [job for job in jobs if len(job) > 1]

        def count(n: int, noun: str) -> str:
            return f"{n} {noun}{'s' * (n != 1)}"

        print(f"{count(len(jobs), 'job')} to start: {count(len(packs), 'pack')} of "
              f"{count(sum(map(len, packs)), 'run')}, {count(len(jobs) - len(packs), 'single run')}")


if __name__ == "__main__":
    main()
