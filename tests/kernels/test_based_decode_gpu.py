"""The Based decode step with kv stored in bf16 on a CUDA GPU, where the kernel rounds to nearest even: against
`bf16_state.rounded_recurrent`, through a CUDA graph, and the mixer's impl="triton" against impl="naive" (both round
to nearest, so here the steps agree tightly). Skipped without CUDA."""

import pytest
import torch
from bf16_state import CASES, check_decode

from kernels.based import fused_recurrent_based
from kernels.testing import rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bf16_state_decode_matches_rounded_reference_gpu(case):
    check_decode(case, "cuda", torch.bfloat16, "nearest")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fp32_state_decode_matches_reference_gpu(case):
    check_decode(case, "cuda", torch.float32, "nearest")


def test_bf16_state_decode_in_cuda_graph_gpu():
    """Steps replayed from a CUDA graph over a bf16 kv equal the same steps launched directly."""
    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, K, V = 4, 16, 16, 112
    E = 1 + K + K * (K + 1) // 2
    q, k = (torch.randn(B, H, K, generator=g).cuda().bfloat16() for _ in range(2))
    v = torch.randn(B, H, V, generator=g).cuda().bfloat16()
    kv0 = torch.randn(B, H, E, V, generator=g).cuda().bfloat16()
    ks0 = torch.rand(B, H, E, generator=g).cuda() + 1.0
    direct, graphed = (kv0.clone(), ks0.clone()), (kv0.clone(), ks0.clone())
    o_direct = [fused_recurrent_based(q, k, v, direct) for _ in range(3)]
    o_t = torch.empty_like(v)
    fused_recurrent_based(q, k, v, (kv0.clone(), ks0.clone()), out=o_t)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_recurrent_based(q, k, v, graphed, out=o_t)
    o_graphed = []
    for _ in range(3):
        graph.replay()
        o_graphed.append(o_t.clone())
    torch.cuda.synchronize()
    assert torch.equal(torch.stack(o_graphed), torch.stack(o_direct))
    assert torch.equal(graphed[0], direct[0]) and torch.equal(graphed[1], direct[1])


def test_mixer_bf16_state_matches_naive_gpu():
    """Based(impl="triton", state_dtype="bf16") against Based(impl="naive", state_dtype="bf16") in fp32: prefill,
    then decode steps; both round kv to nearest after each update."""
    from zoo.models.mixers import Based

    torch.manual_seed(0)
    opts = dict(num_heads=2, feature_dim=16, state_dtype="bf16")
    naive = Based(128, impl="naive", **opts).cuda()
    fast = Based(128, impl="triton", **opts).cuda()
    fast.load_state_dict(naive.state_dict())
    x = torch.randn(2, 300, 128, device="cuda")
    s_naive, s_fast = naive.init_state(2), fast.init_state(2)
    with torch.no_grad():
        naive(x, s_naive)
        fast(x, s_fast)
        assert rel_error(s_fast["kv"], s_naive["kv"]) <= 1e-3
        s_fast["kv"].copy_(s_naive["kv"])  # the steps start from one state
        s_fast["k_sum"].copy_(s_naive["k_sum"])
        for t in range(8):
            x_t = torch.randn(2, 128, device="cuda")
            y, ref = fast.step(x_t, s_fast), naive.step(x_t, s_naive)
            assert rel_error(y, ref) <= 1e-4, f"step {t}: relative error {rel_error(y, ref):.3g}"
    assert s_fast["kv"].dtype == torch.bfloat16
    same = (s_fast["kv"] == s_naive["kv"]).double().mean().item()
    assert same >= 0.99, f"kv: {same:.2%} of the elements equal the naive mixer's"
