"""Mamba's selective scan: the plain loop over time against the chunked prefix scan (zoo/models/mixers/mamba.py)
and, on CUDA, the Triton kernel (kernels/selective_scan, impl="triton") at each `--scan-chunks` length (the
tokens between the states its forward keeps; 1 keeps every h_t): forward+backward of one Mamba mixer at the
Zoology Fig. 2 shapes, all variants in the same run, with each variant's peak GPU memory.

    python experiments/bench/mamba_scan.py                       # GPU: Fig. 2 shapes (batch 256/512, L 64..256)
    python experiments/bench/mamba_scan.py --device cpu --small  # CPU: batch 16, d_model 64 (report ratios)
    python experiments/bench/mamba_scan.py --shapes 512,128,512  # one shape: Fig. 2 L = 128, d_model 512

Prints a table (ms per forward+backward, median of --repeats after a warm-up; speed-up against the loop), the
peak memory of each variant's step on CUDA, and a last line of JSON. Every variant's output and input gradient
are checked against the loop's first.
"""

import argparse
import json
import statistics
import time

import torch

from zoo.models.mixers.mamba import Mamba


def timed(fn, device: torch.device, repeats: int) -> tuple[float, float | None]:
    """(median ms of `repeats` calls of `fn` after a warm-up, the peak GPU memory one call allocates beyond what
    was allocated before it, in MiB; None off CUDA). Every call does the same work, so the peak over the timed calls
    is one call's."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if device.type == "cuda" else None
    return statistics.median(times) * 1e3, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="CPU-sized shapes")
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--scan-chunks", type=int, nargs="+", default=[1, 16, 64], help="the Triton scan's scan_chunk")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", nargs="+", default=None, metavar="B,L,D",
                   help="(batch, L, d_model) triples, e.g. 512,128,512 (default: Fig. 2's; --small: CPU-sized)")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.shapes:
        shapes = [tuple(int(v) for v in shape.split(",")) for shape in args.shapes]
    elif args.small:
        shapes = [(16, 64, 64), (16, 128, 64)]  # (batch, L, d_model)
    else:  # Fig. 2: batch 512 at L=64/128, 256 at L=256; d_model 128 and 256
        shapes = [(512, 64, 128), (512, 128, 128), (256, 256, 128), (256, 256, 256), (256, 256, 512)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    variants = [(f"chunk{c}", "naive", c, None) for c in args.chunks]
    if device.type == "cuda":
        variants += [(f"triton_c{c}", "triton", 0, c) for c in args.scan_chunks]
    labels = [label for label, *_ in variants]
    # each shape's row is printed as it finishes: a run stopped by a time limit keeps the shapes it measured
    print(f"Mamba forward+backward on {device} ({dtype})")
    print(f"{'batch':>6}{'L':>6}{'d':>6}{'loop ms':>10}" + "".join(f"{f'{lb} ms':>14}{'x':>7}" for lb in labels),
          flush=True)
    rows = []
    for B, L, d in shapes:
        torch.manual_seed(0)
        mixer = Mamba(d, chunk_size=0).to(device)
        x = torch.randn(B, L, d, device=device)

        def step(m=mixer, x=x):
            xi = x.clone().requires_grad_()
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                y = m(xi)
            y.float().square().mean().backward()
            return y.detach().float(), xi.grad

        ref_y, ref_g = step()
        row = {"batch": B, "L": L, "d_model": d}
        row["loop_ms"], row["loop_peak_mib"] = timed(step, device, args.repeats)
        for label, impl, c, scan_chunk in variants:
            mixer.config.chunk_size, mixer.config.impl, mixer.config.scan_chunk = c, impl, scan_chunk
            y, g = step()
            err = max(
                ((y - ref_y).abs().max() / ref_y.abs().max()).item(),
                ((g - ref_g).abs().max() / ref_g.abs().max()).item(),
            )
            row[f"{label}_ms"], row[f"{label}_peak_mib"] = timed(step, device, args.repeats)
            row[f"{label}_rel_err"] = err
        mixer.config.chunk_size, mixer.config.impl, mixer.config.scan_chunk = 0, "naive", None
        rows.append(row)
        print(
            f"{B:>6}{L:>6}{d:>6}{row['loop_ms']:>10.1f}"
            + "".join(f"{row[f'{lb}_ms']:>14.1f}{row['loop_ms'] / row[f'{lb}_ms']:>7.2f}" for lb in labels),
            flush=True,
        )
    if device.type == "cuda":
        print("peak GPU memory of one step, MiB")
        print(f"{'batch':>6}{'L':>6}{'d':>6}{'loop':>10}" + "".join(f"{lb:>14}" for lb in labels))
        for r in rows:
            print(f"{r['batch']:>6}{r['L']:>6}{r['d_model']:>6}{r['loop_peak_mib']:>10.0f}"
                  + "".join(f"{r[f'{lb}_peak_mib']:>14.0f}" for lb in labels))
    print(json.dumps({"device": str(device), "dtype": str(dtype), "rows": rows}))


if __name__ == "__main__":
    main()
