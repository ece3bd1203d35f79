"""Benchmark: Based linear attention kernels against FLA's Based kernels and causal SDPA, on one CUDA GPU.

    python experiments/bench/based_kernels.py [--sweep] [--T 1024 2048 4096 8192 16384] [--dtype bf16]

Shape B=8, H=16, K=16, V=64, bf16 (SDPA: head dim 64). Median times over CUDA events after warm-up
(triton.testing.do_bench, which also flushes L2 between runs), forward and forward+backward, and the decode
step at B ∈ {1, 64, 256} (a CUDA graph of 16 steps, time per step). Ceilings are measured in the same process:
copy bandwidth (device-to-device copy, bytes read + written) and bf16 GEMM rate (8192³, random data). Each row
reports the fraction of both ceilings it reaches, counting the minimum bytes (inputs read once, outputs written
once) and the FLOPs of kernels/based/README.md. The last line is JSON. --dtype fp16 or fp32 runs every row, the
GEMM ceiling and the decode step in that dtype instead (fp32 GEMM: PyTorch's default fp32 matmul, no tf32).

--sweep first times order-2 modes (5, 6) x block configurations of our kernel at T=4096 (each checked against
the default) and uses the fastest mode and configuration per pass.
--split-sweep times the split forward and backward (kernels/based/split.py) over their launch settings at T=4096
(the forward's two kernels apart too; each setting in its own process), each checked against the fused kernels, and
adds the rows `ours_split` (split forward and backward at the fastest forward's settings) and `ours_split_bwd` (the
fused forward with the split backward at the fastest forward+backward's settings).
--tuned FILE sets our kernel's order-2 modes and block configurations from a JSON file
{"fwd": {"mode": m, "cfg": [BK, BV, BC, warps, stages]}, "fb": {...}} (the forward from "fwd", the backward from
"fb"), as a tuning run writes it; the table then times `ours` with them.
`ours_batched_o2` is our kernel with `chunk.FWD_EXPAND = chunk.BWD_EXPAND = 2`; its outputs (with and without a
gradient following) and gradients are checked against `ours` before they are timed. `ours_graphed` is `ours` captured
in CUDA graphs and timed by replay (the GPU's time without the host's launch overhead, which the eager rows include).
"""

import argparse
import contextlib
import json
import math

import torch
import torch.nn.functional as F
import triton

import kernels.based.chunk as chunk_mod
from kernels.based import chunk_based, feature_dim, fused_recurrent_based

B, H, K, V, SDPA_D = 8, 16, 16, 64, 64
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DT = torch.bfloat16  # --dtype
E = feature_dim(K)


def bench(fn, grad_to_none=None):
    return triton.testing.do_bench(fn, warmup=50, rep=200, grad_to_none=grad_to_none, return_mode="median")


def copy_bandwidth():
    x = torch.randn(2**28, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / (ms * 1e-3)


def gemm_rate():
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=DT) for _ in range(2))
    ms = bench(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3)


def based_flops(T, C=64):
    """Forward: state query and update over E features (4·E·V per token) plus the chunk tile (2·C·(K+V))."""
    return B * H * T * (4 * E * V + 2 * C * (K + V))


def based_bytes(T, backward):
    qk, vo = B * T * H * K * DT.itemsize, B * T * H * V * DT.itemsize
    fwd = 2 * qk + 2 * vo  # q, k, v read; o written
    return fwd + (4 * qk + 4 * vo if backward else 0)  # + q, k, v, o, dO read; dq, dk, dv written


def sdpa_flops(T):
    return 4 * B * H * T * T * SDPA_D / 2


def inputs(T, d_qk=K, d_v=V, layout="bthd"):
    g = torch.Generator(device="cuda").manual_seed(T)
    shape = (B, T, H) if layout == "bthd" else (B, H, T)
    q = torch.randn(*shape, d_qk, device="cuda", dtype=DT, generator=g).requires_grad_()
    k = torch.randn(*shape, d_qk, device="cuda", dtype=DT, generator=g).requires_grad_()
    v = torch.randn(*shape, d_v, device="cuda", dtype=DT, generator=g).requires_grad_()
    do = torch.randn(*shape, d_v, device="cuda", dtype=DT, generator=g)
    return q, k, v, do


