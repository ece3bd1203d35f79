"""Based Triton kernels on the CPU through Triton's interpreter, in fp32, at small odd shapes.

TRITON_INTERPRET=1 must be set before Triton is first imported, so these tests run in their own process:
`test_based_interpreter.py` launches this file with the variable set (it is named so that pytest does not
collect it into a process where Triton may already be compiled for a GPU). Directly:
    TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreted_based.py
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before Triton is imported; run via test_based_interpreter.py",
                allow_module_level=True)

from based_cases import Case, check_against_naive, make_inputs, nan_empty  # noqa: E402

from kernels.based import chunk_based, feature_dim, fused_recurrent_based, naive_recurrent_based  # noqa: E402
from kernels.testing import CPU_T, assert_close  # noqa: E402

CASES = [Case(B=1, T=T, H=2, K=16, V=64) for T in CPU_T] + [
    Case(B=2, T=100, H=2, K=8, V=40),  # MQAR's feature dim, V not a power of two
    Case(B=1, T=64, H=1, K=32, V=128),  # the largest shape: two V blocks
    Case(B=1, T=15, H=2, K=16, V=112, scale=0.3),  # based-1b's V, a non-default scale
    Case(B=1, T=37, H=1, K=5, V=16, normalize=False),  # numerator only, with the final state's gradient
    Case(B=1, T=64, H=2, K=16, V=64, initial_state=False, final_state=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_chunk_matches_naive(case):
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float32, "cpu")


SEGMENTED = [
    Case(B=1, T=100, H=2, K=16, V=64),  # 4 segments of one chunk, the last one partial
    Case(B=2, T=64, H=1, K=8, V=40, normalize=False),  # 2 full segments, numerator only
]


@pytest.mark.parametrize("case", SEGMENTED, ids=[c.id for c in SEGMENTED])
def test_segmented_forward_matches_naive(case, monkeypatch):
    """The forward split into segments of one chunk (32 tokens) run in parallel, each from the prefix state of
    the segments before it: outputs, final state and every gradient as the naive form."""
    from kernels.based import chunk

    monkeypatch.setattr(chunk, "SEGMENT_TOKENS", 32)
    assert chunk._segment_tokens(case.T, 1, 32) == 32
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float32, "cpu")


FP16_CASES = [Case(B=1, T=100, H=2, K=16, V=64), Case(B=1, T=37, H=1, K=5, V=16, normalize=False)]


@pytest.mark.parametrize("case", FP16_CASES, ids=[c.id for c in FP16_CASES])
def test_fp16_inputs_match_naive(case):
    """fp16 inputs: the fused forward with fp16 operands (chunk.FP16_DOT, the state read as S/n), the backward with
    tf32 ones: outputs, final state and every gradient against the naive form in fp16 (kernels/testing.py's rule)."""
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float16, "cpu")


def test_fp16_forward_reads_a_large_state_in_range():
    """Large, biased inputs (k·10, v + 100) grow the order-2 state past fp16's range within 200 tokens; the fused
    forward's fp16 operands read it as S/n, so the output stays finite and within 1e-2 of float64."""
    from based_cases import run

    from kernels.based import naive_parallel_based
    from kernels.testing import rel_error

    case = Case(B=1, T=200, H=1, K=16, V=16, initial_state=False)
    inputs = make_inputs(case, "cpu")
    with torch.no_grad():
        inputs[1].mul_(10)
        inputs[2].add_(100)
    ref, _, cot = run(naive_parallel_based, inputs, case, torch.float64)
    out, _, _ = run(chunk_based, inputs, case, torch.float16, cot)
    for name, a, r in zip(("o", "kv", "k_sum"), out, ref):
        assert torch.isfinite(a).all(), f"{name} has inf or NaN"
        assert rel_error(a, r) <= 1e-2, (name, rel_error(a, r))


@pytest.mark.parametrize("case", FP16_CASES, ids=[c.id for c in FP16_CASES])
def test_fp16_split_kernels_match_naive(case, monkeypatch):
    """fp16 inputs through the split forward and backward, which take fp16 operands (states over n, dO/den times the
    chunk's smallest den; `split._chain_kernel`): everything against the naive form in fp16."""
    from kernels.based import chunk, split

    monkeypatch.setattr(chunk, "FORWARD", "split")
    monkeypatch.setattr(chunk, "BACKWARD", "split")
    monkeypatch.setattr(split, "CONFIG", {**split.CONFIG, "BC": 16})
    seen = []
    takes = split.takes_fp16
    monkeypatch.setattr(split, "takes_fp16", lambda dot: seen.append(takes(dot)) or seen[-1])
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float16, "cpu")
    assert seen and set(seen) == {4}  # fp16 operands in every split call


