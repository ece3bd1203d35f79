"""Device and precision policy, in one place."""

import contextlib

import torch


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` is CUDA when there is a GPU, else CPU. Asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name} but torch sees no CUDA device")
    return device


def autocast(device: torch.device, precision: str = "auto", cache: bool = True) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA by default; fp32 on CPU (CPU bf16 matmuls are slow and lossy).

    `cache=False` turns off autocast's cache of weight casts (inside a CUDA-graph capture)."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 1


def set_threads(threads: int = 0) -> int:
    """torch's intra-op CPU threads: `threads`, or with 0 the cores available to this process; returns it.

    torch otherwise starts one thread per core of the machine, and when other processes take some of those
    cores its threads wait on each other at every op: a small model's steps slow down many times over."""
    n = threads if threads > 0 else available_cores()
    torch.set_num_threads(n)
    return n