# Rows that run our kernels with other chunk.py settings, each checked against `ours` before it is timed:
# order-2 terms by batched dots over the first index, no 0/1 expansion matrices. (Session 14 removed
# `ours_fwd_prefetch`, the fused forward loading a chunk ahead: 0.490 ms against 0.381 at T=4096.)
VARIANTS = {"ours_batched_o2": {"FWD_EXPAND": 2, "BWD_EXPAND": 2}}


@contextlib.contextmanager
def kernel_variant(name):
    """The chunk.py settings of VARIANTS[name] for the duration; every other implementation as configured."""
    settings = VARIANTS.get(name, {})
    saved = {key: getattr(chunk_mod, key) for key in settings}
    for key, value in settings.items():
        setattr(chunk_mod, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(chunk_mod, key, value)


SPLIT_BEST = {}  # "fwd" / "fb": the split settings of the fastest forward / forward+backward (--split-sweep)


@contextlib.contextmanager
def split_choice(name):
    """`ours_split` runs our kernels with chunk.FORWARD = chunk.BACKWARD = "split" at the sweep's fastest forward
    settings; `ours_split_bwd` the fused forward and the split backward at its fastest forward+backward settings."""
    import kernels.based.split as split_mod

    saved = chunk_mod.FORWARD, chunk_mod.BACKWARD, dict(split_mod.CONFIG)
    try:
        if name == "ours_split":
            chunk_mod.FORWARD = chunk_mod.BACKWARD = "split"
            split_mod.CONFIG.update(SPLIT_BEST["fwd"])
        elif name == "ours_split_bwd":
            chunk_mod.FORWARD, chunk_mod.BACKWARD = "fused", "split"
            split_mod.CONFIG.update(SPLIT_BEST["fb"])
        yield
    finally:
        chunk_mod.FORWARD, chunk_mod.BACKWARD = saved[:2]
        split_mod.CONFIG = saved[2]


def impls():
    from fla.ops.based import fused_chunk_based, parallel_based

    out = {
        "ours": (lambda q, k, v: chunk_based(q, k, v)[0], "bthd", K),
        **{name: (lambda q, k, v: chunk_based(q, k, v)[0], "bthd", K) for name in VARIANTS},
        "fla_parallel_based": (lambda q, k, v: parallel_based(q, k, v, scale=None, use_norm=True), "bthd", K),
        "fla_fused_chunk_based": (lambda q, k, v: fused_chunk_based(q, k, v, scale=None, use_norm=True), "bthd", K),
        "sdpa_causal_d64": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), "bhtd", SDPA_D),
    }
    return out


def time_impl(fn, T, layout, d_qk):
    q, k, v, do = inputs(T, d_qk, V if d_qk == K else SDPA_D, layout)
    with torch.no_grad():
        fwd = bench(lambda: fn(q, k, v))
    both = bench(lambda: fn(q, k, v).backward(do), grad_to_none=[q, k, v])
    return fwd, both


