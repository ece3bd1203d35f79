"""The sliding-window decoding kernel on a CUDA GPU: impl="triton" against impl="naive" in fp32 and bf16, and steps
replayed from a CUDA graph against the same steps launched directly. Skipped without CUDA."""

import pytest
import torch
from window_cases import CASES, WindowCase, run_steps, twins

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bf16: both paths round q, k and v alike; they differ in the attention's accumulation order and precision (the
# kernel accumulates in fp32, SDPA in its own kernels), a few bf16 steps at most.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_window_decode_step_equals_the_pytorch_step_gpu(case, dtype):
    (o_naive, s_naive), (o_fast, s_fast) = run_steps(case, "cuda", dtype)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(o_fast.float(), o_naive.float(), rtol=rtol, atol=atol)
    for name in ("k", "v"):
        torch.testing.assert_close(s_fast[name].float(), s_naive[name].float(), rtol=rtol, atol=atol)


def test_window_decode_at_a_large_position_gpu():
    """Past 3,000 tokens (rotary angles in the thousands of radians) the kernel still equals the PyTorch step."""
    case = WindowCase(d_model=64, num_heads=1, window=16, prefill=3000, steps=3)
    (o_naive, s_naive), (o_fast, s_fast) = run_steps(case, "cuda")
    torch.testing.assert_close(o_fast, o_naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_fast["k"], s_naive["k"], rtol=1e-5, atol=1e-5)


def test_window_decode_in_cuda_graph_gpu():
    """Three steps replayed from one captured step equal three direct steps (pos read on the device)."""
    case = WindowCase(d_model=128, num_heads=2, window=8, prefill=0, steps=3)
    _, fast = twins(case, "cuda", torch.bfloat16)
    x = torch.randn(4, case.d_model, device="cuda", dtype=torch.bfloat16)
    direct, graphed = (fast.init_state(4) for _ in range(2))
    with torch.no_grad():
        o_direct = [fast.step(x, direct) for _ in range(3)]
        fast.step(x, fast.init_state(4))  # compile and make the frequencies outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_t = fast.step(x, graphed)
    for t in range(3):  # a position baked in at capture would write every step into one slot
        graph.replay()
        torch.testing.assert_close(o_t, o_direct[t])
    for name in ("k", "v", "pos"):
        torch.testing.assert_close(graphed[name], direct[name])
