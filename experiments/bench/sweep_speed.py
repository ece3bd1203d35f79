"""Benchmark: how fast recall sweeps run, measured in one process tree on one GPU.

    python experiments/bench/sweep_speed.py                      # probe + every grid config + grid estimate
    python experiments/bench/sweep_speed.py --skip-probe         # per-config step times and the estimate only
    python experiments/bench/sweep_speed.py --tiny --device cpu  # a CPU smoke run of the whole bench

1. The 16-run probe (experiments/bench/probe16.py: L=256, n=16, 100k examples, d=64 attention and Based, the 4 grid lrs
   x 2 seeds, 3 epochs, early stop off) through `zoo-sweep`, once per setting in `--variants`, each into a fresh runs
   root: `today` is the landed default (4 runs per GPU, eager, no MPS), the others name their overrides and flags, and
   optionally environment variables for their zoo-sweep (a fourth field, e.g. `based-triton||--pack-lrs --workers
   4|ZOO_PROBE_BASED_IMPL=triton`: Based on its Triton kernels). The wall time is the whole `zoo-sweep` call (process
   start, data, every run's training and evaluation). Each run's valid accuracy is compared across the settings. Where
   that wall goes: `jobs_s` sums the jobs' own times (a pack counts once) and `training_s` their training loops' (the
   summaries' wall_time_s); jobs that run side by side overlap, so both can exceed the wall.
2. Every distinct (mixer, L, d_model) of the Zoology Fig. 2 grid (experiments/zoology_fig2/sweep.py): the
   model's training step in this process, with the device synchronised: wall ms per step and the device's own
   kernel time per step (torch.profiler), eager, (with --compiled) compiled, and (with --packed) as the
   vmapped, CUDA-graphed pack of its 4 lrs that `zoo-sweep --pack-lrs` trains (compiled too, with both flags).
   A run is charged the cheapest: a pack's step divided among its members; the table's last column names it
   (`cheapest_step`: where "compiled" beats "compiled pack", `zoo-sweep --pack-max-d` should leave that width
   unpacked). With `--top N` (CUDA) each config
   also lists the N kernels that took most of its last timed step's device time, to say where that time goes:
   `ZOO_FIG2=L256 D=512 python experiments/bench/sweep_speed.py --skip-probe --compiled --packed --top 12`.
   Each config also has its FLOPs per training example (torch's FlopCounterMode: what its matmuls,
   convolutions and attention cost; Triton kernels it cannot see count 0) and the TFLOP/s its cheapest step
   reaches. On CUDA the bench measures the bf16 GEMM rate and prints the grid's FLOP floor: every run's FLOPs at
   full epochs at that rate (`grid_flop_floor_s`), the time that only early stopping can beat.
3. The grid estimate: sum over the grid's runs of steps per epoch x epochs x the step's device time, which
   is what the GPU must execute when enough runs share it under MPS to hide their hosts' launch time. Runs
   are charged the full `train.epochs` (no early stop), so the figure is an upper bound. With `--epochs-from
   DIR` (finished runs' summary.json files, e.g. experiments/zoology_fig2/summaries), a second estimate charges
   each finished run the epochs it took and the others the mean of their config's finished runs (the full
   `train.epochs` where none finished): `grid_estimate_measured_s`.
   `--from-json FILE --epochs-from DIR` recomputes both from a committed result, without a device.
4. The grid as it ran: `--grid-from PATH...` (runs roots, their `_sweeps/` folders, or sweep record files
   `<runs_root>/_sweeps/<sweep name>[.shard-I-of-N].json`, as zoo-sweep writes them) adds up the records' calls
   into `grid_wall_s`, counts the distinct runs that finished in them (`grid_runs`; runs found finished,
   "skipped", are counted apart) and sets `grid_sharded` when more than one call went in; no device. A record
   lists every call of its sweep name (`calls`: a chain of time-limited jobs on one runs root), and each call's
   wall counts; calls that ran side by side (two sweeps started together on one GPU, or one per GPU) count the
   time they shared once, from their start times.

Prints tables, then one JSON line (committed as experiments/bench/results/sweep_speed.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "experiments" / "bench" / "probe16.py"
# --grid: the sweep file and the environment variable that selects its full grid (or the tiny one)
GRIDS = {"zoology_fig2": ("ZOO_FIG2", ROOT / "experiments" / "zoology_fig2" / "sweep.py"),
         "based_frontier": ("ZOO_FRONTIER", ROOT / "experiments" / "based_frontier" / "sweep.py")}
BASELINE_PROBE_S = 115.0  # the 16-run probe on the landed code, one H200, 4 runs per GPU (issue 35)
TARGET_GRID_S = 30 * 60
# today's default against the best earlier setting (mps16: 100 s on the H200) and the packs, which since
# 2026-12-02 also compile: 4 packs of 4 lrs, side by side under MPS; graphed-pack captures each pack's whole
# step (forward, backward, AdamW) as a CUDA graph instead, with no compile warmup to pay; graphed-seed-pack packs
# each model's 2 seeds x 4 lrs as one pack of 8 (2 packs)
DEFAULT_VARIANTS = [
    "today||--workers 4 --mps off --order file",
    "mps16|train.precision=bf16|--workers 16 --mps auto",
    "mps16-compiled|train.compile=true|--workers 16 --mps auto",
    "compiled-pack|train.compile=true|--pack-lrs --workers 4 --mps auto",
    "graphed-pack|train.cuda_graph=true|--pack-lrs --workers 4 --mps auto",
    "graphed-seed-pack|train.cuda_graph=true|--pack-seeds --workers 2 --mps auto",
]


def variant_env(assignments: str) -> dict[str, str]:
    """A variant's environment field, 'NAME=VALUE NAME=VALUE' (e.g. ZOO_PROBE_BASED_IMPL=triton), as a dict."""
    out = {}
    for item in assignments.split():
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(f"sweep_speed: a variant's environment must be NAME=VALUE items, got {item!r}")
        out[name] = value
    return out


