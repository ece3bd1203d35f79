"""A sweep's jobs: which runs train together and in what order (planning), and how a worker trains one job, a
single run or a pack of runs differing only in lr and seed, with every failure returned as a record, never raised.

`zoo.sweep` runs these in its process pool; `zoo-train -m` (a Hydra multirun) runs `run_one` per job. The rules
they follow (skip finished runs, resume started ones, unpack a pack that fails, leave a pack out of memory beside
other jobs for the sweep to retry) are written down in zoo/sweep.py's docstring.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import time
import traceback
from pathlib import Path
from typing import Any

from zoo.atomic import atomic_write_text

log = logging.getLogger("zoo.sweep")  # a job's warnings are the sweep's: they go to zoo-sweep's log


def _device_overrides() -> list[str]:
    """In a pool worker, the device it owns (its one visible GPU is cuda:0); nothing elsewhere."""
    device = os.environ.get("ZOO_SWEEP_DEVICE")
    if device is None:
        return []
    return ["train.device=" + ("cuda" if device.startswith("cuda") else device)]


def error_line(e: BaseException) -> str:
    """One line for a failed run's record: the exception's type and the first non-empty line of its message (the
    last line of a traceback is often a footer such as a documentation link; error.txt keeps the whole)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    line = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    if e.__cause__ is not None:  # a wrapper (torch.compile's BackendCompilerFailed) names what it caught
        line += f" (from {error_line(e.__cause__)})"
    return line


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is a device allocation failure (the caching allocator's OutOfMemoryError, or a CUDA or cuBLAS
    call that reports it): something a run beside others on one GPU hits and the same run alone may not."""
    import torch

    seen = 0
    while e is not None and seen < 8:  # through wrappers: torch.compile raises what it caught as their cause
        text = str(e)
        if isinstance(e, torch.OutOfMemoryError) or isinstance(e, RuntimeError) and (
                "CUDA error: out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text):
            return True
        e, seen = e.__cause__, seen + 1
    return False


def _failed(e: BaseException) -> dict[str, Any]:
    """A failed run's record fields; `oom` marks a device allocation failure (`out_of_memory`)."""
    return {"status": "failed", "error": error_line(e)} | ({"oom": True} if out_of_memory(e) else {})


def _pending(e) -> dict[str, Any]:
    """The record of a run that an `Interrupted` stopped: the next sweep resumes it from its checkpoint."""
    return {"status": "pending", "interrupted": str(e), "epochs_done": e.epochs_done}


def run_one(overrides: list[str], extra: list[str]) -> dict[str, Any]:
    """Compose, then train one run unless it already finished; never raises (failures are returned)."""
    from zoo.runs import RunDir
    from zoo.train import ConfigError, Interrupted, load_config, run_name, train

    record: dict[str, Any] = {"overrides": overrides, "run_dir": None}
    full = overrides + extra + ["train.progress=false"] + _device_overrides()
    t0 = time.perf_counter()
    try:
        cfg, resolved = load_config(full)
    except ConfigError as e:
        return record | {"status": "failed", "error": f"config: {e}"}
    run = RunDir(Path(cfg.runs_root) / cfg.experiment_name / run_name(cfg))
    record["run_dir"] = str(run.path)
    if run.is_finished():
        return record | {"status": "skipped"}
    if run.exists():
        cfg.train.resume = True
    try:
        summary = train(cfg, resolved)
    except Interrupted as e:  # checkpointed at the time limit or on SIGTERM: the next sweep resumes it
        return record | _pending(e)
    except Exception as e:  # a failing run is recorded; the sweep goes on
        run.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run.path / "error.txt", traceback.format_exc())
        return record | _failed(e)
    (run.path / "error.txt").unlink(missing_ok=True)
    return record | {
        "status": "finished",
        "wall_s": time.perf_counter() - t0,
        "valid/accuracy": summary.get("valid/accuracy"),
    }


def lr_groups(runs: list[list[str]], seeds: bool = False) -> list[list[int]]:
    """Indices of runs whose overrides are equal but for `optim.lr=...` (and, with `seeds`, `train.seed=...`), in
    order of first appearance."""
    differ = ("optim.lr=", "train.seed=") if seeds else ("optim.lr=",)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, run in enumerate(runs):
        groups.setdefault(tuple(o for o in run if not o.startswith(differ)), []).append(i)
    return list(groups.values())


