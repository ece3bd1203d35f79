"""Mamba's selective scan in Triton (kernels/selective_scan/scan.py) on the CPU through the interpreter, fp32,
against the float64 loop: outputs, final state and every gradient (u, Δ, A, B, C, h0). Each case is its own
item; tests/kernels/conftest.py runs them in a child process under TRITON_INTERPRET=1 where this process was started
without it."""

import pytest
import torch

from kernels.selective_scan import selective_scan, selective_scan_naive
from kernels.testing import assert_close

# (B, T, D, N, initial state): a single token, odd sizes, several channel blocks (D > 64), N not a power of two
CASES = [(1, 1, 8, 16, False), (2, 7, 5, 3, True), (2, 33, 70, 16, True), (1, 64, 130, 4, False)]


def inputs(B, T, D, N, h0, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, Bm, Cm = torch.randn(B, T, D, generator=g), torch.randn(B, T, N, generator=g), torch.randn(B, T, N, generator=g)
    dt = torch.rand(B, T, D, generator=g) * 0.5 + 1e-3
    A = -(torch.rand(D, N, generator=g) * 2 + 0.1)
    return [u, dt, A, Bm, Cm, torch.randn(B, D, N, generator=g) if h0 else None]


def run(fn, xs, gy, gh):
    xs = [None if x is None else x.clone().requires_grad_() for x in xs]
    y, h = fn(*xs)
    ((y * gy.to(y.dtype)).sum() + (h * gh.to(h.dtype)).sum()).backward()
    return [y, h] + [x.grad for x in xs if x is not None]


@pytest.mark.parametrize("case", CASES, ids=[f"B{b}-T{t}-D{d}-N{n}-h0{h}" for b, t, d, n, h in CASES])
def test_selective_scan_matches_the_loop(case):
    xs = inputs(*case)
    B, T, D, N, _ = case
    g = torch.Generator().manual_seed(1)
    gy, gh = torch.randn(B, T, D, generator=g), torch.randn(B, D, N, generator=g)
    ref = run(selective_scan_naive, [None if x is None else x.double() for x in xs], gy.double(), gh.double())
    base = run(selective_scan_naive, xs, gy, gh)  # the loop in fp32: the error fp32 allows
    got = run(selective_scan, xs, gy, gh)
    names = ["y", "h_T", "du", "ddt", "dA", "dB", "dC", "dh0"]
    for name, a, r, b in zip(names, got, ref, base):
        if r.abs().max() == 0:  # dA with no initial state and T=1: exactly zero
            assert a.abs().max() == 0, name
            continue
        assert_close(name, a, r, b, torch.float32)


@pytest.mark.parametrize("h0", [False, True], ids=["no-h0", "h0"])
def test_compiled_scan_equals_eager(h0):
    """torch.compile calls the custom ops: outputs and every gradient equal the eager call's (a compiled Mamba LM
    once trained on wrong gradients, where dynamo traced the kernels itself)."""
    xs = inputs(2, 9, 8, 4, h0, seed=3)
    g = torch.Generator().manual_seed(4)
    gy, gh = torch.randn(2, 9, 8, generator=g), torch.randn(2, 8, 4, generator=g)
    eager = run(selective_scan, xs, gy, gh)
    compiled = run(torch.compile(selective_scan, fullgraph=True), xs, gy, gh)
    for name, a, b in zip(["y", "h_T", "du", "ddt", "dA", "dB", "dC", "dh0"], compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("h0", [False, True], ids=["no-h0", "h0"])
def test_vmapped_scan_equals_a_loop_over_members(h0):
    """torch.func.vmap over 3 members (own u, Δ, A, B, C, h0 each) is one launch with each member's A; outputs
    and the gradients torch.autograd.grad takes outside the vmap equal each member's own call."""
    n = 3
    members = [inputs(2, 9, 6, 3, h0, seed=20 + m) for m in range(n)]
    xs = [torch.stack([mem[i] for mem in members]).requires_grad_() for i in range(6 if h0 else 5)]
    ys, hs = torch.func.vmap(selective_scan)(*xs)
    g = torch.Generator().manual_seed(30)
    gy, gh = torch.randn(ys.shape, generator=g), torch.randn(hs.shape, generator=g)
    grads = torch.autograd.grad((ys * gy).sum() + (hs * gh).sum(), xs)
    for m in range(n):
        mx = [x[m].detach().clone().requires_grad_() for x in xs]
        y, h = selective_scan(*mx)
        ref = torch.autograd.grad((y * gy[m]).sum() + (h * gh[m]).sum(), mx)
        torch.testing.assert_close(ys[m], y, msg=f"member {m}: y")
        torch.testing.assert_close(hs[m], h, msg=f"member {m}: h_T")
        for name, a, b in zip(["du", "ddt", "dA", "dB", "dC", "dh0"], grads, ref):
            torch.testing.assert_close(a[m], b, msg=f"member {m}: {name}")


def test_vmapped_scan_with_a_shared_A_equals_a_loop():
    """A not batched (every member shares it) takes the op's single-A path."""
    members = [inputs(2, 7, 5, 3, False, seed=40 + m) for m in range(2)]
    A = members[0][2]
    xs = [torch.stack([mem[i] for mem in members]) for i in (0, 1, 3, 4)]
    ys, _ = torch.func.vmap(selective_scan, in_dims=(0, 0, None, 0, 0))(xs[0], xs[1], A, xs[2], xs[3])
    for m in range(2):
        torch.testing.assert_close(ys[m], selective_scan(xs[0][m], xs[1][m], A, xs[2][m], xs[3][m])[0])


def test_forward_without_grad_keeps_no_states():
    xs = inputs(2, 5, 6, 3, True)
    with torch.no_grad():
        y, h = selective_scan(*xs)
    y_ref, h_ref = selective_scan_naive(*xs)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    out = torch.ops.zoo_selective_scan.fwd(*[x.contiguous() for x in xs], False, 16)
    assert out[1].numel() == 0


@pytest.mark.parametrize("chunk", [1, 3, 16, 33, 40])
def test_scan_keeps_one_state_per_chunk_and_recomputes_the_rest(chunk):
    """With a backward to come the forward keeps the state before every chunk-th token ([B, ⌈T/chunk⌉, D, N]), not
    every h_t; the backward recomputes the rest. Every chunk length, dividing T or not, gives the outputs and
    gradients of chunk = 1 (every state kept)."""
    xs = [x.requires_grad_() for x in inputs(2, 33, 70, 16, True, seed=5)]
    out = torch.ops.zoo_selective_scan.fwd(*[x.contiguous() for x in xs], True, chunk)
    assert out[1].shape == (2, -(-33 // chunk), 70, 16)
    g = torch.Generator().manual_seed(6)
    gy, gh = torch.randn(2, 33, 70, generator=g), torch.randn(2, 70, 16, generator=g)
    every = run(lambda *a: selective_scan(*a, chunk=1), [x.detach() for x in xs], gy, gh)
    got = run(lambda *a: selective_scan(*a, chunk=chunk), [x.detach() for x in xs], gy, gh)
    for name, a, b in zip(["y", "h_T", "du", "ddt", "dA", "dB", "dC", "dh0"], got, every):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_scan_ops_pass_opcheck():
    xs = [x.requires_grad_() for x in inputs(2, 5, 6, 3, True)]
    torch.library.opcheck(torch.ops.zoo_selective_scan.fwd, (*xs, True, 2), test_utils=(
        "test_schema", "test_faketensor", "test_autograd_registration"))


def test_selective_scan_rejects_bad_shapes():
    u, dt, A, Bm, Cm, _ = inputs(1, 4, 6, 3, False)
    with pytest.raises(ValueError, match=r"A must be \[D, N\]"):
        selective_scan(u, dt, A[:, :2], Bm, Cm)
    with pytest.raises(ValueError, match="selective_scan: u, dt"):
        selective_scan(u, dt[:, :3], A, Bm, Cm)
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        selective_scan(u, dt, A, Bm, Cm, chunk=0)


@pytest.mark.parametrize("scan_chunk", [None, 5], ids=["default-chunk", "chunk5"])
def test_mamba_mixer_triton_matches_naive(scan_chunk):
    """Mamba(impl="triton") against Mamba(impl="naive") with the same weights, fp32: forward and input gradient,
    then prefill with a state followed by decode steps (one-token scans through the kernel)."""
    from zoo.models.mixers.mamba import Mamba

    torch.manual_seed(0)
    naive, triton_ = Mamba(32, d_state=6), Mamba(32, d_state=6, impl="triton", scan_chunk=scan_chunk)
    triton_.load_state_dict(naive.state_dict())
    x = torch.randn(2, 21, 32)
    outs = []
    for m in (naive, triton_):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.square().sum().backward()
        state = m.init_state(2)
        with torch.no_grad():
            pre = m(x[:, :13], state)
            steps = torch.stack([m.step(x[:, t], state) for t in range(13, 21)], 1)
        outs.append((y.detach(), xi.grad, torch.cat([pre, steps], 1), state["ssm"]))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[1][2], outs[0][0], rtol=1e-4, atol=1e-5)  # prefill + decode == forward
