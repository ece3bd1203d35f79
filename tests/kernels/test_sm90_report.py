"""kernels.based.sm90_report compiles the Based kernels for sm_90a without a GPU and reads ptxas's report: the
CPU check that the default mode compiles (the interpreter runs code the compiler refuses, e.g. an early
return inside an if)."""

import os
import re

import pytest
import torch
import triton

from kernels.based import chunk
from kernels.based.sm90_report import compile_kernel, ptxas_report

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("kind", ["fwd", "dq", "dkv"])
def test_default_kernels_compile_for_sm90(kind):
    mode = chunk.FWD_EXPAND if kind == "fwd" else chunk.BWD_EXPAND
    BK, BV, BC, warps, stages = chunk._config(16, 64, torch.bfloat16, "fwd" if kind == "fwd" else "bwd")
    kernel = compile_kernel(kind, mode, BV, BC, warps, stages, states=True)
    assert "ttng.warp_group_dot" in kernel.asm["ttgir"]  # the [pairs, BC] x [BC, BV] state update is a wgmma
    report = ptxas_report(kernel.asm["ptx"])
    used = int(report.split("Used ")[1].split(" registers")[0])
    assert 0 < used <= 255, report


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("kind", ["split_state", "split_output", "split_reverse", "split_dq", "split_dv", "split_dk",
                                  "split_prefix", "split_features", "split_chain"])
def test_split_kernels_compile_for_sm90_within_their_register_caps(kind):
    """The split forward's and backward's kernels at their default settings (kernels/based/split.py CONFIG),
    states on: they compile for sm_90a (the interpreter accepts code the compiler refuses), within the register cap
    CONFIG sets for their class (dv and dk as the two launches of CONFIG["dkv_apart"]). Spills under the cap are
    allowed: the caps were measured faster on the H200 with Triton 3.6, whose spills differ from this Triton's."""
    from kernels.based.split import CONFIG

    state = kind in ("split_state", "split_reverse")
    loop = {"split_output": "output", "split_dq": "dq", "split_dv": "dv", "split_dk": "dk", "split_state": "state",
            "split_reverse": "state"}.get(kind, "none")
    cap = CONFIG["state_maxnreg"] if state else CONFIG["output_maxnreg"] if kind == "split_output" else \
        None if kind in ("split_prefix", "split_features") else CONFIG["features_maxnreg"] if kind == "split_chain" \
        else CONFIG["grads_maxnreg"]
    kernel = compile_kernel(kind, 5, CONFIG["BV"], CONFIG["BC"], CONFIG["state_warps" if state else "output_warps"],
                            states=True, NP=CONFIG["NP"], OP=CONFIG["OP"], NS=CONFIG["NS"],
                            prefetch=CONFIG["prefetch"], gather=CONFIG["gather"], maxnreg=cap,
                            G=CONFIG.get(f"{loop}_chunks", 1), chunk_stages=CONFIG.get(f"{loop}_stages", 1))
    report = ptxas_report(kernel.asm["ptx"])
    used = int(report.split("Used ")[1].split(" registers")[0])
    assert 0 < used <= (cap or 255), report


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("kind", ["fwd", "dq", "dkv", "split_output", "split_features", "split_reverse", "split_dq",
                                  "split_dv", "split_dk"])
def test_kernels_compile_with_an_fp64_scale(kind):
    """torch.compile's inductor launches the kernels with the Python float `scale` typed fp64, not fp32 as Triton's
    own launcher does; each kernel casts it to fp32 first (without that, the fused dk/dv kernel's loop-carried fp32
    accumulator turned fp64 and failed to compile: experiments/LOG.md, session 12)."""
    from kernels.based.split import CONFIG

    if kind in ("fwd", "dq", "dkv"):
        BK, BV, BC, warps, stages = chunk._config(16, 64, torch.bfloat16, "fwd" if kind == "fwd" else "bwd")
        kernel = compile_kernel(kind, 5, BV, BC, warps, stages, states=True, scale_dtype="fp64")
    else:
        kernel = compile_kernel(kind, 5, CONFIG["BV"], CONFIG["BC"], 4, states=True, NP=CONFIG["NP"], OP=CONFIG["OP"],
                                scale_dtype="fp64")
    assert "cvt.rn.f32.f64" in kernel.asm["ptx"]  # the one conversion, at the top
    assert ".f64" not in kernel.asm["ptx"].replace("cvt.rn.f32.f64", "").replace(".param .f64", "")


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("kind", ["fwd", "dq", "dkv"])
def test_fp32_kernels_use_the_tensor_cores(kind):
    """fp32 inputs take the fused kernels with tf32x3 dots (chunk.FP32_DOT): they compile for sm_90a and their state
    dots are wgmmas, where "ieee" dots run as FMAs on the vector units (54x slower than bf16 on the H200,
    experiments/LOG.md, session 13)."""
    mode = chunk.FWD_EXPAND if kind == "fwd" else chunk.BWD_EXPAND
    BK, BV, BC, warps, stages = chunk._config(16, 64, torch.float32, "fwd" if kind == "fwd" else "bwd")
    kernel = compile_kernel(kind, mode, BV, BC, warps, stages, states=True, dot=chunk._dot_mode(torch.float32))
    assert "ttng.warp_group_dot" in kernel.asm["ttgir"]
    assert kernel.metadata.shared <= 232448  # the H200's shared memory per block (K=32 overflows it: ieee there)
    report = ptxas_report(kernel.asm["ptx"])
    assert 0 < int(report.split("Used ")[1].split(" registers")[0]) <= 255, report


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("BC", [32, 64])
def test_fp16_forward_uses_fp16_wgmma(BC):
    """fp16 inputs: the fused forward's dots take fp16 operands (chunk.FP16_DOT) as wgmmas, within the H200's shared
    memory and 255 registers, at the chunk of fp16's config (32) and of bf16's (64)."""
    BK, BV, _, warps, stages = chunk._config(16, 64, torch.float16, "fwd")
    kernel = compile_kernel("fwd", chunk.FWD_EXPAND, BV, BC, warps, stages, states=True,
                            dot=chunk._fused_forward_dot(torch.float16))
    wgmma = set(re.findall(r"wgmma\.mma_async[\w.]*", kernel.asm["ptx"]))
    assert wgmma and all(w.endswith(".f32.f16.f16") for w in wgmma), wgmma  # no tf32 (k8) left
    assert kernel.metadata.shared <= 232448
    report = ptxas_report(kernel.asm["ptx"])
    assert 0 < int(report.split("Used ")[1].split(" registers")[0]) <= 255, report
