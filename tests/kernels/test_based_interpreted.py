"""The Based Triton kernels on the CPU through Triton's interpreter, in fp32 (and fp16), at small odd shapes: every
path `chunk_based` can take off a Hopper GPU (fused), decoding, torch.compile through the custom ops.

Each case is its own item. TRITON_INTERPRET=1 must be set before the kernels are defined; tests/kernels/conftest.py
runs this module's items in a child process with it set when this process was started without it.
"""

import functools

import pytest
import torch
from based_cases import Case, check_against_naive, make_inputs, nan_empty, run

from kernels.based import (
    BasedConfig,
    chunk_based,
    feature_dim,
    fused_recurrent_based,
    naive_parallel_based,
    naive_recurrent_based,
)
from kernels.launch import sm_count
from kernels.testing import CPU_T, assert_close, rel_error


def forced(path):
    """chunk_based on one path (kernels/based/ops.py `BasedConfig`)."""
    return functools.partial(chunk_based, config=BasedConfig(path=path))


CASES = [Case(B=1, T=T, H=2, K=16, V=64) for T in CPU_T] + [
    Case(B=2, T=100, H=2, K=8, V=40),  # MQAR's feature dim, V not a power of two
    Case(B=1, T=64, H=1, K=32, V=128),  # the largest shape: two V blocks, order 2 as K² rows
    Case(B=1, T=15, H=2, K=16, V=112, scale=0.3),  # based-1b's V, a non-default scale
    Case(B=1, T=37, H=1, K=5, V=16, normalize=False),  # numerator only, with the final state's gradient
    Case(B=1, T=64, H=2, K=16, V=64, initial_state=False, final_state=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fused_matches_naive(case):
    """The auto rule on the CPU (small problems: the fused kernels): outputs, final state and every gradient."""
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float32, "cpu")


# B·H = 1, 16 chunks of 32: the fused forward walks two segments of 256 tokens in parallel (`fused.segment_tokens`)
SEGMENTED = [Case(B=1, T=512, H=1, K=5, V=16), Case(B=1, T=500, H=1, K=16, V=16, normalize=False)]


@pytest.mark.parametrize("case", SEGMENTED, ids=[c.id for c in SEGMENTED])
def test_segmented_forward_matches_naive(case):
    """The fused forward in segments, each from the prefix state of the segments before it: outputs, final state and
    every gradient."""
    from kernels.based import fused

    assert fused.segment_tokens(case.T, 1, 32, sm_count(torch.device("cpu"))) == 256
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float32, "cpu")


def test_fused_forward_in_chunks_of_64(monkeypatch):
    """bf16 and fp16 forwards on the GPU run the fused forward in chunks of 64 (the backward in 32): that split, here
    in fp32, with a partial last chunk and both states."""
    from kernels.based import fused

    default = fused._config
    monkeypatch.setattr(fused, "_config", lambda K, V, dtype, kind: (16, 32, 64, 4, 2) if kind == "fwd"
                        else default(K, V, dtype, kind))
    with nan_empty():
        check_against_naive(chunk_based, Case(B=1, T=100, H=2, K=16, V=64), torch.float32, "cpu")


FP16_CASES = [Case(B=1, T=100, H=2, K=16, V=64), Case(B=1, T=37, H=1, K=5, V=16, normalize=False)]


@pytest.mark.parametrize("case", FP16_CASES, ids=[c.id for c in FP16_CASES])
def test_fp16_inputs_match_naive(case):
    """fp16 inputs: the fused forward with fp16 operands (the state read as S/n) and its backward with tf32 ones:
    everything against the naive form in fp16 (kernels/testing.py's rule)."""
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float16, "cpu")


def test_fp16_fused_forward_reads_a_large_state_in_range():
    """Large, biased inputs (k·10, v + 100) grow the order-2 state past fp16's range within 200 tokens; the fused
    forward's fp16 operands read it as S/n, so the output stays finite and within 1e-2 of float64."""
    case = Case(B=1, T=200, H=1, K=16, V=16, initial_state=False)
    inputs = make_inputs(case, "cpu")
    with torch.no_grad():
        inputs[1].mul_(10)
        inputs[2].add_(100)
    ref, _, cot = run(naive_parallel_based, inputs, case, torch.float64)
    out, _, _ = run(forced("fused"), inputs, case, torch.float16, cot)
    for name, a, r in zip(("o", "kv", "k_sum"), out, ref):
        assert torch.isfinite(a).all(), f"{name} has inf or NaN"
        assert rel_error(a, r) <= 1e-2, (name, rel_error(a, r))


def test_two_chained_calls_equal_one():
    """Prefill in two pieces with the state carried equals one call: outputs, final state and gradients (which flow
    back through the carried state). The split point is not a multiple of the chunk."""
    case = Case(B=1, T=100, H=2, K=16, V=64)
    split = 37
    fn = chunk_based

    def chained(q, k, v, scale, initial_state, output_final_state, normalize):
        o1, mid = fn(q[:, :split], k[:, :split], v[:, :split], scale, initial_state, True, normalize)
        o2, final = fn(q[:, split:], k[:, split:], v[:, split:], scale, mid, output_final_state, normalize)
        return torch.cat([o1, o2], dim=1), final

    with nan_empty():
        check_against_naive(chained, case, torch.float32, "cpu")