def time_graphed(fn, T, layout, d_qk):
    """The forward and forward+backward of `fn`, each captured once in a CUDA graph and timed by replay: the GPU's
    own time, without the host's launch overhead (which the eager rows include, and which dominates short T)."""
    q, k, v, do = inputs(T, d_qk, V if d_qk == K else SDPA_D, layout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture
        for _ in range(3):
            with torch.no_grad():
                fn(q, k, v)
            fn(q, k, v).backward(do)
    torch.cuda.current_stream().wait_stream(side)
    q.grad = k.grad = v.grad = None
    fwd_graph, both_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(fwd_graph):
        fn(q, k, v)
    with torch.cuda.graph(both_graph):
        fn(q, k, v).backward(do)
    return bench(fwd_graph.replay), bench(both_graph.replay)


def sweep(modes=(5, 6)):
    """Time order-2 modes x block configurations of our kernel at T=4096, each checked against the default
    first; return the fastest (mode, config) for the forward and for the backward, and the table."""
    T = 4096
    q, k, v, do = inputs(T)
    default = chunk_mod._config
    saved = chunk_mod.FWD_EXPAND, chunk_mod.BWD_EXPAND
    with torch.no_grad():
        ref = chunk_based(q, k, v)[0].float()
    ref_grads = torch.autograd.grad(chunk_based(q, k, v)[0], (q, k, v), do)
    # BC=64 only forward: bf16 at BC=64 faulted in the backward in v0 (LOG.md)
    grid = {"fwd": [(BV, BC, w, 2) for BV in (16, 32, 64) for BC in (32, 64) for w in (4, 8)],
            "bwd": [(BV, 32, w, 2) for BV in (16, 32, 64) for w in (4, 8)]}
    results = {"fwd": [], "bwd": []}
    for kind in ("fwd", "bwd"):
        for mode in modes:
            for BV, BC, w, s in grid[kind]:
                def cfg(K_, V_, dtype, kind_, BV=BV, BC=BC, w=w, s=s, kind=kind):
                    return (16, BV, BC, w, s) if kind_ == kind else default(K_, V_, dtype, kind_)
                chunk_mod._config = cfg
                chunk_mod.FWD_EXPAND = chunk_mod.BWD_EXPAND = mode
                label = f"sweep {kind} mode={mode} BV={BV} BC={BC} warps={w} stages={s}"
                try:
                    if kind == "fwd":
                        with torch.no_grad():
                            err = ((chunk_based(q, k, v)[0].float() - ref).norm() / ref.norm()).item()
                            ms = bench(lambda: chunk_based(q, k, v))
                    else:
                        grads = torch.autograd.grad(chunk_based(q, k, v)[0], (q, k, v), do)
                        err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                  for a, b in zip(grads, ref_grads))
                        ms = bench(lambda: chunk_based(q, k, v)[0].backward(do), grad_to_none=[q, k, v])
                except Exception as e:  # a config that fails to compile (registers, shared memory) is skipped
                    print(f"{label}: failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                finally:
                    chunk_mod._config = default
                    chunk_mod.FWD_EXPAND, chunk_mod.BWD_EXPAND = saved
                print(f"{label}: {ms:.4f} ms  (rel diff vs default {err:.1e})", flush=True)
                if err < 2e-2:
                    results[kind].append((ms, mode, (16, BV, BC, w, s)))
    best = {kind: min(r)[1:] for kind, r in results.items()}
    print(f"sweep best (mode, config): {best}")
    return best, {kind: [(ms, m, list(c)) for ms, m, c in r] for kind, r in results.items()}


# The split settings to sweep, each over split.CONFIG's defaults. Sessions 8-9 settled NP=2, OP=2, the chunk-ahead
# load, 168-register caps and the output pass at 8 chunks / 3 stages (experiments/LOG.md: segments, NP=4, 8 warps,
# BV=32, 128-register caps and pipelined gradient kernels were slower or faulted); session 10 the dv launch at 4 /
# 2 and session 11 the stored features (CONFIG["features"]). This grid: the defaults, the state passes walking
# with the features computed inside the walk (the default before session 11), and dq at 4 chunks / 2 stages.
SPLIT_GRID = [{}, {"features": False}, {"dq_chunks": 4, "dq_stages": 2}]


def split_config() -> dict:
    """kernels/based/split.py's CONFIG as it stands."""
    import kernels.based.split as split_mod

    return split_mod.CONFIG


def split_one(cfg, T=4096):
    """One setting of the split kernels at T, checked against the fused kernels: the whole forward, its two kernels
    apart, and forward+backward. Returns a dict of times (ms) and relative differences."""
    import kernels.based.split as split_mod

    q, k, v, do = inputs(T)
    with torch.no_grad():
        ref = chunk_based(q, k, v)[0].float()
    chunk_mod.FORWARD = chunk_mod.BACKWARD = "fused"
    ref_grads = torch.autograd.grad(chunk_based(q, k, v)[0], (q, k, v), do)
    split_mod.CONFIG = {**split_mod.CONFIG, **cfg}
    chunk_mod.FORWARD = chunk_mod.BACKWARD = "split"
    dot = split_mod.takes_fp16(chunk_mod._fused_forward_dot(DT))  # what chunk_based passes the split kernels
    with torch.no_grad():
        err = ((chunk_based(q, k, v)[0].float() - ref).norm() / ref.norm()).item()
        ms = bench(lambda: chunk_based(q, k, v))
        hs, zs, _, _ = split_mod.state_pass(k, v, None, None, False, dot)
        ms_state = bench(lambda: split_mod.state_pass(k, v, None, None, False, dot))
        ms_out = bench(lambda: split_mod.output_pass(q, k, v, hs, zs, K**-0.5, True, dot))
        # the backward's other two steps apart (dden's values do not matter for time)
        den = split_mod.output_pass(q, k, v, hs, zs, K**-0.5, True, dot)[1]
        dden = torch.randn_like(den)
        ds, dzs, _, _ = split_mod.reverse_pass(q, do, den, dden, None, None, False, K**-0.5, True, dot)
        ms_reverse = bench(lambda: split_mod.reverse_pass(q, do, den, dden, None, None, False, K**-0.5, True, dot))
        ms_grads = bench(lambda: split_mod.chunk_grads(q, k, v, do, den, dden, hs, zs, ds, dzs, K**-0.5, True, dot))
    grads = torch.autograd.grad(chunk_based(q, k, v)[0], (q, k, v), do)
    err_b = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, ref_grads))
    ms_fb = bench(lambda: chunk_based(q, k, v)[0].backward(do), grad_to_none=[q, k, v])
    chunk_mod.FORWARD = "fused"
    ms_fused_split_bwd = bench(lambda: chunk_based(q, k, v)[0].backward(do), grad_to_none=[q, k, v])
    return {"cfg": cfg, "ms": ms, "state_ms": ms_state, "output_ms": ms_out, "reverse_ms": ms_reverse,
            "chunk_grads_ms": ms_grads, "fwdbwd_ms": ms_fb,
            "fused_fwd_split_bwd_ms": ms_fused_split_bwd, "err": err, "err_grads": err_b}


