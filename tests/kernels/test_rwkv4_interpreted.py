"""RWKV-4's WKV in Triton (kernels/rwkv4/wkv.py) on the CPU through the interpreter, fp32: against the float64
recurrence (kernels/rwkv4/naive.py, the loop `RWKV4.step` runs) on outputs, final state and every gradient (k,
v, time_decay through w = −exp(time_decay), time_first, the initial state); against the mixer's chunked PyTorch
form; and `RWKV4(impl="triton")` against the mixer protocol (forward == step loop, chunked prefill, decode).
Each case is its own item; tests/kernels/conftest.py runs them in a child process under TRITON_INTERPRET=1 where
this process was started without it."""

import pytest
import torch

from kernels.rwkv4.naive import wkv4_naive
from kernels.rwkv4.wkv import _bwd_op, _fwd_op, wkv4
from kernels.testing import assert_close
from zoo.models.mixers.rwkv4 import RWKV4

# (B, T, d, initial state, k scale): one token; T odd and not a multiple of the chunked form's 8; d over several
# channel blocks of 64 with a ragged last one; keys ×30, where e^k overflows fp32 without the running maximum.
CASES = [(1, 1, 8, False, 1), (2, 15, 70, True, 1), (2, 64, 33, False, 1), (1, 100, 16, True, 30),
         (2, 37, 70, False, 30)]
IDS = [f"B{b}-T{t}-d{d}-state{s}-k{m}" for b, t, d, s, m in CASES]


def inputs(B, T, d, with_state, k_scale, seed=0):
    """k, v [B, T, d], time_decay, time_first [d] (RWKV4's initial ranges), a state (a, b ≥ 1, p) or None."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, T, d, generator=g) * k_scale, torch.randn(B, T, d, generator=g)
    time_decay, time_first = torch.rand(d, generator=g) * 8 - 5, torch.randn(d, generator=g) * 0.5 - 1.2
    state = None
    if with_state:
        state = (torch.randn(B, d, generator=g), torch.rand(B, d, generator=g) + 1, torch.randn(B, d, generator=g))
    return (k, v, time_decay, time_first), state


def weights(B, T, d, seed=1):
    """Random weights of the loss Σ gy·wkv + Σ g·(a, b, p)_final, so every output's gradient is checked."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g), [torch.randn(B, d, generator=g) for _ in range(3)]


def run(fn, xs, state, gy, gs, dtype):
    """fn(k, v, w, u, state) in `dtype` -> [wkv, a, b, p, dk, dv, dtime_decay, dtime_first, (da0, db0, dp0)]."""
    xs = [x.to(dtype, copy=True).requires_grad_() for x in xs]  # new leaves: no gradient adds up across runs
    st = None if state is None else [x.to(dtype, copy=True).requires_grad_() for x in state]
    k, v, time_decay, time_first = xs
    y, final = fn(k, v, -torch.exp(time_decay), time_first, st)
    loss = (y * gy.to(y.dtype)).sum() + sum((f * g.to(f.dtype)).sum() for f, g in zip(final, gs))
    loss.backward()
    return [y, *final] + [x.grad for x in xs] + ([] if st is None else [x.grad for x in st])


NAMES = ["wkv", "a_T", "b_T", "p_T", "dk", "dv", "dtime_decay", "dtime_first", "da0", "db0", "dp0"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_wkv4_matches_the_recurrence(case):
    xs, state = inputs(*case)
    gy, gs = weights(*case[:3])
    ref = run(wkv4_naive, xs, state, gy, gs, torch.float64)
    base = run(wkv4_naive, xs, state, gy, gs, torch.float32)  # the loop in fp32: the error fp32 allows
    got = run(wkv4, xs, state, gy, gs, torch.float32)
    assert len(got) == len(ref) == (11 if state else 8)
    for name, a, r, b in zip(NAMES, got, ref, base):
        assert_close(name, a, r, b, torch.float32)


def chunked_run(impl, xs, state, gy, dtype):
    """RWKV4._wkv of `impl` with the loss Σ gy·wkv -> [wkv, (a, b, p)_final, dk, dv, dtime_decay, dtime_first]."""
    k, v, time_decay, time_first = (x.to(dtype, copy=True).requires_grad_() for x in xs)
    mixer = RWKV4(k.shape[2], impl=impl).to(dtype)
    with torch.no_grad():
        mixer.time_decay.copy_(time_decay)
        mixer.time_first.copy_(time_first)
    st = None if state is None else dict(zip("abp", (x.to(dtype).clone() for x in state)))
    y = mixer._wkv(k, v, st)
    (y * gy.to(y.dtype)).sum().backward()
    final = [] if st is None else [st[key] for key in "abp"]
    return [y, *final, k.grad, v.grad, mixer.time_decay.grad, mixer.time_first.grad]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_wkv4_matches_the_chunked_form(case):
    """The Triton impl and the default (chunked) impl through the same `RWKV4._wkv` call: outputs, the state it
    leaves, and the gradients of the outputs. The chunked form in float64 is the reference; the error allowed is
    the fp32 recurrence's, the kernel's specification (with keys ×30 it is ~10× the chunked form's in fp32)."""
    xs, state = inputs(*case)
    gy, gs = weights(*case[:3])
    ref = chunked_run("naive", xs, state, gy, torch.float64)
    recurrence = run(wkv4_naive, xs, state, gy, [torch.zeros_like(g) for g in gs], torch.float32)
    base = recurrence[: 4 if state else 1] + recurrence[4:8]
    got = chunked_run("triton", xs, state, gy, torch.float32)
    names = ["wkv", "a_T", "b_T", "p_T"][: 4 if state else 1] + ["dk", "dv", "dtime_decay", "dtime_first"]
    assert len(got) == len(ref) == len(names)
    for name, a, r, b in zip(names, got, ref, base):
        assert_close(name, a, r, b, torch.float32)


@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "state"])
def test_vmapped_wkv4_equals_a_loop_over_members(with_state):
    """torch.func.vmap over 3 members (own k, v, decay, bonus and state each) is one launch with the members as
    channels; outputs and the gradients torch.autograd.grad takes outside the vmap equal each member's own call."""
    n = 3
    members = [inputs(2, 9, 5, with_state, 1, seed=10 + m) for m in range(n)]
    xs = [torch.stack([mem[0][i] for mem in members]).requires_grad_() for i in range(4)]
    st = [torch.stack([mem[1][i] for mem in members]).requires_grad_() for i in range(3)] if with_state else []

    def one(k, v, time_decay, time_first, *state):
        y, final = wkv4(k, v, -torch.exp(time_decay), time_first, tuple(state) if state else None)
        return y, *final

    outs = torch.func.vmap(one)(*xs, *st)
    g = torch.Generator().manual_seed(20)
    ws = [torch.randn(o.shape, generator=g) for o in outs]
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, ws)), xs + st)
    for m in range(n):
        mx = [x[m].detach().clone().requires_grad_() for x in xs]
        ms = [x[m].detach().clone().requires_grad_() for x in st]
        ref = one(*mx, *ms)
        ref_grads = torch.autograd.grad(sum((o * w[m]).sum() for o, w in zip(ref, ws)), mx + ms)
        for name, a, b in zip(NAMES, [o[m] for o in outs], ref):
            torch.testing.assert_close(a, b, msg=f"member {m}: {name}")
        for i, (a, b) in enumerate(zip(grads, ref_grads)):
            torch.testing.assert_close(a[m], b, msg=f"member {m}: gradient of input {i}")


