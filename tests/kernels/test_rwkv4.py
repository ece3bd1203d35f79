"""RWKV-4's WKV kernels compiled for sm_90a without a GPU, the checks of `wkv4`'s inputs, and on a CUDA GPU the
kernel in bf16 and fp32 against the float64 recurrence and `RWKV4(impl="triton")` compiled. The interpreted CPU
tests are in test_rwkv4_interpreted.py."""

import os

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.rwkv4 import wkv
from kernels.rwkv4.naive import wkv4_naive
from kernels.testing import assert_close
from zoo.models.mixers.rwkv4 import RWKV4

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_wkv4_compiles_for_sm90(kind, dtype):
    fn = wkv._fwd_kernel if kind == "fwd" else wkv._bwd_kernel
    BD, _ = wkv._blocks(512)
    const = dict(D=512, BD=BD, USE_STATE=True, SAVE=True, USE_DSTATE=True)
    sig = {n: "constexpr" if n in const else "i32" if n == "T" else f"*{dtype}" if n in ("k", "v", "gk", "gv")
           else "*fp32" for n in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in const.items() if k in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert ".entry" in kernel.asm["ptx"]


def good_inputs():
    return torch.randn(2, 5, 8), torch.randn(2, 5, 8), -torch.rand(8), torch.randn(8)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"v": torch.randn(2, 4, 8)}, ValueError, r"k and v must both be \[B, T, d\]"),
        ({"w": torch.randn(7)}, ValueError, r"w and u must be \[d\]"),
        ({"state": (torch.zeros(2, 8),) * 2}, ValueError, "state must be"),
        ({"k": torch.randn(2, 5, 8, dtype=torch.float64)}, TypeError, "computes in fp32"),
    ],
    ids=["v-shape", "w-shape", "state-parts", "float64"],
)
def test_wkv4_rejects_bad_inputs(change, error, message):
    k, v, w, u = good_inputs()
    args = {"k": k, "v": v, "w": w, "u": u, "state": None} | change
    with pytest.raises(error, match=message):
        wkv.wkv4(**args)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs CPU tensors")
def test_triton_mixer_on_cpu_says_what_it_needs():
    with pytest.raises(RuntimeError, match="needs CUDA tensors or TRITON_INTERPRET=1"):
        RWKV4(16, impl="triton")(torch.randn(1, 3, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [63, 1000], ids=lambda T: f"T{T}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_wkv4_gpu(dtype, T):
    """On a CUDA GPU at Fig. 2's widest d: wkv, final state and every gradient against the float64 recurrence,
    from a state, keys ×10. k, v arrive in `dtype` and their gradients leave in it, so the baseline of dk, dv is
    the fp32 recurrence's rounded to `dtype`; the rest is fp32."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, d = 4, 512

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=g) * scale

    leaves = [randn(B, T, d, scale=10).to(dtype), randn(B, T, d).to(dtype), randn(d).clamp(-5, 3), randn(d) - 1,
              randn(B, d), randn(B, d).abs() + 1, randn(B, d)]
    gy, gs = randn(B, T, d), [randn(B, d) for _ in range(3)]

    def run(fn, compute):
        xs = [(x.double() if compute == torch.float64 else x.clone()).requires_grad_() for x in leaves]
        k, v, time_decay, time_first, *state = xs
        if fn is not wkv.wkv4:  # the kernel takes k, v as they come
            k, v = k.to(compute), v.to(compute)
        w = -torch.exp(time_decay.to(compute))
        y, final = fn(k, v, w, time_first.to(compute), [x.to(compute) for x in state])
        ((y * gy.to(y.dtype)).sum() + sum((f * s.to(f.dtype)).sum() for f, s in zip(final, gs))).backward()
        return [y, *final] + [x.grad for x in xs]

    ref, base = run(wkv4_naive, torch.float64), run(wkv4_naive, torch.float32)
    names = ["wkv", "a_T", "b_T", "p_T", "dk", "dv", "dtime_decay", "dtime_first", "da0", "db0", "dp0"]
    for name, a, r, b in zip(names, run(wkv.wkv4, torch.float32), ref, base):
        assert_close(name, a, r, b, dtype if name in ("dk", "dv") else torch.float32)


@pytest.mark.gpu
def test_triton_mixer_compiles_and_matches_eager_gpu():
    """torch.compile traces the custom ops (fake impls, autograd): compiled forward+backward == eager, and the
    Triton impl == the chunked impl, in fp32 at a Fig. 2 shape."""
    torch.manual_seed(0)
    x = torch.randn(8, 64, 128, device="cuda")
    results = []
    for impl, compiled in (("naive", False), ("triton", False), ("triton", True)):
        torch.manual_seed(0)
        m = RWKV4(128, impl=impl).cuda()
        fn = torch.compile(m, fullgraph=True) if compiled else m
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.square().mean().backward()
        results.append([y.detach(), xi.grad, m.time_decay.grad, m.time_first.grad])
    for ref, got in ((results[0], results[1]), (results[1], results[2])):
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
