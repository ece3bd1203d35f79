"""Benchmark: wall-clock per run of the Zoology Fig. 2 reference config, and the whole grid extrapolated.

    python experiments/bench/sweep_speed.py               # L=256, n=16, d_model=128, 100k examples/epoch
    python experiments/bench/sweep_speed.py --tiny        # CPU-sized: L=64, n=4, d_model=32, 2k examples
    python experiments/bench/sweep_speed.py --no-pack     # skip the packed-vs-separate measurement
    python experiments/bench/sweep_speed.py --cuda-graph  # also train.cuda_graph=true, single and packed (GPU)

For Based (BaseConv + Based, f=8) and attention it measures, in this process: MQAR generation of one
epoch's examples (no cache), and `zoo.train.train` for `--epochs` epochs (early stop off) — the epoch time
is the training wall time over the epochs, evaluation included. A run of the grid costs generation plus up
to 64 epochs (early stop at 0.99 cuts most runs short; the worst case is reported). The grid figure assumes
336 such runs executed one after another; `zoo-sweep` runs several per GPU, so divide by the concurrency
measured there.

Packing (zoo/packed.py, `zoo-sweep --pack-lrs`): for each mixer it also trains the 4 learning rates of a grid
point one after another (`zoo.train.train`, 4 runs) and as one pack (`zoo.packed.train_packed`), same shape,
same process, and reports the ratio of wall times (training loop with its evaluations; and whole calls,
where the pack also generates its data once instead of 4 times).

Baseline (quoted, not run here: docs/REFERENCE.md §1, one H200): Zoology takes 9–10 s per epoch of this
config plus ≈20 s of data generation per run, ≈20–37 GPU-hours for the grid. Target: the grid in ≤ 30 min.
A second measurement times one training step at a shape with almost no compute, where the host's dispatch
cost dominates as kernel launches do for tiny models on a GPU: 4 steps of one run vs one step of a pack of 4.
Prints tables, then one JSON line.
"""

import argparse
import json
import tempfile
import time

import torch

from zoo.packed import pack_members, train_packed
from zoo.synthetics import MQARConfig, generate_mqar
from zoo.train import load_config, train

GRID_RUNS = 336
MAX_EPOCHS = 64
ZOOLOGY_EPOCH_S = (9.0, 10.0)
ZOOLOGY_GEN_S = 20.0
TARGET_GRID_S = 30 * 60
GRID_LRS = [1e-4, 4.642e-4, 2.154e-3, 1e-2]  # logspace(-4, -2, 4), as in experiments/zoology_fig2/sweep.py


def bench_overrides(
    mixer: str, L: int, n: int, d: int, examples: int, batch: int, epochs: int, root: str, compile: bool = False,
    based_impl: str = "naive", cuda_graph: bool = False,
) -> list[str]:
    def seg(count: int) -> str:
        return f"{{seq_len:{L},num_kv_pairs:{n},num_examples:{count},batch_size:{batch}}}"

    overrides = [
        f"model={mixer}",
        f"model.d_model={d}",
        "data.vocab_size=8192",
        "data.cache=false",
        f"data.train=[{seg(examples)}]",
        f"data.valid=[{seg(1000)}]",
        f"data.test=[{seg(1000)}]",
        f"train.epochs={epochs}",
        "train.early_stop=null",
        "train.progress=false",
        "optim.warmup_frac=0.0",
        f"runs_root={root}",
        f"experiment_name=bench_{mixer}{'_compiled' if compile else ''}{'_graphed' if cuda_graph else ''}",
        f"train.compile={str(compile).lower()}",
        f"train.cuda_graph={str(cuda_graph).lower()}",
    ]
    if mixer == "based":
        overrides.append("model.mixers.based.feature_dim=8")
        if based_impl != "naive":  # packs need naive
            overrides.append(f"+model.mixers.based.impl={based_impl}")
    return overrides


def measure(
    mixer: str, L: int, n: int, d: int, examples: int, batch: int, epochs: int, root: str, compile: bool = False,
    based_impl: str = "naive", cuda_graph: bool = False,
) -> dict:
    cfg, resolved = load_config(
        bench_overrides(mixer, L, n, d, examples, batch, epochs, root, compile, based_impl, cuda_graph)
    )
    t0 = time.perf_counter()
    generate_mqar(MQARConfig(vocab_size=8192, seq_len=L, num_kv_pairs=n, num_examples=examples), seed=0)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    summary = train(cfg, resolved)
    total_s = time.perf_counter() - t0
    epoch_s = summary["wall_time_s"] / epochs
    return {
        "mixer": mixer + (" (compiled)" if compile else "") + (" (graphed)" if cuda_graph else ""),
        "gen_s": gen_s,
        "epoch_s": epoch_s,
        "run_total_s": total_s,
        "tokens_per_s": summary["train_tokens_per_s"],
        "worst_run_s": gen_s + MAX_EPOCHS * epoch_s,
        "device": summary["device"],
    }


