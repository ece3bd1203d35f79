"""Based Triton kernels on a CUDA GPU at real lengths, in bf16, fp16 and fp32 (skipped without CUDA).

Same checks as the interpreted CPU tests (outputs, final state, every gradient, the initial state's included;
chained calls; decode), at T up to 16384, against float64 references, with kernels/testing.py's rule. At
T=65536 the bar is absolute: everything finite and within 1e-2 of float64.
"""

import functools

import pytest
import torch
from based_cases import Case, check_against_naive, chunked_reference, make_inputs, nan_empty, run

from kernels.based import BasedConfig, chunk_based, fused_recurrent_based, naive_parallel_based, naive_recurrent_based
from kernels.testing import GPU_T, assert_close, rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DT_IDS = ["bf16", "fp16", "fp32"]
CASES = [Case(B=1, T=T, H=2, K=16, V=64) for T in GPU_T] + [
    Case(B=2, T=1000, H=2, K=16, V=112, scale=0.3),
    Case(B=1, T=4096, H=2, K=8, V=64, normalize=False),
    Case(B=1, T=1000, H=1, K=32, V=128, initial_state=False),
]


def forced(path):
    """chunk_based on one path (kernels/based/ops.py `BasedConfig`)."""
    return functools.partial(chunk_based, config=BasedConfig(path=path))


def _reference(case):
    # T×T in float64 stops fitting comfortably past 4K; the chunked form is the same function (CPU-tested)
    return naive_parallel_based if case.T <= 4096 else chunked_reference(1024)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_chunk_matches_naive_gpu(case, dtype):
    with nan_empty():
        check_against_naive(chunk_based, case, dtype, "cuda", reference=_reference(case))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_two_chained_calls_equal_one_gpu(dtype):
    case = Case(B=1, T=3000, H=2, K=16, V=64)
    split = 1111

    def chained(q, k, v, scale, initial_state, output_final_state, normalize):
        o1, mid = chunk_based(q[:, :split], k[:, :split], v[:, :split], scale, initial_state, True, normalize)
        o2, final = chunk_based(q[:, split:], k[:, split:], v[:, split:], scale, mid, output_final_state, normalize)
        return torch.cat([o1, o2], dim=1), final

    with nan_empty():
        check_against_naive(chained, case, dtype, "cuda")


def test_direct_launch_equals_the_jit_path_gpu(monkeypatch):
    """kernels/launch.py: from a key's second call on, kernels launch straight through their compiled launcher.
    Outputs, final state and every gradient are bit-identical to Triton's JIT path; misaligned inputs (another
    specialization) get their own compiled kernel and the same result."""
    from kernels import launch as L

    fn = forced("fused")
    case = Case(B=2, T=1000, H=2, K=16, V=64)
    inputs = make_inputs(case, "cuda")
    direct, stream, direct_ok = [], L._stream, L._direct_ok
    monkeypatch.setattr(L, "_stream", lambda device: direct.append(device) or stream(device))
    monkeypatch.setattr(L, "_direct_ok", lambda args: False)  # every launch through Triton's JIT path
    ref_out, ref_grad, cot = run(fn, inputs, case, torch.bfloat16)
    assert not direct
    reference = ref_out + list(ref_grad)
    monkeypatch.setattr(L, "_direct_ok", direct_ok)
    for _ in range(2):
        out, grad, _ = run(fn, inputs, case, torch.bfloat16, cot)
        for name, a, r in zip(("o", "kv", "k_sum", "dq", "dk", "dv", "dkv0", "dk_sum0"), out + list(grad), reference):
            assert torch.equal(a, r), name
    assert direct  # the second round launched straight through the compiled kernels

    def misaligned(q, k, v, **kwargs):
        def shift(x):  # the same values 2 bytes past a 16-byte boundary
            y = torch.empty(x.numel() + 8, dtype=x.dtype, device=x.device)[1 : x.numel() + 1].view(x.shape)
            return y.copy_(x)

        q, k, v = shift(q), shift(k), shift(v)
        assert q.data_ptr() % 16 != 0 and q.is_contiguous()
        return fn(q, k, v, **kwargs)

    out, grad, _ = run(misaligned, inputs, case, torch.bfloat16, cot)
    for a, r in zip(out + list(grad), reference):
        assert rel_error(a, r) <= 1e-3


