"""Runs interpreted_selective_scan.py in a fresh process with TRITON_INTERPRET=1, and compiles the scan's
kernels for sm_90a without a GPU (the interpreter accepts code that the compiler refuses)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.selective_scan import scan

HERE = Path(__file__).parent
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def test_selective_scan_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(HERE.parents[1]),
         str(HERE / "interpreted_selective_scan.py")],
        env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=900)  # fmt: skip
    report = proc.stdout[-20000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, f"interpreted selective-scan tests failed:\n{report}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], report


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_selective_scan_compiles_for_sm90(kind):
    fn = scan._fwd_kernel if kind == "fwd" else scan._bwd_kernel
    BD, BN = scan._blocks(256, 16)
    const = dict(D=256, N=16, BD=BD, BN=BN, USE_H0=True, USE_DHT=True)
    sig = {n: "constexpr" if n in const else "i32" if n in ("T", "B") else "*fp32" for n in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in const.items() if k in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert ".entry" in kernel.asm["ptx"]