def measure_pack(
    mixer: str, L: int, n: int, d: int, examples: int, batch: int, epochs: int, root: str, cuda_graph: bool = False
) -> dict:
    """The 4 learning rates of one grid point: 4 `train` calls one after another vs one `train_packed` call
    (with `cuda_graph`, also the pack with its step captured as a CUDA graph)."""
    base = bench_overrides(mixer, L, n, d, examples, batch, epochs, root)
    separate_train_s, t0 = 0.0, time.perf_counter()
    for lr in GRID_LRS:
        cfg, resolved = load_config(base + [f"optim.lr={lr}", f"experiment_name=bench_{mixer}_separate"])
        separate_train_s += train(cfg, resolved)["wall_time_s"]
    separate_s = time.perf_counter() - t0
    cfg, _ = load_config(base + [f"experiment_name=bench_{mixer}_packed"])
    t0 = time.perf_counter()
    summaries = train_packed(pack_members(cfg, GRID_LRS))
    packed_s = time.perf_counter() - t0
    packed_train_s = max(s["wall_time_s"] for s in summaries)
    graphed = {}
    if cuda_graph:
        cfg, _ = load_config(base + [f"experiment_name=bench_{mixer}_packed_graphed", "train.cuda_graph=true"])
        t0 = time.perf_counter()
        summaries = train_packed(pack_members(cfg, GRID_LRS))
        graphed_s = time.perf_counter() - t0
        graphed_train_s = max(s["wall_time_s"] for s in summaries)
        graphed = {
            "graphed_train_s": graphed_train_s,
            "graphed_total_s": graphed_s,
            "graphed_train_speedup": separate_train_s / graphed_train_s,
            "graphed_epoch_s": graphed_train_s / epochs,
        }
    return {
        "mixer": mixer,
        "lrs": GRID_LRS,
        "separate_train_s": separate_train_s,
        "packed_train_s": packed_train_s,
        "train_speedup": separate_train_s / packed_train_s,
        "separate_total_s": separate_s,
        "packed_total_s": packed_s,
        "total_speedup": separate_s / packed_s,
        "packed_epoch_s": packed_train_s / epochs,
        **graphed,
    }