def test_direct_launch_decode_equals_the_jit_path_gpu(monkeypatch):
    """Decode steps through kernels/launch.py's direct path update the state exactly as Triton's JIT path."""
    from kernels import launch as L

    case = Case(B=2, T=6, H=2, K=16, V=64)
    q, k, v, kv0, ks0 = (x.detach() for x in make_inputs(case, "cuda"))
    direct, stream, direct_ok = [], L._stream, L._direct_ok
    monkeypatch.setattr(L, "_stream", lambda device: direct.append(device) or stream(device))
    results = []
    for fast in (False, True):
        monkeypatch.setattr(L, "_direct_ok", direct_ok if fast else lambda args: False)
        kv, ks = kv0.float().clone(), ks0.float().clone()
        outs = [fused_recurrent_based(q[:, t].bfloat16(), k[:, t].bfloat16(), v[:, t].bfloat16(), (kv, ks))
                for t in range(case.T)]
        results.append((torch.stack(outs), kv, ks))
        assert bool(direct) == fast  # the steps after the first launched straight through the compiled kernel
    for a, r in zip(results[1], results[0]):
        assert torch.equal(a, r)


def test_65536_tokens_bf16():
    case = Case(B=1, T=65536, H=1, K=16, V=64)
    inputs = make_inputs(case, "cuda")
    ref_out, ref_grad, cot = run(chunked_reference(4096), inputs, case, torch.float64)
    out, grad, _ = run(chunk_based, inputs, case, torch.bfloat16, cot)
    names = ("o", "kv", "k_sum", "dq", "dk", "dv", "dkv0", "dk_sum0")
    for name, a, r in zip(names, out + list(grad), ref_out + list(ref_grad)):
        assert torch.isfinite(a).all(), f"{name} has inf or NaN"
        err = rel_error(a, r)
        assert err <= 1e-2, f"{name}: relative error {err:.3g} > 1e-2"


@pytest.mark.parametrize("case", [c for c in CASES if c.T in (1000, 4096) and c.K <= 16], ids=lambda c: c.id)
def test_fp16_fused_matches_naive_gpu(case):
    """fp16 through the fused kernels (fp16 operands in the forward, tf32 in the backward), which serve small fp16
    problems and other V: everything by the rule."""
    with nan_empty():
        check_against_naive(forced("fused"), case, torch.float16, "cuda", reference=_reference(case))


