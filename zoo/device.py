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