def run_pack(runs: list[list[str]], extra: list[str], alone: bool = True) -> list[dict[str, Any]]:
    """Runs that differ only in optim.lr and train.seed, trained as one pack; never raises (failures are returned).

    Finished runs are skipped and failed configs reported, as in `run_one`; the rest train together, or one at
    a time when they cannot pack or the pack fails in training (the reason goes into each record as `unpacked`).
    Runs of several seeds that cannot pack together (a mixture of training segments) train as one pack per seed.
    A pack that runs out of device memory while other jobs share its GPU (`alone=False`) is not unpacked: its
    unfinished members are recorded failed with `oom`, for the sweep to retry the pack alone.
    """
    from zoo.runs import RunDir
    from zoo.steps import PackError
    from zoo.train import ConfigError, Interrupted, load_config, run_name, train_runs

    full = extra + ["train.progress=false"] + _device_overrides()
    records: list[dict[str, Any]] = []
    members, resolved, todo = [], [], []
    for overrides in runs:
        record: dict[str, Any] = {"overrides": overrides, "run_dir": None}
        records.append(record)
        try:
            cfg, text = load_config(overrides + full)
        except ConfigError as e:
            record |= {"status": "failed", "error": f"config: {e}"}
            continue
        run = RunDir(Path(cfg.runs_root) / cfg.experiment_name / run_name(cfg))
        record["run_dir"] = str(run.path)
        if run.is_finished():
            record["status"] = "skipped"
            continue
        members.append(cfg)
        resolved.append(text)
        todo.append(record)
    if not members:
        return records
    if any(RunDir(r["run_dir"]).exists() for r in todo):
        for cfg in members:
            cfg.train.resume = True
    t0 = time.perf_counter()
    try:
        summaries = train_runs(members, resolved)
    except PackError as e:
        by_seed: dict[int, list[int]] = {}
        for j, cfg in enumerate(members):
            by_seed.setdefault(cfg.train.seed, []).append(j)
        if len(by_seed) > 1:  # a pack per seed, each of which may still fail alone
            for group in by_seed.values():
                results = run_pack([todo[j]["overrides"] for j in group], extra, alone)
                for j, result in zip(group, results):
                    todo[j] |= result | {"packed_by_seed": str(e)}
            return records
        for record in todo:
            record |= run_one(record["overrides"], extra) | {"unpacked": str(e)}
        return records
    except Interrupted as e:  # the members that stopped early are finished; the others resume next time
        for record in todo:
            done = RunDir(record["run_dir"]).is_finished()
            record |= {"status": "finished", "packed": len(members)} if done else _pending(e)
        return records
    except Exception as e:
        # One member's failure (a divergence, a kernel error) stops the whole pack. The members that finished
        # (an early stop) stay finished; the rest train again one at a time, resuming from the pack's
        # checkpoints, so the failing run is recorded failed (its own error.txt) and the others finish. Out of
        # memory beside other jobs, they are left to the sweep to retry as a pack instead.
        beside = out_of_memory(e) and not alone
        why = f"the pack failed ({error_line(e)}); its runs trained one at a time"
        if not beside:
            log.warning("zoo-sweep: %s", why)
        for record in todo:
            run = RunDir(record["run_dir"])
            if run.is_finished():
                accuracy = run.read_summary().get("valid/accuracy")
                record |= {"status": "finished", "valid/accuracy": accuracy, "packed": len(members)}
            elif beside:
                record |= _failed(e)
            else:
                record |= run_one(record["overrides"], extra) | {"unpacked": why}
        return records
    for record, summary in zip(todo, summaries):
        (Path(record["run_dir"]) / "error.txt").unlink(missing_ok=True)
        record |= {
            "status": "finished",
            "wall_s": time.perf_counter() - t0,
            "valid/accuracy": summary.get("valid/accuracy"),
            "packed": len(members),
        }
    return records


