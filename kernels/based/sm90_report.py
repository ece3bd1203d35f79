"""Compile the Based forward kernel for an H100/H200 (sm_90a) on any machine, GPU or not, and report what
the compiler made of it: dot instructions (wgmma vs mma.sync), layout conversions and shared-memory
allocations per program (Triton's TTGIR), and registers and spills (ptxas). The GPU-free half of kernel work:
a variant that spills or lowers its dots to mma.sync where it meant wgmma shows here before it is timed.

    python -m kernels.based.sm90_report [--mode 3] [--bv 32] [--bc 64] [--warps 4]

Uses the ptxas that ships with Triton (ptxas-blackwell where the bundled ptxas is older than the PTX Triton
emits). The counts are per kernel (the chunk loop body dominates), at B·T·H-independent constexprs
H=16, K=16, V=64, bf16 operands, normalised output, no state in or out.
"""

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.based.chunk as chunk


def compile_forward(mode: int, BV: int, BC: int, warps: int, stages: int = 2):
    fn = chunk._fwd_kernel
    ptrs = {n: "*bf16" for n in ("q", "k", "v", "o")} | {n: "*fp32" for n in ("den", "hv0", "hz0", "hvT", "hzT")}
    const = dict(H=16, K=16, V=64, BK=16, BV=BV, BC=BC, USE_H0=False, STORE_HT=False, NORMALIZE=True, DOT=2,
                 EXPAND=mode, STATE_ONLY=False)
    sig = {}
    for name in fn.arg_names:
        sig[name] = ptrs.get(name) or ("fp32" if name == "scale" else "i32" if name in ("T", "SEG") else "constexpr")
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


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
    p.add_argument("--mode", type=int, default=chunk.FWD_EXPAND, help="order-2 mode (chunk.py): 0, 1, 2, 3 or 5")
    p.add_argument("--bv", type=int, default=32)
    p.add_argument("--bc", type=int, default=64)
    p.add_argument("--warps", type=int, default=4)
    args = p.parse_args()
    k = compile_forward(args.mode, args.bv, args.bc, args.warps)
    ttgir = k.asm["ttgir"]
    print(f"mode {args.mode} BV={args.bv} BC={args.bc} warps={args.warps}: "
          f"wgmma {ttgir.count('ttng.warp_group_dot ')}, "
          f"mma.sync/fma dots {len(re.findall(r'= tt[.]dot ', ttgir))}, "
          f"layout conversions {ttgir.count('ttg.convert_layout')}, "
          f"shared allocations {ttgir.count('ttg.local_alloc')}")
    print(f"ptxas sm_90a: {ptxas_report(k.asm['ptx'])}")


if __name__ == "__main__":
    main()
