"""Benchmark: Based linear attention kernels against FLA's Based kernels and causal SDPA, on one CUDA GPU.

    python experiments/bench/based_kernels.py [--T 1024 4096 16384] [--dtype bf16] [--compile-T 1024]

Shape B=8, H=16, K=16, V=64 (SDPA: head dim 64). Median times over CUDA events after warm-up
(triton.testing.do_bench, which flushes L2 between runs), forward (no gradient) and forward+backward. Rows:

- `ours`: `chunk_based` called eagerly (the kernels `ops.choose_path` picks, printed as `path`);
- `ours_graphed`: the same calls captured once in CUDA graphs and timed by replay (the GPU's own time, without the
  host's launch overhead, which the eager rows include);
- `ours_compiled` (at --compile-T): `torch.compile(fullgraph=True)` of the same calls, which trace into the custom ops
  `zoo_based::chunk_fwd` / `chunk_bwd`; the row records which kernels the compiled training step ran;
- `fla_parallel_based`, `fla_fused_chunk_based` (where FLA is installed) and `sdpa_causal_d64`.

Each row also gives the host's time per forward call (`host µs`, `fwd_host_us`: issuing 200 calls without waiting
for the device), the overhead a call pays above its kernels when the device is faster than the host.

At --profile-T, the device time of the training call per kernel (torch.profiler). Then the decode step at
B ∈ {1, 64} (a CUDA graph of 16 steps, time per step). Ceilings are measured in the same process: copy bandwidth
(device-to-device copy, bytes read + written) and the GEMM rate (8192³, random data); each row reports the fraction
of both it reaches, counting the minimum bytes (inputs read once, outputs written once) and the FLOPs of
kernels/based/README.md. The last line is JSON.
"""

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
import triton

from kernels.based import choose_path, chunk_based, feature_dim, fused_recurrent_based

B, H, K, V, SDPA_D = 8, 16, 16, 64, 64
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
E = feature_dim(K)


def bench(fn, grad_to_none=None):
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def copy_bandwidth():
    x = torch.randn(2**28, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / (bench(lambda: y.copy_(x)) * 1e-3)


def gemm_rate(dt):
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=dt) for _ in range(2))
    return 2 * 8192**3 / (bench(lambda: a @ b) * 1e-3)


def based_flops(T, C=64):
    """Forward: state query and update over E features (4·E·V per token) plus the chunk tile (2·C·(K+V))."""
    return B * H * T * (4 * E * V + 2 * C * (K + V))


def based_bytes(T, dt, backward):
    qk, vo = B * T * H * K * dt.itemsize, B * T * H * V * dt.itemsize
    return 2 * qk + 2 * vo + (4 * qk + 4 * vo if backward else 0)  # + q, k, v, o, dO read; dq, dk, dv written


def inputs(T, dt, d_qk=K, d_v=V, layout="bthd"):
    g = torch.Generator(device="cuda").manual_seed(T)
    shape = (B, T, H) if layout == "bthd" else (B, H, T)
    q, k = (torch.randn(*shape, d_qk, device="cuda", dtype=dt, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(*shape, d_v, device="cuda", dtype=dt, generator=g).requires_grad_()
    return q, k, v, torch.randn(*shape, d_v, device="cuda", dtype=dt, generator=g)


def impls():
    out = {"ours": (lambda q, k, v: chunk_based(q, k, v)[0], "bthd", K)}
    try:
        from fla.ops.based import fused_chunk_based, parallel_based

        out["fla_parallel_based"] = (lambda q, k, v: parallel_based(q, k, v, scale=None, use_norm=True), "bthd", K)
        out["fla_fused_chunk_based"] = (lambda q, k, v: fused_chunk_based(q, k, v, scale=None, use_norm=True), "bthd",
                                        K)
    except ImportError:
        print("FLA is not installed: no fla_* rows")
    out["sdpa_causal_d64"] = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), "bhtd",
                              SDPA_D)
    return out


def host_us(call, n=200):
    """The host's time per forward call in µs: the wall of issuing n calls back to back without waiting for the
    device (n calls of a few kernels each fit the launch queue), after a warm-up. Below the device time it is
    hidden; above it, it is the call's time."""
    with torch.no_grad():
        for _ in range(10):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        wall = time.perf_counter() - t0
        torch.cuda.synchronize()
    return wall / n * 1e6


