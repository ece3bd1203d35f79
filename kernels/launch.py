"""Host-side helpers for launching the Triton kernels: where they can run, and integers for launch shapes.

`triton.cdiv` and `triton.next_power_of_2` are Triton constexpr functions: called from Python each one unwraps its
arguments first, a few microseconds per call, and a Based forward+backward computes some forty such values. These
are the same functions in plain Python (equal on every non-negative int; tests/kernels/test_launch.py).
"""

import os

import torch


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels launch on tensors of `device`: CUDA, or the CPU under Triton's interpreter
    (TRITON_INTERPRET=1, set before triton is first imported)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def is_capturing(x: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on x's stream (launches then cost the host nothing, and code that
    reads device values must skip them)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def check_devices(op: str, *tensors: torch.Tensor | None) -> None:
    """One clear error, before any launch, for inputs on several devices or on one Triton cannot launch on."""
    devices = sorted({str(t.device) for t in tensors if t is not None})
    if len(devices) > 1:
        raise ValueError(f"{op}: inputs are on different devices ({', '.join(devices)})")
    if devices and not triton_runs_on(torch.device(devices[0])):
        raise ValueError(f"{op} runs Triton kernels: it needs CUDA tensors, or TRITON_INTERPRET=1 on the CPU (got "
                         f"{devices[0]} tensors); kernels/based/naive.py has the same functions in PyTorch")


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (n itself for n ≤ 1, as `triton.next_power_of_2`)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()