def run_probe(label: str, overrides: str, flags: str, env: dict[str, str], assignments: str = "") -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"probe16-{label}-"))
    cmd = [sys.executable, "-m", "zoo.sweep", str(PROBE), *overrides.split(), "--runs-root", str(root),
           *flags.split(), "--name", f"probe16-{label}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env | variant_env(assignments), cwd=ROOT)
    wall = time.perf_counter() - t0
    record_path = root / "_sweeps" / f"probe16-{label}.json"
    accuracies = {}
    job_s = train_s = 0.0  # summed over jobs: a pack of k runs is one job, so each member counts 1/k
    if record_path.exists():
        for r in json.loads(record_path.read_text())["runs"]:
            if r.get("run_dir") and r["status"] == "finished":
                # the name without its config hash: the hash covers the runs root and the setting's overrides
                accuracies[Path(r["run_dir"]).name.rsplit("-", 1)[0]] = r["valid/accuracy"]
                share = 1 / r.get("packed", 1)
                job_s += r.get("wall_s", 0.0) * share
                summary = ROOT / r["run_dir"] / "summary.json"  # run_dir may be absolute: then ROOT drops out
                if summary.exists():
                    train_s += json.loads(summary.read_text()).get("wall_time_s", 0.0) * share
    out = {"label": label, "overrides": overrides, "flags": flags, **({"env": assignments} if assignments else {}),
           "wall_s": wall, "rc": proc.returncode,
           "finished": len(accuracies), "valid_accuracy": accuracies,
           # where the wall goes: the jobs' own time (process start, data, compile, training, evaluation) and, of
           # it, the training loop's (the summaries' wall_time_s); jobs overlap when several run at once
           "jobs_s": job_s, "training_s": train_s}
    if proc.returncode != 0:
        out["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    # the sweep's line about MPS, without the progress bar that shares its line of stderr
    mps = [line[line.find("zoo-sweep"):] for line in proc.stderr.splitlines() if "MPS" in line and "zoo-sweep" in line]
    out["mps"] = mps[0] if mps else None
    return out


def grid_configs(tiny: bool, grid: str = "zoology_fig2") -> tuple[list[list[str]], dict[tuple, list[list[str]]]]:
    """The grid's runs and, per distinct config apart from the lr, its runs."""
    from zoo.sweep import load_sweep

    selector, path = GRIDS[grid]
    os.environ.setdefault(selector, "tiny" if tiny else "full")
    runs = load_sweep(path)
    groups: dict[tuple, list[list[str]]] = {}
    for run in runs:
        groups.setdefault(tuple(o for o in run if not o.startswith("optim.lr=")), []).append(run)
    return runs, groups


def shrink(run: list[str], examples: int) -> list[str]:
    """The run with a train split of `examples` examples per segment (the step's shapes are unchanged)."""
    return [re.sub(r"num_examples:\s*\d+", f"num_examples: {examples}", o) if o.startswith("data.train=") else o
            for o in run]


def time_step(run: list[str], steps: int, device: torch.device, compiled: bool = False,
              pack_lrs: list[float] | None = None, top: int = 0) -> dict:
    """One training step of `run`'s config, timed: plain, compiled (train.compile=true) or, with `pack_lrs`, as
    the vmapped pack of those lrs that `zoo-sweep --pack-lrs` trains (CUDA-graphed on CUDA, as with
    train.cuda_graph=true). The times are of the whole step, every member's included. Each config compiles in a
    clean cache, as a run does (`zoo.train.compile_scope`): one process timing config after config would otherwise
    fill dynamo's per-function cache and time the later configs eagerly. With `top` (on CUDA) the result also
    holds the step's `top` kernels by device time, ms per step weighted as `device_ms` is."""
    from zoo.train import compile_scope

    with compile_scope(compiled):
        return _time_step(run, steps, device, compiled, pack_lrs, top)


def _time_step(run: list[str], steps: int, device: torch.device, compiled: bool, pack_lrs: list[float] | None,
               top: int = 0) -> dict:
    from zoo.device import autocast
    from zoo.models import LanguageModel
    from zoo.steps import PackedStep, PlainStep, pack_members
    from zoo.train import load_config, load_split

    full, _ = load_config(run)
    steps_per_epoch = sum(math.ceil(s.num_examples / s.batch_size) for s in full.data.train)
    batch = max(s.batch_size for s in full.data.train)
    cfg, _ = load_config(shrink(run, batch) + [f"train.compile={str(compiled).lower()}", "data.cache=false"])
    torch.manual_seed(0)
    segments = load_split(cfg, "train", device)
    model = LanguageModel(cfg.model).to(device)
    if pack_lrs:
        strategy = PackedStep(model, pack_members(cfg, pack_lrs), 10_000, device, graph=device.type == "cuda")
        seg = segments[0]
        strategy.check((seg.inputs[:8], seg.query_pos[:8], seg.query_labels[:8]))
    else:
        strategy = PlainStep(model, cfg, 10_000, autocast(device, cfg.train.precision))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # every train segment's step (its own L and batch), weighted by the steps it takes an epoch
    weights = [math.ceil(s.num_examples / s.batch_size) / steps_per_epoch for s in full.data.train]
    wall_ms = device_ms = warm_s = 0.0
    kernels: dict[str, list[float]] = {}  # name -> [ms per step (weighted), calls per step]
    for seg, w in zip(segments, weights):
        idx = torch.arange(min(seg.batch_size, len(seg)), device=device)
        t = time.perf_counter()
        for _ in range(3):
            strategy.step(seg, idx, 0)
        sync()
        warm_s += time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(steps):
            strategy.step(seg, idx, 0)
        sync()
        seg_wall = (time.perf_counter() - t) / steps * 1e3
        seg_device = seg_wall
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    strategy.step(seg, idx, 0)
                sync()
            events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
            seg_device = sum(e.self_device_time_total for e in events) / 1e3 / 3
            for e in events:
                k = kernels.setdefault(e.key, [0.0, 0.0])
                k[0] += w * e.self_device_time_total / 1e3 / 3
                k[1] += w * e.count / 3
        wall_ms += w * seg_wall
        device_ms += w * seg_device
    gflop = example_gflop(cfg, segments, device) if not (compiled or pack_lrs) else math.nan
    out = {"wall_ms": wall_ms, "device_ms": device_ms, "warmup_s": warm_s, "steps_per_epoch": steps_per_epoch,
           "epochs": full.train.epochs, "mixer": "+".join(dict.fromkeys(full.model.layers())),
           "d_model": full.model.d_model, "seq_len": max(s.seq_len for s in full.data.train),
           "gflop_per_example": gflop,
           "epoch_tflop": gflop * sum(s.num_examples for s in full.data.train) / 1e3}
    if top and device.type == "cuda":
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
        out["top_kernels"] = [{"kernel": name, "ms": ms, "calls": calls} for name, (ms, calls) in ranked]
    return out


def example_gflop(cfg, segments, device: torch.device, examples: int = 8) -> float:
    """GFLOP of one training example's forward and backward (the loss at its queries), as torch's FlopCounterMode
    counts them (matmuls, convolutions, SDPA; a Triton kernel it cannot see counts 0), averaged over the train
    segments in proportion to their examples. Counted on a fresh model with `examples` examples per segment."""
    from torch.utils.flop_counter import FlopCounterMode

    from zoo.eval import query_loss
    from zoo.models import LanguageModel

    model = LanguageModel(cfg.model).to(device)
    total = sum(s.num_examples for s in cfg.data.train)
    gflop = 0.0
    for seg, spec in zip(segments, cfg.data.train):
        n = min(examples, len(seg))
        counter = FlopCounterMode(display=False)
        with counter:
            query_loss(model, seg.inputs[:n], seg.query_pos[:n], seg.query_labels[:n]).backward()
        gflop += counter.get_total_flops() / n / 1e9 * spec.num_examples / total
    return gflop


def gemm_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """Measured bf16 GEMM rate of the device (TFLOP/s): the FLOP floor's yardstick."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def flop_floor(rows: list[dict], tflops: float) -> float:
    """Seconds the grid's FLOPs take at `tflops`, every run at its full `train.epochs`: the time no scheduling
    or fusion can beat without early stopping (runs x epochs x an epoch's TFLOP / rate)."""
    return sum(r["runs"] * r["epochs"] * r["epoch_tflop"] for r in rows) / tflops


def print_kernels(label: str, timed: dict) -> None:
    """The `top_kernels` of one timed step, under a header naming the step."""
    print(f"   {label}: {timed['device_ms']:.3f} ms device per step; top kernels:")
    for k in timed.get("top_kernels", []):
        share = k["ms"] / timed["device_ms"] if timed["device_ms"] else math.nan
        print(f"   {k['ms']:8.3f} ms {share:6.1%} x{k['calls']:<6.1f} {k['kernel'][:96]}")


STEP_KINDS = {"device_ms": "eager", "compiled_device_ms": "compiled", "packed_device_ms": "pack",
              "packed_compiled_device_ms": "compiled pack"}


def step_costs(row: dict) -> dict[str, float]:
    """{step kind: the device time one run costs per step} for the steps timed (a pack's step divided among its
    members)."""
    return {kind: row[k] / (row["pack_size"] if "pack" in kind else 1) for k, kind in STEP_KINDS.items() if k in row}


def run_step_ms(row: dict) -> float:
    """The device time one run costs per step: the cheapest of its plain, compiled and packed steps."""
    return min(step_costs(row).values())


def cheapest_step(row: dict) -> str:
    """Which step `run_step_ms` took: whether this config should pack (`zoo-sweep --pack-max-d`) and compile."""
    costs = step_costs(row)
    return min(costs, key=costs.get)


def run_key(summary: dict) -> tuple[str, int, int]:
    """(mixer, L, d_model) of a finished run's summary, as `time_step` names a config."""
    return "+".join(dict.fromkeys(summary["layers"])), summary["state_bytes_seq_len"], summary["d_model"]


def upper_estimate(rows: list[dict]) -> float:
    """Every run of a config charged its config's epoch time x the full train.epochs (no early stop)."""
    return sum(r["epoch_s"] * r["epochs"] * r["runs"] for r in rows)


def measured_estimate(rows: list[dict], summary_dirs: list[str]) -> dict:
    """The grid estimate with early stop as measured: each config's runs are charged the epochs its finished runs
    took (their mean for the unfinished ones), or the full train.epochs where none finished."""
    epochs: dict[tuple, list[int]] = {}
    for directory in summary_dirs:
        for path in sorted(Path(directory).glob("*.json")):
            summary = json.loads(path.read_text())
            epochs.setdefault(run_key(summary), []).append(summary["epochs"])
    total, finished, by_mixer = 0.0, 0, {}
    for r in rows:
        if "error" in r:
            continue
        done = epochs.get((r["mixer"], r["seq_len"], r["d_model"]), [])[: r["runs"]]
        rest = sum(done) / len(done) if done else r["epochs"]
        seconds = r["epoch_s"] * (sum(done) + (r["runs"] - len(done)) * rest)
        total += seconds
        finished += len(done)
        by_mixer[r["mixer"]] = by_mixer.get(r["mixer"], 0.0) + seconds
    return {"grid_estimate_measured_s": total, "grid_estimate_measured_runs": finished,
            "grid_estimate_measured_by_mixer_s": by_mixer}


def print_measured(est: dict, upper: float | None) -> None:
    print(f"\ngrid estimate with the measured epochs of {est['grid_estimate_measured_runs']} finished runs: "
          f"{est['grid_estimate_measured_s']:.0f} s" + (f" (upper bound {upper:.0f} s)" if upper else ""))
    for mixer, seconds in sorted(est["grid_estimate_measured_by_mixer_s"].items(), key=lambda kv: -kv[1]):
        print(f"  {mixer:28s} {seconds:10.0f} s")


def sweep_records(paths: list[str]) -> list[Path]:
    """The sweep record files under `paths`: a .json file itself; a directory's `_sweeps/*.json` when it has a
    `_sweeps/` folder (a runs root), else its own `*.json` (a `_sweeps/` folder or a folder of kept records)."""
    found: dict[Path, None] = {}
    for p in map(Path, paths):
        if p.is_file():
            found[p.resolve()] = None
        elif p.is_dir():
            directory = p / "_sweeps" if (p / "_sweeps").is_dir() else p
            found.update(dict.fromkeys(sorted(q.resolve() for q in directory.glob("*.json"))))
        else:
            raise SystemExit(f"sweep_speed: --grid-from {p}: no such file or directory")
    return list(found)


# a run's best state over the records: finished beats skipped (finished earlier) beats failed beats pending
STATUS_RANK = {"finished": 3, "skipped": 2, "failed": 1, "pending": 0}


def calls_wall(calls: list[dict]) -> float:
    """The wall time the calls took together: the length of the union of their [started, started + wall_s], so
    calls that ran side by side (records of sweeps started together on one machine, or one per GPU) count their
    shared time once and a chain of calls counts each; a call without a start time adds its whole wall."""
    spans, undated = [], 0.0
    for c in calls:
        try:
            start = datetime.fromisoformat(c["started"]).timestamp()
        except (KeyError, TypeError, ValueError):
            undated += c["wall_s"]
            continue
        spans.append((start, start + c["wall_s"]))
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total + undated


def grid_from_records(paths: list[Path]) -> dict:
    """The grid's wall and runs from zoo-sweep records (`zoo.sweep.SweepRecord` writes them: {"sweep", "runs":
    [{"overrides", "run_dir", "status", ...}], "wall_s", "calls": [{"started", "wall_s", ...}], ...}): the wall
    of every record's calls together (`calls_wall`: a record without `calls` is one undated call of `wall_s`),
    runs counted once each, by run dir (by overrides where a run has none), at their best status over the
    records (a record's runs are as its last call left them)."""
    rows, best, every_call = [], {}, []
    for path in paths:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "runs" not in record or "wall_s" not in record:
            raise SystemExit(f"sweep_speed: {path} is not a zoo-sweep record (no runs and wall_s)")
        counts = dict.fromkeys(STATUS_RANK, 0)
        for run in record["runs"]:
            counts[run["status"]] += 1
            key = run.get("run_dir") or " ".join(run["overrides"])
            if STATUS_RANK[run["status"]] >= STATUS_RANK[best.get(key, "pending")]:
                best[key] = run["status"]
        calls = record.get("calls") or [{"wall_s": record["wall_s"]}]
        every_call += calls
        rows.append({"record": path.name, "sweep": record.get("sweep", path.stem),
                     "wall_s": calls_wall(calls), "calls": len(calls), **counts})
    status = {s: sum(v == s for v in best.values()) for s in STATUS_RANK}
    return {"grid_wall_s": calls_wall(every_call), "grid_runs": status["finished"],
            "grid_sharded": sum(r["calls"] for r in rows) > 1, "grid_runs_listed": len(best),
            "grid_runs_skipped": status["skipped"],
            "grid_runs_failed": status["failed"], "grid_runs_pending": status["pending"], "grid_records": rows}


def print_grid(out: dict) -> None:
    print(f"{'sweep record':44s} {'calls':>5s} {'wall s':>9s} {'finished':>8s} {'skipped':>8s} {'failed':>7s} "
          f"{'pending':>8s}")
    for r in out["grid_records"]:
        print(f"{r['record'][:44]:44s} {r['calls']:5d} {r['wall_s']:9.1f} {r['finished']:8d} {r['skipped']:8d} "
              f"{r['failed']:7d} {r['pending']:8d}")
    print(f"{'grid (distinct runs)':44s} {'':5s} {out['grid_wall_s']:9.1f} {out['grid_runs']:8d} "
          f"{out['grid_runs_skipped']:8d} {out['grid_runs_failed']:7d} {out['grid_runs_pending']:8d}"
          f"   sharded: {str(out['grid_sharded']).lower()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                   help="probe settings as 'label|overrides|zoo-sweep flags|NAME=VALUE ...' (the last, the "
                   "environment of that setting's zoo-sweep, is optional)")
    p.add_argument("--skip-probe", action="store_true")
    p.add_argument("--skip-configs", action="store_true")
    p.add_argument("--compiled", action="store_true", help="also time each grid config's compiled step")
    p.add_argument("--packed", action="store_true",
                   help="also time each grid config's 4 lrs as one vmapped, CUDA-graphed pack (zoo-sweep --pack-lrs)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=0,
                   help="CUDA: print each config's N costliest kernels per step (of its last timed variant)")
    p.add_argument("--tiny", action="store_true", help="the grid's tiny form (ZOO_FIG2=tiny), for a CPU smoke run")
    p.add_argument("--grid", choices=sorted(GRIDS), default="zoology_fig2",
                   help="the sweep whose configs are timed (based_frontier: the Based Fig. 2 grid)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-configs", type=int, default=0, help="time only the first N configs (0: all)")
    p.add_argument("--epochs-from", nargs="*", default=[], metavar="DIR",
                   help="finished runs' summaries: also estimate the grid with their measured epochs")
    p.add_argument("--from-json", metavar="FILE", help="recompute the estimates from this bench's JSON (no device)")
    p.add_argument("--grid-from", nargs="+", default=[], metavar="PATH",
                   help="runs roots, _sweeps/ folders or zoo-sweep record files: sum them into grid_wall_s, "
                   "grid_runs and grid_sharded (no device)")
    args = p.parse_args()
    if args.grid_from:
        out = grid_from_records(sweep_records(args.grid_from))
        print_grid(out)
        print(json.dumps(out))
        return
    if args.from_json:
        if not Path(args.from_json).is_file():
            raise SystemExit(f"sweep_speed: --from-json {args.from_json}: no such file")
        out = json.loads(Path(args.from_json).read_text().strip().splitlines()[-1])
        out["grid_estimate_s"] = upper_estimate(out["configs"])
        if args.epochs_from:
            out |= measured_estimate(out["configs"], args.epochs_from)
            print_measured(out, out.get("grid_estimate_s"))
        print(json.dumps(out))
        return
    device = torch.device(args.device)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.tiny:
        env["ZOO_PROBE_EPOCHS"] = "1"
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__}

    if not args.skip_probe:
        probes = []
        for v in args.variants:
            label, overrides, flags, assignments = (v.split("|") + ["", "", ""])[:4]
            probes.append(run_probe(label, overrides, flags, env, assignments))
        print(f"{'probe setting':24s} {'wall s':>8s} {'finished':>8s} {'jobs s':>8s} {'training s':>10s}  mps")
        for r in probes:
            print(f"{r['label']:24s} {r['wall_s']:8.1f} {r['finished']:8d} {r['jobs_s']:8.1f} {r['training_s']:10.1f}"
                  f"  {r['mps']}")
            if r["rc"]:
                print("   error:", " | ".join(r.get("error", [])))
        out["probes"] = probes
        base = next((r for r in probes if r["label"] == "today" and r["finished"] == 16), None)
        best = min((r for r in probes if r["finished"] == 16), key=lambda r: r["wall_s"], default=None)
        if best is not None:
            out["probe16_wall_s"] = best["wall_s"]
            out["probe16_setting"] = best["label"]
        if base is not None and best is not None:
            out["probe16_today_s"] = base["wall_s"]
            out["probe16_speedup"] = base["wall_s"] / best["wall_s"]
            for r in probes:
                diffs = [abs(r["valid_accuracy"][k] - v) for k, v in base["valid_accuracy"].items()
                         if k in r["valid_accuracy"]]
                r["max_valid_accuracy_diff_vs_today"] = max(diffs, default=None)

    if not args.skip_configs:
        runs, groups = grid_configs(args.tiny, args.grid)
        rows = []
        keys = list(groups)[: args.max_configs or None]
        print(f"\n{'mixer':28s} {'L':>5s} {'d':>5s} {'ms/step':>9s} {'device ms':>9s}"
              + (f" {'compiled':>9s} {'c device':>9s}" if args.compiled else "")
              + (f" {'packed':>9s} {'p device':>9s}" if args.packed else "")
              + (f" {'cp device':>9s}" if args.packed and args.compiled else "")
              + f" {'epoch s':>8s} {'TFLOP/s':>8s}  cheapest")
        for key in keys:
            run = groups[key][0]
            try:
                row = time_step(run, args.steps, device, top=args.top)
                last = ("eager", row)
                if args.compiled:
                    c = time_step(run, args.steps, device, compiled=True, top=args.top)
                    last = ("compiled", c)
                    row |= {"compiled_wall_ms": c["wall_ms"], "compiled_device_ms": c["device_ms"],
                            "compile_s": c["warmup_s"]}
                if args.packed:
                    from zoo.steps import PackError

                    lrs = [float(o.split("=", 1)[1]) for r in groups[key] for o in r if o.startswith("optim.lr=")]
                    try:
                        c = time_step(run, args.steps, device, pack_lrs=lrs, top=args.top)
                        last = (f"pack of {len(lrs)}", c)
                        row |= {"packed_wall_ms": c["wall_ms"], "packed_device_ms": c["device_ms"],
                                "pack_size": len(lrs)}
                        if args.compiled:
                            c = time_step(run, args.steps, device, compiled=True, pack_lrs=lrs, top=args.top)
                            last = (f"compiled pack of {len(lrs)}", c)
                            row |= {"packed_compiled_wall_ms": c["wall_ms"],
                                    "packed_compiled_device_ms": c["device_ms"]}
                    except PackError as e:  # zoo-sweep trains such a group unpacked: so does the estimate
                        row["packed_error"] = str(e)
            except Exception as e:  # a config that fails is reported and the others go on
                print(f"{' '.join(run)[:60]}: failed: {type(e).__name__}: {str(e)[:120]}")
                rows.append({"overrides": run, "error": f"{type(e).__name__}: {e}"})
                continue
            row["epoch_s"] = run_step_ms(row) * row["steps_per_epoch"] / 1e3
            row["cheapest_step"] = cheapest_step(row)
            row["achieved_tflops"] = row["epoch_tflop"] / row["epoch_s"]  # at the run's cheapest step
            row["runs"] = len(groups[key])
            rows.append(row)
            print(f"{row['mixer']:28s} {row['seq_len']:5d} {row['d_model']:5d} {row['wall_ms']:9.3f} "
                  f"{row['device_ms']:9.3f}"
                  + (f" {row['compiled_wall_ms']:9.3f} {row['compiled_device_ms']:9.3f}" if args.compiled else "")
                  + (f" {row.get('packed_wall_ms', math.nan):9.3f} {row.get('packed_device_ms', math.nan):9.3f}"
                     if args.packed else "")
                  + (f" {row.get('packed_compiled_device_ms', math.nan):9.3f}" if args.packed and args.compiled
                     else "")
                  + f" {row['epoch_s']:8.2f} {row['achieved_tflops']:8.1f}  {row['cheapest_step']}")
            if args.top and "top_kernels" in last[1]:
                print_kernels(last[0], last[1])
                row["top_kernels"] = {"step": last[0], "device_ms": last[1]["device_ms"],
                                      "kernels": last[1]["top_kernels"]}
        out["configs"] = rows
        ok = [r for r in rows if "error" not in r]
        if ok and len(ok) == len(groups):
            total = upper_estimate(ok)
            out["grid_estimate_s"] = total
            out["grid_estimate_epochs"] = "full train.epochs (upper bound)"
            out["grid_runs_planned"] = len(runs)
            print(f"\ngrid estimate: {total:.0f} s for {len(runs)} runs on one device "
                  f"(target {TARGET_GRID_S} s; epochs: {out['grid_estimate_epochs']})")
            if args.epochs_from:
                out |= measured_estimate(ok, args.epochs_from)
                print_measured(out, total)
            if device.type == "cuda":
                out["gemm_tflops"] = gemm_tflops(device)
                out["grid_flop_floor_s"] = flop_floor(ok, out["gemm_tflops"])
                pflop = sum(r["runs"] * r["epochs"] * r["epoch_tflop"] for r in ok) / 1e3
                print(f"FLOP floor: {out['grid_flop_floor_s']:.0f} s ({pflop:.0f} PFLOP at full epochs, at the "
                      f"measured bf16 GEMM rate of {out['gemm_tflops']:.0f} TFLOP/s)")
        else:
            print(f"\nno grid estimate: {len(groups) - len(ok)} of {len(groups)} configs were not timed")
    out["baseline_probe16_s_landed"] = BASELINE_PROBE_S
    print(json.dumps(out))


if __name__ == "__main__":
    main()
