"""The one tolerance rule for kernel tests, and the shape grids they sweep.

Rule (docs/STYLE.md, 2): against a float64 reference, a kernel's relative error ‖x − ref‖/‖ref‖ may be at most
twice the error of the naive PyTorch code run in the kernel's own dtype, plus a small allowance for that dtype.
So a bf16 kernel is held to what bf16 arithmetic allows, and an fp32 kernel to fp32's.
"""

import torch

FACTOR = 2.0
# Relative-error allowance per dtype, added to FACTOR × the naive error. Small next to what a wrong kernel gives
# (O(1)), large enough for a different but sound summation order at the tested lengths.
ALLOWANCE = {torch.float64: 1e-12, torch.float32: 5e-6, torch.float16: 2.5e-4, torch.bfloat16: 2e-3}

# CPU (Triton interpreter, fp32): odd lengths around the chunk size, and a single token.
CPU_T = (1, 15, 64, 100)
# GPU: real lengths up to 16K, odd ones included.
GPU_T = (63, 1000, 4096, 16384)


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (inf when x holds a non-finite value)."""
    x, ref = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(torch.finfo(torch.float64).tiny)).item()


def assert_close(name: str, actual: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor,
                 dtype: torch.dtype) -> None:
    """Assert rel_error(actual) ≤ FACTOR·rel_error(baseline) + ALLOWANCE[dtype], both against `reference`.

    actual: the kernel's result; reference: the naive code in float64; baseline: the naive code in `dtype`.
    """
    if actual.shape != reference.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(reference.shape)}")
    err, base = rel_error(actual, reference), rel_error(baseline, reference)
    bound = FACTOR * base + ALLOWANCE[dtype]
    assert err <= bound, (f"{name}: relative error {err:.3g} > {FACTOR:g} × naive-in-{dtype} {base:.3g} "
                          f"+ {ALLOWANCE[dtype]:.1g} = {bound:.3g}")