def _fp16_split_errors(monkeypatch, k_mul=1.0, v_add=0.0, cot_mul=1.0):
    """Relative errors against float64 of the split kernels' outputs and gradients for fp16 inputs (T=200)."""
    from based_cases import run

    from kernels.based import chunk, naive_parallel_based, split
    from kernels.testing import rel_error

    monkeypatch.setattr(chunk, "FORWARD", "split")
    monkeypatch.setattr(chunk, "BACKWARD", "split")
    monkeypatch.setattr(split, "CONFIG", {**split.CONFIG, "BC": 16})
    case = Case(B=1, T=200, H=1, K=16, V=64)
    inputs = make_inputs(case, "cpu")
    with torch.no_grad():
        inputs[1].mul_(k_mul)
        inputs[2].add_(v_add)
    _, _, cot = run(naive_parallel_based, inputs, case, torch.float64)
    cot = [c * cot_mul for c in cot]
    ref, ref_grad, _ = run(naive_parallel_based, inputs, case, torch.float64, cot)
    out, grad, _ = run(chunk_based, inputs, case, torch.float16, cot)
    names = ("o", "kv", "k_sum", "dq", "dk", "dv", "dkv0", "dk_sum0")
    # o, dq, dk and dv come out of the kernels in fp16: where fp16 cannot hold them they are inf by rights (dk at the
    # large inputs), and only the rest is compared
    return {n: rel_error(a, r) for n, a, r in zip(names, list(out) + list(grad), list(ref) + list(ref_grad))
            if n not in ("o", "dq", "dk", "dv") or r.abs().max() < torch.finfo(torch.float16).max}


def test_fp16_split_backward_keeps_small_gradients(monkeypatch):
    """dO ≈ 1e-3: dO/den falls to ≈ 1e-6, fp16's subnormals, where it would lose most of its bits (dq 5e-3 off,
    10× worse); the split kernels carry it times the chunk's smallest den, so every gradient keeps fp16's own
    precision (≈ 6e-4 here)."""
    errors = _fp16_split_errors(monkeypatch, cot_mul=1e-3)
    assert all(e <= 2e-3 for e in errors.values()), errors


def test_fp16_split_kernels_keep_a_large_state_in_range(monkeypatch):
    """Large, biased inputs (k·10, v + 100, dO·10): the state passes fp16's range within 200 tokens, and so does the
    order-2 contraction in dq (state times dO/den times a key); the split kernels store the states over n and
    contract with tf32 operands, so everything fp16 can hold (all but dk, whose true values reach 3.7e5) is finite
    and within 1e-2 of float64 (naive PyTorch in fp16 gives inf for o, kv and dq here)."""
    errors = _fp16_split_errors(monkeypatch, k_mul=10.0, v_add=100.0, cot_mul=10.0)
    assert set(errors) == {"o", "kv", "k_sum", "dq", "dv", "dkv0", "dk_sum0"}
    assert all(e <= 1e-2 for e in errors.values()), errors


BATCHED_O2 = [Case(B=1, T=100, H=2, K=16, V=64), Case(B=2, T=37, H=1, K=5, V=40, normalize=False)]


@pytest.mark.parametrize("case", BATCHED_O2, ids=[c.id for c in BATCHED_O2])
def test_batched_order2_matches_naive(case, monkeypatch):
    """Mode 2: forward and backward keep the order-2 states as [K, K, BV] and read, update and contract them
    with batched dots over the first index; with one-chunk segments, so the forward's state loads and stores in
    that layout are exercised too."""
    from kernels.based import chunk

    monkeypatch.setattr(chunk, "FWD_EXPAND", 2)
    monkeypatch.setattr(chunk, "BWD_EXPAND", 2)
    monkeypatch.setattr(chunk, "SEGMENT_TOKENS", 32)
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float32, "cpu")


PAIRS = [Case(B=1, T=100, H=2, K=16, V=64), Case(B=2, T=37, H=1, K=5, V=40, normalize=False),
         Case(B=1, T=15, H=2, K=16, V=112, scale=0.3)]