def time_eager(fn, T, dt, layout, d_qk):
    q, k, v, do = inputs(T, dt, d_qk, V if d_qk == K else SDPA_D, layout)
    with torch.no_grad():
        fwd = bench(lambda: fn(q, k, v))
    both = bench(lambda: fn(q, k, v).backward(do), grad_to_none=[q, k, v])
    return fwd, both, host_us(lambda: fn(q, k, v))


def time_graphed(fn, T, dt):
    """The forward and forward+backward of `fn`, each captured once in a CUDA graph and timed by replay."""
    q, k, v, do = inputs(T, dt)
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
    return bench(fwd_graph.replay), bench(both_graph.replay), host_us(fwd_graph.replay)


def time_compiled(T, dt):
    """torch.compile(fullgraph=True) of chunk_based: the forward, the forward+backward, and the forms whose kernels
    the compiled training step ran (counted by wrapping their entry points for one step)."""
    from kernels.based import fused, gluon, gluon_backward

    compiled = torch.compile(lambda q, k, v: chunk_based(q, k, v)[0], fullgraph=True)
    q, k, v, do = inputs(T, dt)
    with torch.no_grad():
        compiled(q, k, v)
    compiled(q, k, v).backward(do)  # compile both graphs first
    ran, saved = [], []
    for name, module in (("gluon", gluon), ("gluon", gluon_backward), ("fused", fused)):
        for fn_name in ("forward", "backward"):
            if hasattr(module, fn_name):
                real = getattr(module, fn_name)
                saved.append((module, fn_name, real))
                setattr(module, fn_name, lambda *a, _r=real, _n=f"{name}.{fn_name}", **kw: ran.append(_n)
                        or _r(*a, **kw))
    try:
        compiled(q, k, v).backward(do)
        torch.cuda.synchronize()
    finally:
        for module, fn_name, real in saved:
            setattr(module, fn_name, real)
    with torch.no_grad():
        fwd = bench(lambda: compiled(q, k, v))
    both = bench(lambda: compiled(q, k, v).backward(do), grad_to_none=[q, k, v])
    return fwd, both, host_us(lambda: compiled(q, k, v)), ran


