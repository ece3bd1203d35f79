"""kernels/sm90.py compiles the Based Triton kernels for sm_90a without a GPU and reads ptxas's report: the CPU check
that the kernels a GPU runs compile (the interpreter runs code the compiler refuses, e.g. an early return inside an
if), with their dots as warpgroup MMAs and within their register caps."""

import os
import re

import pytest
import torch
import triton

from kernels.based import fused, primitives
from kernels.sm90 import compile_kernel, ptxas_report

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")


def _registers(kernel) -> int:
    report = ptxas_report(kernel.asm["ptx"])
    return int(report.split("Used ")[1].split(" registers")[0])


def _fused(kind: str, dtype: torch.dtype, **kwargs):
    BK, BV, BC, warps, stages = fused._config(16, 64, dtype, "fwd" if kind == "fwd" else "bwd")
    dot = primitives.forward_dot(dtype) if kind == "fwd" else primitives.backward_dot(dtype)
    return compile_kernel(kind, fused._pair_rows(BK), BV, BC, warps, stages, states=True, dot=dot, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["fwd", "dq", "dkv"])
def test_fused_kernels_compile_for_sm90(kind, dtype):
    """The fused kernels at their settings for each dtype: their state dots are wgmmas (fp32 through tf32x3; fp16
    forwards with fp16 operands, no tf32 left), within the H200's shared memory and 255 registers."""
    kernel = _fused(kind, dtype)
    assert "ttng.warp_group_dot" in kernel.asm["ttgir"]
    assert kernel.metadata.shared <= 232448  # the H200's shared memory per block
    if kind == "fwd" and dtype == torch.float16:
        wgmma = set(re.findall(r"wgmma\.mma_async[\w.]*", kernel.asm["ptx"]))
        assert wgmma and all(w.endswith(".f32.f16.f16") for w in wgmma), wgmma
    assert 0 < _registers(kernel) <= 255


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkv"])
def test_kernels_compile_with_an_fp64_scale(kind):
    """torch.compile's inductor may launch a kernel with the Python float `scale` typed fp64, not fp32 as Triton's
    own launcher does; each kernel casts it to fp32 first (else the fused dk/dv kernel's loop-carried fp32
    accumulator turns fp64 and fails to compile)."""
    kernel = _fused(kind, torch.bfloat16, scale_dtype="fp64")
    assert "cvt.rn.f32.f64" in kernel.asm["ptx"]  # the one conversion, at the top
    assert ".f64" not in kernel.asm["ptx"].replace("cvt.rn.f32.f64", "").replace(".param .f64", "")