def step_overhead(mixer: str, steps: int = 30) -> dict:
    """Per-step time of one run vs a pack of 4 at a shape with almost no compute (d=16, L=16, batch 2, V=64).

    There the host's dispatch cost dominates, as kernel launches dominate tiny models on a GPU: the ratio is a
    CPU proxy for what packing saves where a step is launch-bound, not a GPU measurement.
    """
    from zoo.eval import query_loss
    from zoo.models import LanguageModel
    from zoo.packed import _Pack
    from zoo.train import build_optimizer

    seg = "[{seq_len:16,num_kv_pairs:2,num_examples:64}]"
    cfg, _ = load_config(
        [f"model={mixer}", "model.d_model=16", "data.vocab_size=64"]
        + [f"data.{split}={seg}" for split in ("train", "valid", "test")]
    )
    model = LanguageModel(cfg.model)
    optimizer = build_optimizer(model, cfg)
    pack = _Pack(model, GRID_LRS, cfg.optim, total_steps=steps)
    batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 16, (2, 2)), torch.randint(0, 64, (2, 2)))

    def one() -> None:
        loss = query_loss(model, *batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def packed() -> None:
        pack.flat.grad = None
        pack.losses(*batch).sum().backward()
        pack.adamw_step(1.0, 1)

    best = {}
    for _ in range(3):
        for fn in (one, packed):
            fn()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            best[fn.__name__] = min(best.get(fn.__name__, float("inf")), (time.perf_counter() - t0) / steps)
    return {
        "mixer": mixer,
        "one_step_ms": 1e3 * best["one"],
        "pack_step_ms": 1e3 * best["packed"],
        "speedup": len(GRID_LRS) * best["one"] / best["packed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized config")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also measure each mixer with train.compile=true")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also measure train.cuda_graph=true (the step as a CUDA graph), single and packed")
    parser.add_argument("--no-pack", action="store_true", help="skip packed (4 lrs) vs 4 separate runs")
    parser.add_argument("--mixers", default="based,attention", help="comma-separated: based, attention")
    parser.add_argument("--based-impl", default="naive", choices=["naive", "triton"],
                        help="Based's path (triton: the chunk kernels, CUDA only; packs need naive, so use --no-pack)")
    args = parser.parse_args()
    if args.tiny:
        shape = dict(L=64, n=4, d=32, examples=2000, batch=64)
    else:
        shape = dict(L=256, n=16, d=128, examples=100_000, batch=256)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        mixers = args.mixers.split(",")
        variants = [(False, False)] + [(True, False)] * args.compile + [(False, True)] * args.cuda_graph
        for compile, graph in variants:
            for mixer in mixers:
                rows.append(measure(mixer, **shape, epochs=args.epochs, root=root, compile=compile,
                                    based_impl=args.based_impl, cuda_graph=graph))
                print(f"measured: {json.dumps(rows[-1])}", flush=True)  # kept if a time limit cuts the run
        packs = []
        for m in [] if args.no_pack else mixers:
            packs.append(measure_pack(m, **shape, epochs=args.epochs, root=root, cuda_graph=args.cuda_graph))
            print(f"measured: {json.dumps(packs[-1])}", flush=True)
    print(f"config: {shape}, epochs measured: {args.epochs}, device: {rows[0]['device']}")
    print(f"{'mixer':21s} {'gen s':>8s} {'epoch s':>9s} {'tok/s':>12s} {'worst run s':>12s} {'vs Zoology epoch':>17s}")
    for r in rows:
        # Against Zoology's H200 epoch only for the reference shape; a --tiny epoch is a different workload.
        speedup = float("nan") if args.tiny else sum(ZOOLOGY_EPOCH_S) / 2 / r["epoch_s"]
        r["epoch_speedup_vs_zoology"] = None if args.tiny else speedup
        print(
            f"{r['mixer']:21s} {r['gen_s']:8.2f} {r['epoch_s']:9.2f} {r['tokens_per_s']:12.0f} "
            f"{r['worst_run_s']:12.1f} {speedup:16.2f}x"
        )
    eager = [r for r in rows if "(" not in r["mixer"]]
    fastest = min(
        (eager, [r for r in rows if "compiled" in r["mixer"]], [r for r in rows if "graphed" in r["mixer"]]),
        key=lambda rs: sum(r["worst_run_s"] for r in rs) if rs else float("inf"),
    )
    mean_worst = sum(r["worst_run_s"] for r in fastest) / len(fastest)
    grid_worst_s = GRID_RUNS * mean_worst
    result = {
        "bench": "sweep_speed",
        "tiny": args.tiny,
        "shape": shape,
        "epochs_measured": args.epochs,
        "device": rows[0]["device"],
        "runs": rows,
        "grid_serial_worst_case_s": grid_worst_s,
        "zoology_grid_gpu_hours_quoted": [20, 37],
        "target_grid_s": TARGET_GRID_S,
        "note": "grid = 336 runs x (generation + 64 epochs), serial, worst case (no early stop), mean of based and "
        "attention; Zoology figures are quoted from docs/REFERENCE.md, not measured here"
        + ("; --tiny shape, not the reference config" if args.tiny else ""),
    }
    print(f"grid, serial, worst case: {grid_worst_s / 3600:.2f} h (target {TARGET_GRID_S / 60:.0f} min on one H200)")
    if packs:
        print(f"\n4 lrs {GRID_LRS}: 4 separate runs vs one pack (train = training loop with its evaluations)")
        head = ("separate s", 11), ("packed s", 9), ("train x", 8), ("total s", 8), ("packed s", 9), ("total x", 8)
        print(f"{'mixer':10s} " + " ".join(f"{h:>{w}s}" for h, w in head))
        for p in packs:
            print(
                f"{p['mixer']:10s} {p['separate_train_s']:11.2f} {p['packed_train_s']:9.2f} {p['train_speedup']:7.2f}x "
                f"{p['separate_total_s']:8.2f} {p['packed_total_s']:9.2f} {p['total_speedup']:7.2f}x"
            )
        gen = {r["mixer"]: r["gen_s"] for r in eager}
        packed_worst = [
            gen[p["mixer"]] + MAX_EPOCHS * min(p["packed_epoch_s"], p.get("graphed_epoch_s", float("inf")))
            for p in packs
        ]
        for p in packs:
            if "graphed_train_s" in p:
                print(
                    f"{p['mixer']:10s} pack as a CUDA graph: train {p['graphed_train_s']:.2f} s "
                    f"({p['graphed_train_speedup']:.2f}x the 4 separate runs)"
                )
        overhead = [step_overhead(m) for m in ("based", "attention")]
        print("launch-bound proxy (d=16, L=16, batch 2): 4 steps of one run vs one step of a pack of 4")
        for o in overhead:
            print(f"{o['mixer']:10s} {o['one_step_ms']:7.2f} ms x4 vs {o['pack_step_ms']:7.2f} ms: {o['speedup']:.2f}x")
        result["packed"] = packs
        result["packed_step_overhead"] = overhead
        result["grid_serial_worst_case_packed_s"] = GRID_RUNS / len(GRID_LRS) * sum(packed_worst) / len(packed_worst)
        print(f"grid, serial, worst case, packed by lr: {result['grid_serial_worst_case_packed_s'] / 3600:.2f} h")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