def test_65536_tokens_fp16_forward_large_state():
    """fp16 inputs, large and biased (k·4, v + 8: the order-2 state reaches ≈ 8e6, past fp16's 65504): the fused
    forward's fp16 operands read the state as S/n, so the output over 65536 tokens is finite and within 1e-2."""
    case = Case(B=1, T=65536, H=1, K=16, V=64, initial_state=False, final_state=False)
    q, k, v, _, _ = (x.detach() if x is not None else None for x in make_inputs(case, "cuda"))
    k, v = k * 4, v + 8
    ref, _ = chunked_reference(4096)(q, k, v)
    with torch.no_grad():
        o, _ = chunk_based(q.half(), k.half(), v.half())
    assert torch.isfinite(o).all()
    assert rel_error(o, ref) <= 1e-2, rel_error(o, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_decode_in_cuda_graph(dtype):
    """Capture one step in a CUDA graph and replay it over T tokens: equals the recurrent form."""
    case = Case(B=4, T=16, H=4, K=16, V=64)
    q, k, v, kv0, ks0 = (x.detach() for x in make_inputs(case, "cuda"))
    ref_o, (ref_kv, ref_ks) = naive_recurrent_based(q, k, v, initial_state=(kv0, ks0), output_final_state=True)
    base_o, (base_kv, base_ks) = naive_recurrent_based(q.to(dtype), k.to(dtype), v.to(dtype), initial_state=(
        kv0.float(), ks0.float()), output_final_state=True)
    state = (kv0.float().contiguous(), ks0.float().contiguous())
    q_t, k_t, v_t = (torch.zeros(case.B, case.H, d, device="cuda", dtype=dtype) for d in (case.K, case.K, case.V))
    o_t = torch.full((case.B, case.H, case.V), float("nan"), device="cuda", dtype=dtype)
    scratch = (state[0].clone(), state[1].clone())
    fused_recurrent_based(q_t, k_t, v_t, scratch, out=o_t)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        fused_recurrent_based(q_t, k_t, v_t, state, out=o_t)
    torch.cuda.current_stream().wait_stream(stream)
    outs = []
    for t in range(case.T):
        q_t.copy_(q[:, t]), k_t.copy_(k[:, t]), v_t.copy_(v[:, t])
        o_t.fill_(float("nan"))
        graph.replay()
        outs.append(o_t.clone())
    assert_close(f"decode {dtype} o", torch.stack(outs, 1), ref_o, base_o, dtype)
    assert_close(f"decode {dtype} kv", state[0], ref_kv, base_kv, dtype)
    assert_close(f"decode {dtype} k_sum", state[1], ref_ks, base_ks, dtype)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _count(monkeypatch, module, name, calls, tag=1):
    """Record every call of module.name (the kernels ops.py dispatches to) in calls."""
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(tag) or real(*a, **kw))


@pytest.mark.parametrize("path", ["fused", "gluon"])
def test_forward_backward_in_cuda_graph(path, monkeypatch):
    """A forward+backward captured in a CUDA graph and replayed, output and gradients by the rule against float64.
    fused: off Hopper (or in fp16 on it) the auto rule takes the fused kernels. gluon (Hopper): the Gluon forward and
    backward. Both eagerly and under capture."""
    from kernels.based import fused, gluon_backward

    if path == "gluon" and not HOPPER:
        pytest.skip("the Gluon kernels need a Hopper GPU (sm_90)")
    dt = torch.bfloat16 if path == "gluon" or not HOPPER else torch.float16
    taken = []
    _count(monkeypatch, gluon_backward if path == "gluon" else fused, "backward", taken)
    case = Case(B=1, T=300, H=2, K=16, V=64)
    q, k, v = (x.detach() for x in make_inputs(case, "cuda")[:3])
    do = torch.randn(q.shape[:3] + (case.V,), device="cuda", dtype=torch.float64)
    outs = {}
    for name, d in (("ref", torch.float64), ("base", dt)):
        qd, kd, vd = (x.to(d, copy=True).requires_grad_() for x in (q, k, v))
        o = naive_parallel_based(qd, kd, vd)[0]
        outs[name] = (o, *torch.autograd.grad(o, (qd, kd, vd), do.to(d)))
    # leaves: a cast recorded in the autograd graph outside the capture would replay on the legacy stream
    qs, ks, vs = (x.to(dt).requires_grad_() for x in (q, k, v))
    assert qs.is_leaf
    dos = do.to(dt)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        chunk_based(qs, ks, vs)[0].backward(dos)
        assert taken
    torch.cuda.current_stream().wait_stream(side)
    taken.clear()
    qs.grad = ks.grad = vs.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = chunk_based(qs, ks, vs)[0]
        o.backward(dos)
    assert taken
    for x in (o, qs.grad, ks.grad, vs.grad):
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for i, (name, x) in enumerate(zip(("o", "dq", "dk", "dv"), (o, qs.grad, ks.grad, vs.grad))):
        assert_close(f"graphed {name}", x, outs["ref"][i], outs["base"][i], dt)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_under_torch_compile(dtype, monkeypatch):
    """torch.compile(fullgraph=True) over a forward+backward of chunk_based goes through the custom ops
    zoo_based::chunk_fwd / chunk_bwd and runs the kernels an eager call runs: on Hopper the Gluon ones for bf16 (a
    small problem: the fused ones for fp16 and fp32). Output and gradients pass the rule against float64."""
    from kernels.based import fused, gluon_backward

    calls = []
    _count(monkeypatch, gluon_backward, "backward", calls, "gluon")
    _count(monkeypatch, fused, "backward", calls, "fused")
    case = Case(B=1, T=300, H=2, K=16, V=64, initial_state=False, final_state=False)
    q, k, v = (x.detach() for x in make_inputs(case, "cuda")[:3])
    do = torch.randn(q.shape[:3] + (case.V,), device="cuda", dtype=torch.float64)
    results = {}
    for name, fn, d in (("ref", naive_parallel_based, torch.float64), ("base", naive_parallel_based, dtype),
                        ("compiled", torch.compile(chunk_based, fullgraph=True), dtype)):
        qd, kd, vd = (x.to(d, copy=True).requires_grad_() for x in (q, k, v))
        o = fn(qd, kd, vd)[0]
        results[name] = (o, *torch.autograd.grad(o, (qd, kd, vd), do.to(d)))
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        assert_close(f"compiled {name}", results["compiled"][i], results["ref"][i], results["base"][i], dtype)
    assert calls == ["gluon" if HOPPER and dtype == torch.bfloat16 else "fused"]