@pytest.mark.parametrize("mode", [1, 3, 5, 6])
@pytest.mark.parametrize("case", PAIRS, ids=[c.id for c in PAIRS])
def test_order2_modes_match_naive(case, mode, monkeypatch):
    """Mode 1 (the K² order-2 state, 0/1 expansion dots), mode 3 (a diagonal block plus one row per unordered
    pair, cyclic layout, weights 2 and 1), mode 5 (the default: 3 in two halves) and mode 6 (5 with the pair
    features by tl.gather), forward and backward;
    with one-chunk segments, so the state loads and stores and both states' gradients are exercised."""
    from kernels.based import chunk

    monkeypatch.setattr(chunk, "FWD_EXPAND", mode)
    monkeypatch.setattr(chunk, "BWD_EXPAND", mode)
    monkeypatch.setattr(chunk, "SEGMENT_TOKENS", 32)
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float32, "cpu")


SPLIT = [Case(B=1, T=T, H=2, K=16, V=64) for T in CPU_T] + [
    Case(B=2, T=100, H=2, K=8, V=40),  # MQAR's feature dim, V not a power of two
    Case(B=1, T=15, H=2, K=16, V=112, scale=0.3),  # based-1b's V (two V blocks of 64), a non-default scale
    Case(B=1, T=37, H=1, K=5, V=16, normalize=False),  # numerator only, with the final state's gradient
    Case(B=1, T=64, H=2, K=16, V=64, initial_state=False, final_state=False),
]


# Every case at the default-like settings (loading a chunk ahead; the output pass and dq in value blocks of 32, the
# state passes and dk/dv in 64); three of them also at small chunks (several chunks, four V blocks, the other row
# splits), with dv and dk in one launch, the state passes in three segments (the last shorter) loading chunk by
# chunk, the pair features by tl.gather, and the output pass and dq in value blocks of 64 against 16. The per-chunk
# kernels take 2 chunks per program (pipelined), and 3 at small chunks (the last program fewer), where the state
# passes also run as Triton's pipelined loop. The same three also with the state passes as per-chunk sums and a
# prefix scan (CONFIG["scan"]). Those runs walk with the features computed inside the walk (CONFIG["features"]
# off); every case also at the defaults (the key features stored first, the walk a load and a dot per step), and
# three of them so at small chunks, in row parts of 32, with the pair rows by tl.gather in four parts, and three at
# small chunks with dden from its own kernel rather than the reverse features kernel (CONFIG["fuse_dden"] off, the
# default since session 12) and the walk in row parts of 64.
SPLIT_RUNS = [(c, {"BC": 32, "NP": 4, "OP": 2, "NS": 1, "prefetch": True, "gather": False, "dkv_apart": True,
                   "features": False,
                   "output_BV": 32, "output_chunks": 2, "output_stages": 2,
                   "dq_chunks": 2, "dq_stages": 2, "dv_chunks": 2, "dv_stages": 2, "dk_chunks": 2, "dk_stages": 2},
                   "bc32")
              for c in SPLIT] + [
    (c, {"BC": 16, "NP": 2, "BV": 16, "OP": 4, "NS": 3, "prefetch": False, "gather": True, "dkv_apart": False,
         "output_BV": 64, "output_chunks": 3, "dq_chunks": 3, "dk_chunks": 3, "state_stages": 2, "features": False},
     "bc16-ns3-gather")
    for c in (SPLIT[3], SPLIT[4], SPLIT[6])
] + [
    (c, {"BC": 16, "NP": 2, "OP": 2, "scan": True, "features": False}, "bc16-scan")
    for c in (SPLIT[3], SPLIT[4], SPLIT[6])
] + [(c, {}, "default") for c in SPLIT] + [
    (c, {"BC": 16, "features": True, "features_rows": 32, "features_gather": True, "features_parts": 4},
     "bc16-features32-gather-parts4")
    for c in (SPLIT[3], SPLIT[4], SPLIT[6])
] + [(c, {"BC": 16, "fuse_dden": False, "features_rows": 64}, "bc16-dden-kernel-rows64")
       for c in (SPLIT[3], SPLIT[4], SPLIT[5])]
SPLIT_IDS = [f"{c.id}-{name}" for c, _, name in SPLIT_RUNS]


@pytest.mark.parametrize(("case", "config", "name"), SPLIT_RUNS, ids=SPLIT_IDS)
def test_split_forward_matches_naive(case, config, name, monkeypatch):
    """chunk.FORWARD = "split" (kernels/based/split.py: the entering state of every chunk first, then all chunks'
    outputs at once): outputs, final state and every gradient (the backward is the fused one's) against naive."""
    from kernels.based import chunk, split

    monkeypatch.setattr(chunk, "FORWARD", "split")
    monkeypatch.setattr(split, "CONFIG", {**split.CONFIG, **config})
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float32, "cpu")


