"""The scan's kernels compiled for sm_90a without a GPU (the interpreter, test_selective_scan_interpreted.py, accepts
code that the compiler refuses)."""

import os

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.selective_scan import scan

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_selective_scan_compiles_for_sm90(kind):
    fn = scan._fwd_kernel if kind == "fwd" else scan._bwd_kernel
    BD, BN = scan._blocks(256, 16)
    const = dict(D=256, N=16, BD=BD, BN=BN, CHUNK=scan.CHUNK, USE_H0=True, USE_DHT=True, SAVE=True)
    ints = ("T", "B", "BPG", "NC", "NDB")
    sig = {n: "constexpr" if n in const else "i32" if n in ints else "*fp32" for n in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in const.items() if k in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert ".entry" in kernel.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [63, 1000])
def test_selective_scan_gpu(T):
    """On a CUDA GPU: the kernel against the float64 loop (outputs, state, every gradient), Fig. 2's width."""
    import torch

    from kernels.selective_scan import selective_scan, selective_scan_naive
    from kernels.testing import assert_close

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, D, N = 4, 256, 16
    xs = [
        torch.randn(B, T, D, device="cuda", generator=g),
        torch.rand(B, T, D, device="cuda", generator=g) * 0.5,
        -(torch.rand(D, N, device="cuda", generator=g) + 0.1),
        torch.randn(B, T, N, device="cuda", generator=g),
        torch.randn(B, T, N, device="cuda", generator=g),
        torch.randn(B, D, N, device="cuda", generator=g),
    ]
    gy, gh = torch.randn(B, T, D, device="cuda", generator=g), torch.randn(B, D, N, device="cuda", generator=g)

    def run(fn, inputs):
        inputs = [x.clone().requires_grad_() for x in inputs]
        y, h = fn(*inputs)
        ((y * gy.to(y.dtype)).sum() + (h * gh.to(h.dtype)).sum()).backward()
        return [y, h] + [x.grad for x in inputs]

    ref = run(selective_scan_naive, [x.double() for x in xs])
    base = run(selective_scan_naive, xs)
    for name, a, r, b in zip(["y", "h_T", "du", "ddt", "dA", "dB", "dC", "dh0"], run(selective_scan, xs), ref, base):
        assert_close(name, a, r, b, torch.float32)