# B·H ≥ 128 ≥ ops.MIN_SEQUENCES, so that chunk_based takes the Gluon kernel at any length
GLUON_CASES = [Case(B=2, T=63, H=64, K=16, V=64, initial_state=False), Case(B=2, T=1000, H=64, K=16, V=64),
               Case(B=1, T=2000, H=128, K=16, V=64, scale=0.3)]


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: c.id)
def test_gluon_forward_matches_naive_gpu(case, monkeypatch):
    """A bf16 forward that no gradient follows runs kernels/based/gluon.py (its narrow layout): output and final state
    against float64, by the tolerance rule; the state goes in and comes out in FLA's order, contiguous."""
    from kernels.based import gluon

    calls = []
    _count(monkeypatch, gluon, "forward", calls)
    q, k, v, kv0, ks0 = (x.detach() if x is not None else None for x in make_inputs(case, "cuda"))
    h0 = (kv0.float(), ks0.float()) if case.initial_state else None
    args = dict(scale=case.scale, output_final_state=True)
    ref_o, ref_state = chunked_reference(1024)(q, k, v, initial_state=(kv0, ks0) if h0 else None, **args)
    bf = [x.bfloat16() for x in (q, k, v)]
    base_o, base_state = naive_parallel_based(*bf, initial_state=h0, **args)
    with torch.no_grad(), nan_empty():
        o, state = chunk_based(*bf, initial_state=h0, **args)
    assert calls, "chunk_based did not take the Gluon kernel"
    assert o.dtype == torch.bfloat16 and state[0].dtype == torch.float32
    assert state[0].is_contiguous() and state[1].is_contiguous()
    for name, a, r, b in zip(("o", "kv", "k_sum"), (o, *state), (ref_o, *ref_state), (base_o, *base_state)):
        assert_close(f"{case.id} gluon {name}", a, r, b, torch.bfloat16)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU (sm_90)")
def test_gluon_prefill_then_decode_gpu():
    """Prefill → decode composes: the Gluon prefill's final state goes to fused_recurrent_based as it is, and the
    step's output equals one prefill over all tokens."""
    q, k, v = (torch.randn(2, 1001, 64, d, device="cuda").bfloat16() for d in (16, 16, 64))
    with torch.no_grad():
        o, _ = chunk_based(q, k, v)
        _, state = chunk_based(q[:, :-1], k[:, :-1], v[:, :-1], output_final_state=True)
        o_t = fused_recurrent_based(q[:, -1], k[:, -1], v[:, -1], state)
    assert rel_error(o_t, o[:, -1]) < 1e-2


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU (sm_90)")
def test_gluon_forward_chained_calls_equal_one_gpu():
    """Two Gluon calls, the first one's final state entering the second, against one call over the whole length."""
    q, k, v = (torch.randn(2, 3000, 64, d, device="cuda").bfloat16() for d in (16, 16, 64))
    with torch.no_grad():
        o, (kv, ks) = chunk_based(q, k, v, output_final_state=True)
        o1, mid = chunk_based(q[:, :1111], k[:, :1111], v[:, :1111], output_final_state=True)
        o2, (kv2, ks2) = chunk_based(q[:, 1111:], k[:, 1111:], v[:, 1111:], initial_state=mid, output_final_state=True)
    assert rel_error(torch.cat([o1, o2], 1), o) < 1e-2
    assert rel_error(kv2, kv) < 1e-5 and rel_error(ks2, ks) < 1e-5