def split_sweep(T=4096, grid=SPLIT_GRID, budget_s=None):
    """The split kernels (kernels/based/split.py) over their launch settings at T, each in its own process (a
    setting that faults on the GPU loses only itself), each checked against the fused kernels. Returns the fastest
    settings, forward and forward+backward, and the table. budget_s: no new setting is started after that long."""
    import subprocess
    import sys
    import time

    table = []
    start = time.time()
    for cfg in grid:
        if budget_s is not None and time.time() - start > budget_s:
            print(f"split sweep: time budget of {budget_s} s spent; {len(grid) - grid.index(cfg)} settings left")
            break
        label = "split " + " ".join(f"{a}={b}" for a, b in cfg.items())
        cmd = [sys.executable, __file__, "--split-one", json.dumps(cfg), "--T", str(T)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            line = [x for x in r.stdout.splitlines() if x.startswith("SPLIT_ONE ")]
            if r.returncode != 0 or not line:
                raise RuntimeError((r.stdout + r.stderr).strip().splitlines()[-1][:200])
        except Exception as e:  # a setting that fails to compile or faults is skipped
            print(f"{label}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        row = json.loads(line[0][len("SPLIT_ONE "):])
        print(f"{label}: fwd {row['ms']:.4f} ms (state {row['state_ms']:.4f}, output {row['output_ms']:.4f}), "
              f"fwd+bwd {row['fwdbwd_ms']:.4f} ms (reverse {row['reverse_ms']:.4f}, chunk grads "
              f"{row['chunk_grads_ms']:.4f}), fused fwd + split bwd {row['fused_fwd_split_bwd_ms']:.4f} ms; "
              f"rel diff vs fused {row['err']:.1e} / gradients {row['err_grads']:.1e}", flush=True)
        if row["err"] < 2e-2 and row["err_grads"] < 2e-2:
            table.append(row)
    best = min(table, key=lambda r: r["ms"]) if table else None
    best_fb = min(table, key=lambda r: min(r["fwdbwd_ms"], r["fused_fwd_split_bwd_ms"])) if table else None
    print(f"split best forward: {best}")
    print(f"split best forward+backward: {best_fb}")
    return best, best_fb, table


def decode_step_ms(batch):
    g = torch.Generator(device="cuda").manual_seed(batch)
    kv = torch.randn(batch, H, E, V, device="cuda", generator=g)
    ks = torch.rand(batch, H, E, device="cuda", generator=g) + 1
    q, k = (torch.randn(batch, H, K, device="cuda", dtype=DT, generator=g) for _ in range(2))
    v = torch.randn(batch, H, V, device="cuda", dtype=DT, generator=g)
    out = torch.empty_like(v)
    state = (kv, ks)
    fused_recurrent_based(q, k, v, state, out=out)
    steps = 16
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for _ in range(steps):
            fused_recurrent_based(q, k, v, state, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    ms = bench(graph.replay) / steps
    return ms, batch * H * E * (V + 1) * 4 * 2  # state read + written


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--split-sweep", action="store_true", help="time the split kernels' settings; use the best")
    p.add_argument("--split-budget", type=float, default=None, help="seconds after which the split sweep stops")
    p.add_argument("--split-grid", default=None,
                   help="JSON list of split settings (each over split.CONFIG) to sweep instead of SPLIT_GRID")
    p.add_argument("--split-one", default=None, help="(internal) time one split setting, JSON; print SPLIT_ONE {...}")
    p.add_argument("--skip-baselines", action="store_true")
    p.add_argument("--tuned", default=None, help="JSON with the forward/backward modes and block configs to use")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="inputs of every row (default bf16)")
    args = p.parse_args()
    global DT
    DT = DTYPES[args.dtype]
    if args.split_one:
        print("SPLIT_ONE " + json.dumps(split_one(json.loads(args.split_one), args.T[0])))
        return
    if args.tuned:
        tuned = json.load(open(args.tuned))
        chunk_mod.FWD_EXPAND, chunk_mod.BWD_EXPAND = tuned["fwd"]["mode"], tuned["fb"]["mode"]
        cfgs = {"fwd": tuple(tuned["fwd"]["cfg"]), "bwd": tuple(tuned["fb"]["cfg"])}
        default_cfg = chunk_mod._config
        chunk_mod._config = lambda K_, V_, dtype, kind: cfgs[kind] if (K_, V_, dtype) == (K, V, DT) else \
            default_cfg(K_, V_, dtype, kind)
        print(f"tuned: modes fwd {chunk_mod.FWD_EXPAND} bwd {chunk_mod.BWD_EXPAND}, configs {cfgs}")
    torch.manual_seed(0)
    bw, gemm = copy_bandwidth(), gemm_rate()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, {args.dtype} GEMM {gemm / 1e12:.0f} TFLOP/s")
    result = {"device": torch.cuda.get_device_name(), "copy_TBps": bw / 1e12, "gemm_TFLOPs": gemm / 1e12,
              "shape": {"B": B, "H": H, "K": K, "V": V, "dtype": args.dtype}, "rows": [],
              # what `ours` ran: the dispatch choices and the split kernels' launch settings
              "ours": {"forward": chunk_mod.FORWARD, "backward": chunk_mod.BACKWARD,
                       "save_states": chunk_mod.SAVE_STATES, "split_config": dict(split_config())}}
    if args.tuned:
        result["tuned"] = {"fwd_mode": chunk_mod.FWD_EXPAND, "bwd_mode": chunk_mod.BWD_EXPAND,
                           "fwd_cfg": list(chunk_mod._config(K, V, DT, "fwd")),
                           "bwd_cfg": list(chunk_mod._config(K, V, DT, "bwd"))}
    if args.sweep:
        best, table = sweep()
        default = chunk_mod._config
        chunk_mod.FWD_EXPAND, chunk_mod.BWD_EXPAND = best["fwd"][0], best["bwd"][0]
        chunk_mod._config = lambda K_, V_, dtype, kind: best[kind][1] if (K_, V_, dtype) == (K, V, DT) else \
            default(K_, V_, dtype, kind)
        result["sweep"] = {"best": best, "table": table}
    if args.split_sweep:
        grid = SPLIT_GRID if args.split_grid is None else json.loads(args.split_grid)  # each over split.CONFIG
        best, best_fb, table = split_sweep(grid=grid, budget_s=args.split_budget)
        result["split_sweep"] = {"best": best, "best_fwdbwd": best_fb, "table": table}
        if best is not None:
            SPLIT_BEST.update(fwd=best["cfg"], fb=best_fb["cfg"])
    names = impls() if not args.skip_baselines else {"ours": impls()["ours"]}
    names["ours_graphed"] = names["ours"]  # the same calls replayed from CUDA graphs (`time_graphed`)
    if SPLIT_BEST:
        names["ours_split"] = names["ours_split_bwd"] = names["ours"]
    if args.tuned:
        for name in VARIANTS:
            names.pop(name)
    print(f"{'impl':24s} {'T':>6s} {'fwd ms':>8s} {'fwd+bwd ms':>10s} {'fwd %bw':>8s} {'fwd %gemm':>9s} "
          f"{'f+b %bw':>8s} {'f+b %gemm':>9s}")
    for T in args.T:
        for name, (fn, layout, d_qk) in names.items():
            try:
                if name in VARIANTS:
                    q, k, v, do = inputs(T)
                    with torch.no_grad():
                        ref_ng = chunk_based(q, k, v)[0]
                    ref = chunk_based(q, k, v)[0]
                    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
                    with kernel_variant(name):
                        with torch.no_grad():
                            out_ng = chunk_based(q, k, v)[0]
                        out = chunk_based(q, k, v)[0]
                        grads = torch.autograd.grad(out, (q, k, v), do)
                    err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                              for a, b in zip((out_ng, out, *grads), (ref_ng, ref, *ref_grads)))
                    if not err < 2e-2:
                        raise ValueError(f"output or gradients differ from ours: relative error {err:.2e}")
                with kernel_variant(name), split_choice(name):
                    fwd, both = (time_graphed if name == "ours_graphed" else time_impl)(fn, T, layout, d_qk)
            except Exception as e:  # keep the table going if a baseline breaks on this stack; say so
                print(f"{name:24s} {T:6d} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            if name == "sdpa_causal_d64":
                fl, by_f = sdpa_flops(T), 4 * B * T * H * SDPA_D * DT.itemsize
                by_b = by_f + 7 * B * T * H * SDPA_D * DT.itemsize
                fl_b = 3.5 * fl
            else:
                fl, by_f, by_b, fl_b = based_flops(T), based_bytes(T, False), based_bytes(T, True), 3 * based_flops(T)
            row = {"impl": name, "T": T, "fwd_ms": fwd, "fwdbwd_ms": both,
                   "fwd_frac_bw": by_f / (fwd * 1e-3) / bw, "fwd_frac_gemm": fl / (fwd * 1e-3) / gemm,
                   "fwdbwd_frac_bw": by_b / (both * 1e-3) / bw, "fwdbwd_frac_gemm": fl_b / (both * 1e-3) / gemm}
            result["rows"].append(row)
            print(f"{name:24s} {T:6d} {fwd:8.4f} {both:10.4f} {row['fwd_frac_bw']:8.1%} {row['fwd_frac_gemm']:9.1%} "
                  f"{row['fwdbwd_frac_bw']:8.1%} {row['fwdbwd_frac_gemm']:9.1%}")
    rows = {(r["impl"], r["T"]): r for r in result["rows"]}
    ratios = {}
    for T in args.T:
        for mine in ("ours", "ours_graphed", "ours_split", "ours_split_bwd"):
            ours = rows.get((mine, T))
            for base in ("fla_parallel_based", "fla_fused_chunk_based", "sdpa_causal_d64"):
                if ours and (base, T) in rows:
                    ratios[f"{base}/{mine}_fwd_T{T}"] = rows[(base, T)]["fwd_ms"] / ours["fwd_ms"]
                    ratios[f"{base}/{mine}_fwdbwd_T{T}"] = rows[(base, T)]["fwdbwd_ms"] / ours["fwdbwd_ms"]
    for mine in ("ours", "ours_graphed", "ours_split", "ours_split_bwd"):
        if (mine, 4096) in rows and (mine, 16384) in rows:
            ratios[f"{mine}_fwdbwd_T16384/T4096"] = rows[(mine, 16384)]["fwdbwd_ms"] / rows[(mine, 4096)]["fwdbwd_ms"]
    result["ratios"] = ratios
    print("decode (one step, CUDA graph):")
    result["decode"] = []
    for batch in (1, 64, 256):
        ms, nbytes = decode_step_ms(batch)
        frac = nbytes / (ms * 1e-3) / bw
        result["decode"].append({"B": batch, "step_ms": ms, "frac_bw": frac})
        print(f"  B={batch:4d}  {ms * 1e3:8.2f} us/step  {frac:6.1%} of copy bandwidth (state {nbytes / 1e6:.1f} MB)")
    for k_, r in ratios.items():
        print(f"  {k_}: {r:.2f}x")
    print(json.dumps(result, default=lambda x: round(x, 5) if isinstance(x, float) and math.isfinite(x) else str(x)))


if __name__ == "__main__":
    main()
