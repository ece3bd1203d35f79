"""Timing, memory, error and table formatting shared by the benchmarks in this folder."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, device: torch.device, repeats: int) -> float:
    """Median ms of fn() over `repeats` calls after one warm-up call (which compiles and autotunes): CUDA events
    on the GPU, so only device time between the events counts; wall time on the CPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fmt(v, spec: str) -> str:
    """format(v, spec), or "-" at the same width for a missing value (memory off CUDA)."""
    return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0] or 0))


def peak_mib(fn, device: torch.device) -> float | None:
    """Memory fn() allocates above what was allocated before it (MiB), on CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