def kernel_breakdown(T, dt):
    """Device time per kernel of one eager forward+backward of `chunk_based` (torch.profiler, 20 calls), in ms per
    call, largest first: where the training call's time goes. The gradients are dropped before each call, as the
    timed rows drop them, so no accumulation kernel is counted."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, do = inputs(T, dt)

    def call():
        q.grad = k.grad = v.grad = None
        chunk_based(q, k, v)[0].backward(do)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    calls = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.device_time / 1e3 / calls
    return sorted(times.items(), key=lambda kv: -kv[1])


def decode_step_ms(batch, dt):
    g = torch.Generator(device="cuda").manual_seed(batch)
    kv = torch.randn(batch, H, E, V, device="cuda", generator=g)
    ks = torch.rand(batch, H, E, device="cuda", generator=g) + 1
    q, k = (torch.randn(batch, H, K, device="cuda", dtype=dt, generator=g) for _ in range(2))
    v = torch.randn(batch, H, V, device="cuda", dtype=dt, generator=g)
    out, state, steps = torch.empty_like(v), (kv, ks), 16
    fused_recurrent_based(q, k, v, state, out=out)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for _ in range(steps):
            fused_recurrent_based(q, k, v, state, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    return bench(graph.replay) / steps, batch * H * E * (V + 1) * 4 * 2  # state read + written


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--compile-T", type=int, nargs="*", default=[1024], help="lengths of the ours_compiled rows")
    p.add_argument("--profile-T", type=int, nargs="*", default=[4096],
                   help="lengths at which the training call's device time is broken down by kernel")
    args = p.parse_args()
    dt = DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False
    bw, gemm = copy_bandwidth(), gemm_rate(dt)
    cap = torch.cuda.get_device_capability()
    result = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "B": B, "H": H, "K": K, "V": V,
              "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": bw / 1e12,
              "gemm_TFLOPs": gemm / 1e12, "rows": []}
    print(f"{result['device']}: copy {bw / 1e12:.2f} TB/s, {args.dtype} GEMM {gemm / 1e12:.0f} TFLOP/s")
    print(f"{'impl':22s} {'T':>6s} {'path':>6s} {'fwd ms':>8s} {'f+b ms':>8s} {'host µs':>8s} {'fwd bw':>7s} "
          f"{'fwd mm':>7s} {'f+b bw':>7s} {'f+b mm':>7s}")
    for T in args.T:
        chosen = choose_path(sm90=cap == (9, 0), dtype=dt, B=B, T=T, H=H, K=K, V=V, normalize=True)
        path = {False: chosen, True: chosen}  # inference and training take the same path
        names = list(impls().items())
        names.insert(1, ("ours_graphed", names[0][1]))
        if T in args.compile_T:
            names.insert(2, ("ours_compiled", names[0][1]))
        for name, (fn, layout, d_qk) in names:
            extra = {}
            try:
                if name == "ours_graphed":
                    fwd, both, host = time_graphed(fn, T, dt)
                elif name == "ours_compiled":
                    fwd, both, host, ran = time_compiled(T, dt)
                    extra["ran"] = ran
                else:
                    fwd, both, host = time_eager(fn, T, dt, layout, d_qk)
            except Exception as e:  # keep the table going if a baseline breaks on this stack; say so
                print(f"{name:22s} {T:6d} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            if name == "sdpa_causal_d64":
                fl = 4 * B * H * T * T * SDPA_D / 2
                by_f = 4 * B * T * H * SDPA_D * dt.itemsize
                by_b, fl_b = by_f + 7 * B * T * H * SDPA_D * dt.itemsize, 3.5 * fl
            else:
                fl, fl_b = based_flops(T), 3 * based_flops(T)
                by_f, by_b = based_bytes(T, dt, False), based_bytes(T, dt, True)
            row = {"impl": name, "T": T, "fwd_ms": fwd, "fwdbwd_ms": both, "fwd_host_us": host,
                   "fwd_frac_bw": by_f / (fwd * 1e-3) / bw, "fwd_frac_gemm": fl / (fwd * 1e-3) / gemm,
                   "fwdbwd_frac_bw": by_b / (both * 1e-3) / bw, "fwdbwd_frac_gemm": fl_b / (both * 1e-3) / gemm,
                   **extra}
            shown = f"{path[False]}/{path[True]}" if name.startswith("ours") else ""
            if name.startswith("ours"):
                row["path_fwd"], row["path_train"] = path[False], path[True]
            result["rows"].append(row)
            print(f"{name:22s} {T:6d} {shown[:6]:>6s} {fwd:8.4f} {both:8.4f} {host:8.1f} {row['fwd_frac_bw']:7.1%} "
                  f"{row['fwd_frac_gemm']:7.1%} {row['fwdbwd_frac_bw']:7.1%} {row['fwdbwd_frac_gemm']:7.1%}"
                  + (f"  ran {','.join(extra['ran'])}" if extra else ""))
    rows = {(r["impl"], r["T"]): r for r in result["rows"]}
    ratios = {}
    for T in args.T:
        for mine in ("ours", "ours_graphed", "ours_compiled"):
            for base in ("fla_parallel_based", "sdpa_causal_d64", "ours"):
                if mine != base and (mine, T) in rows and (base, T) in rows:
                    for part in ("fwd", "fwdbwd"):
                        ratios[f"{base}/{mine}_{part}_T{T}"] = rows[(base, T)][f"{part}_ms"] / rows[(mine, T)][
                            f"{part}_ms"]
    result["ratios"] = ratios
    result["kernels"] = {}
    for T in args.profile_T:
        breakdown = kernel_breakdown(T, dt)
        result["kernels"][f"T{T}"] = {name: ms for name, ms in breakdown}
        print(f"forward+backward at T={T}, device time per kernel:")
        for name, ms in breakdown:
            print(f"  {ms:8.4f} ms  {name[:90]}")
    print("decode (one step, CUDA graph):")
    result["decode"] = []
    for batch in (1, 64):
        ms, nbytes = decode_step_ms(batch, dt)
        frac = nbytes / (ms * 1e-3) / bw
        result["decode"].append({"B": batch, "step_ms": ms, "frac_bw": frac})
        print(f"  B={batch:4d}  {ms * 1e3:8.2f} us/step  {frac:6.1%} of copy bandwidth (state {nbytes / 1e6:.1f} MB)")
    for name, r in ratios.items():
        print(f"  {name}: {r:.2f}x")
    print(json.dumps(result, default=lambda x: round(x, 5) if isinstance(x, float) and math.isfinite(x) else str(x)))


if __name__ == "__main__":
    main()