# T = 900: 15 chunks, so the Gluon dq kernel's last 128-token step holds one partial chunk; T = 16384 (B·H = 2,
# forced: the auto rule leaves few long sequences to the fused kernels) walks 256 chunks each way
TRAIN_CASES = [Case(B=1, T=T, H=2, K=16, V=64) for T in (63, 1000, 4096, 16384)] + [
    Case(B=2, T=900, H=2, K=16, V=64, scale=0.3, initial_state=False)]


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("case", TRAIN_CASES, ids=lambda c: c.id)
def test_gluon_training_matches_naive_gpu(case, monkeypatch):
    """Training in bf16 through the Gluon forward, which stores every second chunk's entering state (and den), and the
    Gluon backward (kernels/based/gluon_backward.py). Output, final state and every gradient, the initial state's
    included, by the tolerance rule, with every output and stored buffer NaN-poisoned first."""
    from kernels.based import gluon, gluon_backward

    calls = []
    _count(monkeypatch, gluon, "forward", calls, "fwd")
    _count(monkeypatch, gluon_backward, "backward", calls, "bwd")
    with nan_empty():
        check_against_naive(forced("gluon"), case, torch.bfloat16, "cuda", reference=_reference(case))
    assert calls == ["fwd", "bwd"], f"training took {calls}"


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("used", ["o", "state"])
def test_gluon_training_one_output_in_the_loss_gpu(used, monkeypatch):
    """The final state returned but only one of (o, final state) in the loss: the other's gradient reaches the
    backward as None (no zeros are made for the state's; dO is taken as zeros). Every gradient against float64 by the
    tolerance rule; with the state alone, dq is exactly zero (the state does not depend on q)."""
    from kernels.based import gluon_backward

    calls = []
    real_bwd = gluon_backward.backward
    monkeypatch.setattr(gluon_backward, "backward", lambda *a, **kw: calls.append(a[4]) or real_bwd(*a, **kw))
    case = Case(B=1, T=1000, H=2, K=16, V=64)
    inputs = make_inputs(case, "cuda")

    def grads(fn, dtype):
        q, k, v, kv0, ks0 = inputs
        sd = torch.float64 if dtype == torch.float64 else torch.float32
        o, (kv, ks) = fn(q.to(dtype), k.to(dtype), v.to(dtype), initial_state=(kv0.to(sd), ks0.to(sd)),
                         output_final_state=True)
        outs = [o] if used == "o" else [kv, ks]
        g = torch.Generator(device="cpu").manual_seed(1)
        loss = sum((x.double() * torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device)).sum()
                   for x in outs)
        got = torch.autograd.grad(loss, inputs, allow_unused=True)
        return [torch.zeros_like(x) if d is None else d for d, x in zip(got, inputs)]

    ref, base = grads(naive_parallel_based, torch.float64), grads(naive_parallel_based, torch.bfloat16)
    with nan_empty():
        out = grads(chunk_based, torch.bfloat16)
    assert len(calls) == 1, "training did not take the Gluon backward"
    assert (calls[0].abs().sum() == 0) == (used == "state")
    for name, a, r, b in zip(("dq", "dk", "dv", "dkv0", "dk_sum0"), out, ref, base):
        if used == "state" and name == "dq":
            assert (a == 0).all(), "dq of a loss of the final state alone is not zero"
        else:
            assert_close(f"{used} only: {name}", a, r, b, torch.bfloat16)