@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "unnormalized"])
def test_decode_steps_match_recurrent(normalize):
    """T steps of fused_recurrent_based from a state equal the recurrent form: outputs and the state."""
    case = Case(B=2, T=3, H=2, K=16, V=64, normalize=normalize)
    q, k, v, kv0, ks0 = (x.detach() for x in make_inputs(case, "cpu"))
    ref_o, (ref_kv, ref_ks) = naive_recurrent_based(q, k, v, initial_state=(kv0, ks0), output_final_state=True,
                                                    normalize=normalize)
    base_o, (base_kv, base_ks) = naive_recurrent_based(q.float(), k.float(), v.float(), initial_state=(
        kv0.float(), ks0.float()), output_final_state=True, normalize=normalize)
    state = (kv0.float().contiguous(), ks0.float().contiguous())
    outs = []
    for t in range(case.T):
        out = torch.full((case.B, case.H, case.V), float("nan"))
        fused_recurrent_based(q[:, t].float(), k[:, t].float(), v[:, t].float(), state, normalize=normalize, out=out)
        outs.append(out)
    assert_close("decode o", torch.stack(outs, 1), ref_o, base_o, torch.float32)
    assert_close("decode kv", state[0], ref_kv, base_kv, torch.float32)
    assert_close("decode k_sum", state[1], ref_ks, base_ks, torch.float32)


def test_decode_continues_chunked_prefill():
    """Prefill with chunk_based, then decode one token from its final state as returned (contiguous fp32, no copy):
    equals one call over all tokens."""
    case = Case(B=1, T=20, H=2, K=16, V=64, initial_state=False)
    q, k, v, _, _ = (x.detach().float() if x is not None else None for x in make_inputs(case, "cpu"))
    fn = chunk_based
    o_all, (kv_all, ks_all) = fn(q, k, v, output_final_state=True)
    _, state = fn(q[:, :-1], k[:, :-1], v[:, :-1], output_final_state=True)
    assert state[0].is_contiguous() and state[1].is_contiguous() and state[0].dtype == torch.float32
    o_last = fused_recurrent_based(q[:, -1], k[:, -1], v[:, -1], state)
    torch.testing.assert_close(o_last, o_all[:, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], kv_all, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(state[1], ks_all, rtol=1e-5, atol=1e-4)
    assert state[0].shape[-2] == feature_dim(case.K)


def test_mixer_triton_matches_naive():
    from based_cases import check_mixer_triton_vs_naive

    check_mixer_triton_vs_naive("cpu")


def test_torch_compile_fullgraph_runs_the_custom_ops(monkeypatch):
    """torch.compile(fullgraph=True) of a training step through chunk_based traces the custom ops (their fake
    implementations give the shapes) and runs the same kernels: outputs, final state and gradients equal eager ones."""
    from kernels.based import fused

    calls = []
    for name in ("forward", "backward"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, functools.partial(lambda real, name, *a, **kw: calls.append(name)
                                                            or real(*a, **kw), real, name))
    case = Case(B=1, T=40, H=2, K=16, V=64)
    inputs = make_inputs(case, "cpu")
    fn = forced("fused")
    eager_out, eager_grad, cot = run(fn, inputs, case, torch.float32)
    calls.clear()
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, grad, _ = run(compiled, inputs, case, torch.float32, cot)
    assert calls == ["forward", "backward"]
    for a, r in zip(out + list(grad), eager_out + list(eager_grad)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_custom_op_passes_opcheck():
    """torch.library.opcheck of zoo_based::chunk_fwd (schema, fake implementation, autograd registration)."""
    from kernels.based import ops  # noqa: F401 (registers the ops)

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 20, 1, 5, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 20, 1, 16, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.zoo_based.chunk_fwd.default, (q, k, v, None, None, 0.4, "fused", True, True, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("part", ["kv", "k_sum"])
def test_one_part_of_the_final_state_in_the_loss(part):
    """A loss of one part of the final state alone (the other's gradient reaches the backward as None): every
    gradient, the initial state's included, against float64 by the tolerance rule."""
    case = Case(B=1, T=70, H=2, K=16, V=64)
    leaves = make_inputs(case, "cpu")

    def grads(fn, dtype):
        q, k, v, kv0, ks0 = leaves
        sd = torch.float64 if dtype == torch.float64 else torch.float32
        _, (kv, ks) = fn(q.to(dtype), k.to(dtype), v.to(dtype), initial_state=(kv0.to(sd), ks0.to(sd)),
                         output_final_state=True)
        x = kv if part == "kv" else ks
        loss = (x.double() * torch.linspace(-1, 1, x.numel(), dtype=torch.float64).view_as(x)).sum()
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    ref, base = grads(naive_parallel_based, torch.float64), grads(naive_parallel_based, torch.float32)
    with nan_empty():
        out = grads(chunk_based, torch.float32)
    for name, a, r, b in zip(("dq", "dk", "dv", "dkv0", "dk_sum0"), out, ref, base):
        if r is None:  # the loss does not depend on it
            assert a is None or (a == 0).all(), name
        else:
            assert_close(f"{part} only {name}", a, r, b, torch.float32)