def run_job(runs: list[list[str]], extra: list[str], stop=None, alone: bool = True) -> list[dict[str, Any]]:
    """One job of the pool: a single run, or a group of runs differing only in optim.lr (and train.seed, with
    --pack-seeds): a pack. `stop`: an
    Event the sweep sets on SIGTERM; a job that starts after it leaves its runs pending. `alone`: whether the job
    has its GPU to itself (see `run_pack`)."""
    if stop is not None and stop.is_set():
        return [{"overrides": run, "run_dir": None, "status": "pending"} for run in runs]
    try:
        return [run_one(runs[0], extra)] if len(runs) == 1 else run_pack(runs, extra, alone)
    finally:
        _release_device_memory()


def _value(run: list[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in reversed(run) if o.startswith(key + "=")), None)


def emit_jobs(runs: list[list[str]], seeds: bool) -> list[list[int]]:
    """The packs `--emit` writes one zoo-train command for: the lr groups, and with `seeds` the groups over lrs and
    seeds wherever every run names its train.seed and the group's (seed, lr) pairs are a full product (what
    train.pack_seeds x train.pack_lrs expresses); other groups split into their lr groups. A group with a run that
    names no optim.lr (the config's default) splits into single runs: a pack's command must list every lr."""
    jobs = []
    for group in lr_groups(runs, seeds=seeds):
        pairs = [(_value(runs[i], "train.seed"), _value(runs[i], "optim.lr")) for i in group]
        seeds_, lrs = dict.fromkeys(p[0] for p in pairs), dict.fromkeys(p[1] for p in pairs)
        if len(group) > 1 and None in lrs:
            jobs += [[i] for i in group]
        elif not seeds or (None not in seeds_ and len(set(pairs)) == len(pairs) == len(seeds_) * len(lrs)):
            jobs.append(group)
        else:
            jobs += [[group[j] for j in sub] for sub in lr_groups([runs[i] for i in group])]
    return jobs


def run_d_model(run: list[str], extra: list[str] = ()) -> int | None:
    """A run's model.d_model: the last override that sets it (`+`/`++` forms too), else its composed config's;
    None where the config does not compose (the sweep then records why)."""
    from zoo.train import ConfigError, load_config

    for override in reversed([*run, *extra]):
        key, _, value = override.lstrip("+").partition("=")
        if key == "model.d_model":
            if value.isdigit():
                return int(value)
            break  # an interpolation or a typo: the composed config says what it is
    try:
        cfg, _ = load_config([*run, *extra])
    except ConfigError:
        return None
    return cfg.model.d_model


def unpack_wide(jobs: list[list[int]], runs: list[list[str]], extra: list[str], max_d: int) -> list[list[int]]:
    """`jobs` with every pack whose runs' d_model exceeds `max_d` split into single runs (0: no limit)."""
    if max_d <= 0:
        return jobs
    out: list[list[int]] = []
    for job in jobs:
        d = run_d_model(runs[job[0]], extra) if len(job) > 1 else None
        out += [[i] for i in job] if d is not None and d > max_d else [job]
    return out


def pack_mode(pack_lrs: bool, pack_seeds: bool) -> str | None:
    """What a pack's runs may differ in: "seeds" (lr and seed), "lrs" (lr), or None (no packing)."""
    return "seeds" if pack_seeds else "lrs" if pack_lrs else None


def plan_jobs(runs: list[list[str]], extra: list[str], pack: str | None, pack_max_d: int = 0) -> list[list[int]]:
    """The jobs of a sweep over every run, before finished ones are dropped: with `pack`, its lr groups (`lr_groups`,
    over seeds too for "seeds") less the packs `unpack_wide` splits; without, one run a job."""
    if not pack:
        return [[i] for i in range(len(runs))]
    return unpack_wide(lr_groups(runs, seeds=pack == "seeds"), runs, extra, pack_max_d)