def test_wkv4_custom_ops_pass_opcheck():
    """Schemas, fake implementations and the autograd registration are consistent (what torch.compile needs)."""
    (k, v, time_decay, time_first), state = inputs(2, 5, 20, True, 1)
    w = -torch.exp(time_decay)
    a0, b0, p0 = state
    torch.library.opcheck(_fwd_op, (k.requires_grad_(), v, w, time_first, a0, b0, p0, True))
    torch.library.opcheck(_fwd_op, (k.detach(), v, w, time_first, None, None, None, False))
    y, s, aT, bT, pT = _fwd_op(k.detach(), v, w, time_first, a0, b0, p0, True)
    torch.library.opcheck(_bwd_op, (k.detach(), v, w, time_first, s, aT, bT, pT, torch.randn_like(y), a0, b0, p0))


def test_wkv4_without_gradient_keeps_no_states():
    (k, v, time_decay, time_first), _ = inputs(2, 5, 20, False, 1)
    with torch.no_grad():
        y, _ = wkv4(k, v, -torch.exp(time_decay), time_first)
        _, s, *_ = _fwd_op(k, v, -torch.exp(time_decay), time_first, None, None, None, False)
    assert s.numel() == 0
    torch.testing.assert_close(y, wkv4_naive(k, v, -torch.exp(time_decay), time_first)[0], rtol=1e-5, atol=1e-6)


# The mixer protocol of tests/models/test_mixers.py for impl="triton", in fp32 (the kernel computes in fp32).
D_MODEL = 16
TOL = dict(rtol=1e-5, atol=1e-6)


def mixer(impl="triton"):
    torch.manual_seed(0)
    return RWKV4(D_MODEL, impl=impl)


def x_of(batch, T, seed=1):
    return torch.randn(batch, T, D_MODEL, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T", [1, 7, 33], ids=lambda T: f"T{T}")
def test_triton_mixer_forward_equals_step_loop(T):
    m, x = mixer(), x_of(2, T)
    with torch.no_grad():
        full = m(x)
        prefilled = m.init_state(2)
        m(x, prefilled)
        state = m.init_state(2)
        steps = torch.stack([m.step(x[:, t], state) for t in range(T)], dim=1)
    torch.testing.assert_close(steps, full, **TOL)
    for key in state:
        torch.testing.assert_close(prefilled[key], state[key], **TOL)


@pytest.mark.parametrize("splits", [(5, 28), (1, 31, 1), (9, 9, 15)], ids=lambda s: "+".join(map(str, s)))
def test_triton_mixer_chunks_with_state_equal_full_forward(splits):
    m, x = mixer(), x_of(2, sum(splits))
    with torch.no_grad():
        full = m(x)
        state = m.init_state(2)
        parts = [m(chunk, state) for chunk in torch.split(x, list(splits), dim=1)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, **TOL)


def test_triton_mixer_prefill_then_decode_equals_full_forward():
    m, x = mixer(), x_of(3, 30)
    with torch.no_grad():
        full = m(x)
        state = m.init_state(3)
        prefill = m(x[:, :11], state)
        decoded = [m.step(x[:, t], state) for t in range(11, 30)]
    assert m.state_size(30) == sum(t.numel() for t in state.values()) // 3
    torch.testing.assert_close(torch.cat([prefill, torch.stack(decoded, dim=1)], dim=1), full, **TOL)


def test_triton_mixer_gradients_equal_the_chunked_form():
    x = x_of(2, 21)
    grads = []
    for impl in ("naive", "triton"):
        m, xi = mixer(impl), x.clone().requires_grad_()
        m(xi).square().sum().backward()
        grads.append({"x": xi.grad, **{name: p.grad for name, p in m.named_parameters()}})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)