@pytest.mark.parametrize(("case", "config", "name"), SPLIT_RUNS, ids=SPLIT_IDS)
def test_split_backward_matches_naive(case, config, name, monkeypatch):
    """chunk.BACKWARD = "split" (the forward's states again, a reverse state pass, then every chunk's dq and dk,
    dv at once) under the fused forward: every gradient, the initial state's included, against naive."""
    from kernels.based import chunk, split

    monkeypatch.setattr(chunk, "BACKWARD", "split")
    monkeypatch.setattr(split, "CONFIG", {**split.CONFIG, **config})
    with nan_empty():
        check_against_naive(chunk_based, case, torch.float32, "cpu")


def test_split_forward_chained_calls_equal_one(monkeypatch):
    """The split forward and backward with a state carried between two calls (split point not a multiple of the
    chunk): gradients flow back through the carried state."""
    from kernels.based import chunk, split

    monkeypatch.setattr(chunk, "FORWARD", "split")
    monkeypatch.setattr(chunk, "BACKWARD", "split")
    monkeypatch.setattr(split, "CONFIG", {**split.CONFIG, "BC": 16})
    test_two_chained_calls_equal_one()


@pytest.mark.parametrize("save", [True, False], ids=["saved", "recomputed"])
def test_split_backward_reuses_the_forward_states(save, monkeypatch):
    """FORWARD="auto" under a split backward: the forward runs split and, with SAVE_STATES, the backward takes its
    entering states instead of running the state pass again; gradients (initial state's included) against naive."""
    from kernels.based import chunk, split

    calls = []
    state_pass = split.state_pass

    def counted(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return state_pass(*args, **kwargs)

    monkeypatch.setattr(chunk, "FORWARD", "auto")
    monkeypatch.setattr(chunk, "BACKWARD", "split")
    monkeypatch.setattr(chunk, "SAVE_STATES", save)
    monkeypatch.setattr(split, "state_pass", counted)
    monkeypatch.setattr(split, "CONFIG", {**split.CONFIG, "BC": 16})
    with nan_empty():
        check_against_naive(chunk_based, Case(B=1, T=100, H=2, K=16, V=64), torch.float32, "cpu")
    # one forward and one backward (check_against_naive differentiates once): the backward's call only if not saved
    assert len(calls) == (1 if save else 2)


def test_forward_in_chunks_of_64(monkeypatch):
    """The bf16 default on the GPU runs the forward in chunks of 64 (the backward in 32): that split, here in
    fp32, against naive, with a partial last chunk and both states."""
    from kernels.based import chunk

    default = chunk._config
    monkeypatch.setattr(chunk, "_config", lambda K, V, dtype, kind: (16, 32, 64, 4, 2) if kind == "fwd"
                        else default(K, V, dtype, kind))
    with nan_empty():
        check_against_naive(chunk_based, Case(B=1, T=100, H=2, K=16, V=64), torch.float32, "cpu")


def test_two_chained_calls_equal_one():
    """Prefill in two pieces with the state carried equals one call: outputs, final state and gradients
    (which flow back through the carried state). The split is not a multiple of the chunk size."""
    case = Case(B=1, T=100, H=2, K=16, V=64)
    split = 37

    def chained(q, k, v, scale, initial_state, output_final_state, normalize):
        o1, mid = chunk_based(q[:, :split], k[:, :split], v[:, :split], scale, initial_state, True, normalize)
        o2, final = chunk_based(q[:, split:], k[:, split:], v[:, split:], scale, mid, output_final_state, normalize)
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
    """Prefill with chunk_based, then decode one token: equals one call over all tokens."""
    case = Case(B=1, T=20, H=2, K=16, V=64, initial_state=False)
    q, k, v, _, _ = (x.detach().float() if x is not None else None for x in make_inputs(case, "cpu"))
    o_all, (kv_all, ks_all) = chunk_based(q, k, v, output_final_state=True)
    _, (kv, ks) = chunk_based(q[:, :-1], k[:, :-1], v[:, :-1], output_final_state=True)
    state = (kv.contiguous(), ks.contiguous())
    o_last = fused_recurrent_based(q[:, -1], k[:, -1], v[:, -1], state)
    torch.testing.assert_close(o_last, o_all[:, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], kv_all, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(state[1], ks_all, rtol=1e-5, atol=1e-4)
    assert state[0].shape[-2] == feature_dim(case.K)



def test_mixer_triton_matches_naive():
    from based_cases import check_mixer_triton_vs_naive

    check_mixer_triton_vs_naive("cpu")
