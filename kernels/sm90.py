"""Compile a Based kernel for an H100/H200 (sm_90a) on any machine, GPU or not, and report what the compiler made
of it: dot instructions (wgmma vs mma.sync), layout conversions and shared-memory allocations per program (Triton's
TTGIR), and registers and spills (ptxas). The GPU-free half of kernel work: a change that spills or lowers its dots
to mma.sync where it meant wgmma shows here before it is timed, and an unchanged PTX proves a refactor harmless.

    python -m kernels.sm90 [--kernel fwd|dq|dkv] [--k2-rows] [--bv 32] [--bc 64] [--warps 4] [--states]
        [--maxnreg 168]

Uses the ptxas that ships with Triton (ptxas-blackwell where the bundled ptxas is older than the PTX Triton emits).
The counts are per kernel at the benchmark's constexprs H=16, K=16, V=64, bf16 operands, normalised output.
"""

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.based.fused as fused

KERNELS = {
    # name: (the kernel, its bf16 pointers; every other pointer is fp32, the scalars are scale, T and SEG)
    "fwd": (fused._fwd_kernel, ("q", "k", "v", "o")),
    "dq": (fused._bwd_dq_kernel, ("q", "k", "v", "do")),
    "dkv": (fused._bwd_dkv_kernel, ("q", "k", "v", "do", "dv")),
}


