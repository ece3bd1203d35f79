"""BaseConv's decoding kernel on a CUDA GPU: impl="triton" against impl="naive" in fp32 and bf16, and steps replayed
from a CUDA graph against the same steps launched directly. Skipped without CUDA."""

import pytest
import torch
from conv_cases import CASES, ConvCase, run_steps, twins

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bf16: both paths round after each multiply-add, SiLU and the gate; they differ only in how exp is computed, which
# moves a rounding by one bf16 step now and then, and the output projection sums such steps.
TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conv_decode_step_equals_the_pytorch_step_gpu(case, dtype):
    (o_naive, h_naive), (o_fast, h_fast) = run_steps(case, "cuda", dtype)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(o_fast.float(), o_naive.float(), rtol=rtol, atol=atol)
    assert torch.equal(h_fast, h_naive)


def test_conv_decode_at_based_1b_width_gpu():
    """based_1b's BaseConv (d 1,792, 3,584 channels) at batch 64 in bf16."""
    (o_naive, h_naive), (o_fast, h_fast) = run_steps(ConvCase(1792, 3, 2, 2, 2), "cuda", torch.bfloat16, batch=64)
    torch.testing.assert_close(o_fast.float(), o_naive.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(h_fast, h_naive)


def test_conv_decode_in_cuda_graph_gpu():
    """Three steps replayed from one captured step equal three direct steps."""
    case = ConvCase(d_model=64, kernel_size=3, expand=2, prefill=0, steps=3)
    _, fast = twins(case, "cuda", torch.bfloat16)
    x = torch.randn(4, case.d_model, device="cuda", dtype=torch.bfloat16)
    direct, graphed = (fast.init_state(4) for _ in range(2))
    with torch.no_grad():
        o_direct = [fast.step(x * (t + 1), direct) for t in range(3)]
        fast.step(x, fast.init_state(4))  # compile outside the capture
        x_static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_t = fast.step(x_static, graphed)
    for t in range(3):
        x_static.copy_(x * (t + 1))
        graph.replay()
        torch.testing.assert_close(o_t, o_direct[t])
    assert torch.equal(graphed["conv"], direct["conv"])