def emitted_run(job: list[list[str]]) -> list[str]:
    """One zoo-train command's overrides for a job: the run itself, or its pack as train.pack_lrs (and
    train.pack_seeds when its seeds differ)."""
    run = job[0]
    if len(job) == 1:
        return run
    lrs = list(dict.fromkeys(_value(r, "optim.lr") for r in job))
    seeds = list(dict.fromkeys(_value(r, "train.seed") for r in job))
    keep = [o for o in run if not o.startswith(("optim.lr=", "train.seed=") if len(seeds) > 1 else "optim.lr=")]
    return keep + [f"train.pack_lrs=[{','.join(lrs)}]"] + ([f"train.pack_seeds=[{','.join(seeds)}]"]
                                                          if len(seeds) > 1 else [])


def shape_key(runs: list[list[str]]) -> tuple[str, ...]:
    """What a job's compiled graphs depend on, read from its runs' overrides: the first run's overrides without
    its lr and seed (the rest of the job's runs differ only in those), and the number of runs (a pack's width)."""
    return (*(o for o in runs[0] if not o.startswith(("optim.lr=", "train.seed="))), f"runs={len(runs)}")


def shared_shapes(jobs: list[list[int]], runs: list[list[str]]) -> dict[tuple[str, ...], list[int]]:
    """{shape_key: the first job of that shape} for every shape more than one of `jobs` (lists of indices into
    `runs`) has, in the jobs' order."""
    keys = [shape_key([runs[i] for i in job]) for job in jobs]
    counts = collections.Counter(keys)
    first: dict[tuple[str, ...], list[int]] = {}
    for job, key in zip(jobs, keys):
        if counts[key] > 1:
            first.setdefault(key, list(job))
    return first


def warm_job(runs: list[list[str]], extra: list[str]) -> dict[str, Any]:
    """In a pool worker: compile the training step of a job (`zoo.train.compile_warmup`) into the sweep's compile
    cache, so the jobs of its shape load it instead of each compiling it beside the others. Never raises: a job
    whose warm-up failed compiles itself, or reports its own error when it runs."""
    from zoo.train import compile_warmup, load_config

    t0 = time.perf_counter()
    record: dict[str, Any] = {"overrides": runs[0], "runs": len(runs)}
    try:
        full = extra + ["train.progress=false"] + _device_overrides()
        record["shapes"] = compile_warmup([load_config(run + full)[0] for run in runs])
    except Exception as e:
        record["error"] = error_line(e)
    finally:
        _release_device_memory()
    return record | {"wall_s": time.perf_counter() - t0}


def trains_compiled(run: list[str], extra: list[str]) -> bool:
    """Whether `run` (with the sweep's `extra`) trains with train.compile=true; False for a config that fails."""
    from zoo.train import load_config

    try:
        return bool(load_config(run + extra)[0].train.compile)
    except Exception:  # the job records its own config error when it runs
        return False


def _release_device_memory() -> None:
    """Give the job's cached GPU memory back to the driver: a worker keeps its CUDA context between jobs, and
    memory its allocator still reserves from a finished (or failed) job is memory the runs beside it cannot get."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def job_cost(run: list[str]) -> float:
    """A rough cost of a run from its overrides alone (no config is composed): d_model x the longest training
    sequence x epochs. The pool starts the costliest jobs first, so the last to finish are short ones."""

    def number(key: str, default: float) -> float:
        for o in reversed(run):
            if o.startswith(key + "="):
                try:
                    return float(o.split("=", 1)[1])
                except ValueError:
                    return default
        return default

    lengths = [int(x) for o in run if o.startswith("data.train=") for x in re.findall(r"seq_len:\s*(\d+)", o)]
    return number("model.d_model", 128) * max(lengths, default=256) * number("train.epochs", 64)


ORDERS = ("longest", "shortest", "file")


def order_jobs(jobs: list[list[int]], runs: list[list[str]], order: str) -> list[list[int]]:
    """The jobs in the order the sweep starts them: "longest" (the costliest first, `job_cost` times the job's runs,
    as a pack takes about the device time of its members one by one: the grid ends on short jobs, the shortest
    wall for a whole grid), "shortest" (the cheapest first: the most runs finished by a
    time-limited call whose unfinished runs' checkpoints will not outlive the machine) or "file". Ties keep the
    file's order."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if order == "file":
        return list(jobs)
    sign = -1 if order == "longest" else 1
    return sorted(jobs, key=lambda job: sign * job_cost(runs[job[0]]) * len(job))