def compile_kernel(kind: str, pair_rows: bool, BV: int, BC: int, warps: int, stages: int = 2, states: bool = False,
                   maxnreg: int | None = None, scale_dtype: str = "fp32", dot: int = 2):
    """Compile one of KERNELS for sm_90a at H=16, K=16, V=64, normalised; `states` turns on the state inputs and
    outputs (their loads and stores compiled too); pair_rows: the fused kernels' order-2 layout (PAIR_ROWS; False:
    the K² rows); maxnreg: a register cap per thread; scale_dtype: the scalar type of `scale` ("fp64" is what
    torch.compile's inductor passes for a Python float); dot: the kernels' DOT (primitives.DOT_*: 2 for bf16 inputs,
    4 for fp16 inputs; any other compiles for fp32 inputs, every tensor fp32)."""
    fn, bf16 = KERNELS[kind]
    const = dict(H=16, K=16, V=64, BK=16, BV=BV, BC=BC, NORMALIZE=True, DOT=dot, PAIR_ROWS=pair_rows, STATE_ONLY=False,
                 USE_H0=states, STORE_HT=states, USE_DHT=states, STORE_DH0=states)
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name == "scale":
            sig[name] = scale_dtype
        elif name in ("T", "SEG"):
            sig[name] = "i32"
        else:
            sig[name] = {2: "*bf16", 4: "*fp16"}.get(dot, "*fp32") if name in bf16 else "*fp32"
    constexprs = {(fn.arg_names.index(k),): v for k, v in const.items() if k in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=constexprs)
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gluon_forward(states: bool = False):
    """kernels/based/gluon.py's forward for sm_90a at H=16 (its default partition of 4 warps and two producers of
    4): `states` False, the inference forward, or True, storing every second chunk's state for the Gluon backward (and
    taking the state in and out)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from kernels.based import gluon

    sig = {n: "*bf16" for n in "qkvo"} | {n: "*fp32" for n in ("h0", "z0", "hT", "zT")} | {"hs": "*bf16", "zs": "*fp32"}
    sig |= {"den": "*fp32", "T": "i32", "scale": "fp32"}
    # the stored states' TMA descriptor (its type only: a descriptor over a host buffer of the states' tile layout)
    sig["hs_desc"] = mangle_type(gluon.TensorDescriptor.from_tensor(
        torch.empty(64, 3 * 64, dtype=torch.bfloat16), gluon._STATES_BLOCK, gluon._STATES_LAYOUT))
    # v's TMA descriptor ([B, T, H·V] in [1, 64, 64] boxes)
    sig["v_desc"] = mangle_type(gluon.TensorDescriptor.from_tensor(
        torch.empty(2, 128, 16 * 64, dtype=torch.bfloat16), [1, 64, 64], gluon._V_LAYOUT))
    sig = {n: sig.get(n, "constexpr") for n in gluon._gluon_fwd_kernel.arg_names}
    # pointers 16-byte aligned, as a launch from PyTorch tensors specialises them
    fn = gluon._gluon_fwd_kernel
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = GluonASTSource(fn, sig, constexprs={
        "H": 16, "USE_H0": states, "STORE_HT": states, "STORE_STATES": states, "NSLOT": 2,
        "PRODUCER_REGS": gluon.PRODUCER_REGS}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def compile_gluon_backward(kind: str = "dkv", states: bool = False):
    """kernels/based/gluon_backward.py's kernels for sm_90a at H=16: "dq" (one program per chunk) or "dkv" (the
    reverse walk: a producer of 4 warps beside the default partition of 4), with or without the state gradients."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.based import gluon_backward as gb

    if kind == "dq":
        sig = {n: "*bf16" for n in ("q", "k", "v", "do", "o")} | {"den": "*fp32", "hs": "*bf16", "zs": "*fp32"}
        sig |= {"mats": "*bf16", "dq": "*bf16", "g_out": "*bf16", "e_out": "*fp32", "T": "i32",
                "scale": "fp32", "BH": "i32", "H": "constexpr"}
        fn, constexprs = gb._dq_kernel, {"H": 16}
    else:
        sig = {n: "*bf16" for n in ("q", "k", "v", "g")} | {"e": "*fp32", "mats": "*bf16"}
        sig |= {"dk": "*bf16", "dv": "*bf16"} | {n: "*fp32" for n in ("dhT", "dzT", "dh0", "dz0")}
        sig |= {"T": "i32", "scale": "fp32"}
        sig |= {n: "constexpr" for n in ("H", "USE_DHT", "STORE_DH0", "NSLOT", "PRODUCER_REGS", "DK_REGS")}
        fn, constexprs = gb._dkv_kernel, {"H": 16, "USE_DHT": states, "STORE_DH0": states, "NSLOT": 2,
                                          "PRODUCER_REGS": gb.PRODUCER_REGS, "DK_REGS": gb.DK_REGS}
    # pointers 16-byte aligned, as a launch from PyTorch tensors specialises them
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = GluonASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def ptxas_report(ptx: str) -> str:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for exe in ("ptxas", "ptxas-blackwell"):
            r = subprocess.run([os.path.join(bindir, exe), "-v", "--gpu-name=sm_90a", path, "-o", path + ".cubin"],
                               capture_output=True, text=True)
            if r.returncode == 0:
                lines = (r.stdout + r.stderr).splitlines()
                kept = [line.split(":", 1)[-1].strip() for line in lines if "regist" in line or "spill" in line]
                return "; ".join(kept)
    return "ptxas failed: " + (r.stdout + r.stderr).strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=sorted(KERNELS), default="fwd")
    p.add_argument("--k2-rows", action="store_true", help="the fused kernels' order 2 as K² rows (default: pairs)")
    p.add_argument("--bv", type=int, default=32)
    p.add_argument("--bc", type=int, default=64)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--states", action="store_true", help="with the state inputs and outputs")
    p.add_argument("--maxnreg", type=int, default=None, help="register cap per thread")
    args = p.parse_args()
    k = compile_kernel(args.kernel, not args.k2_rows, args.bv, args.bc, args.warps, states=args.states,
                       maxnreg=args.maxnreg)
    ttgir = k.asm["ttgir"]
    print(f"{args.kernel} {'K² rows' if args.k2_rows else 'pair rows'} BV={args.bv} BC={args.bc} warps={args.warps}: "
          f"wgmma {ttgir.count('ttng.warp_group_dot ')}, "
          f"mma.sync/fma dots {len(re.findall(r'= tt[.]dot ', ttgir))}, "
          f"layout conversions {ttgir.count('ttg.convert_layout')}, "
          f"shared allocations {ttgir.count('ttg.local_alloc')}")
    print(f"ptxas sm_90a: {ptxas_report(k.asm['ptx'])}")


if __name__ == "__main__":
    main()
