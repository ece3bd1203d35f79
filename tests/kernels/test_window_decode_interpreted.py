"""The sliding-window decoding kernel (kernels/sliding_window) on the CPU through Triton's interpreter, in fp32:
the mixer's impl="triton" step against its impl="naive" step, on outputs and on the ring state it leaves.
tests/kernels/conftest.py runs this module's items with TRITON_INTERPRET=1."""

import pytest
import torch
from generation_check import assert_same_generation, generate_left_padded
from window_cases import CASES, run_steps

from kernels.sliding_window.decode import window_decode


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_window_decode_step_equals_the_pytorch_step(case):
    (o_naive, s_naive), (o_fast, s_fast) = run_steps(case, "cpu")
    torch.testing.assert_close(o_fast, o_naive, rtol=1e-5, atol=1e-5)
    for name in ("k", "v"):
        torch.testing.assert_close(s_fast[name], s_naive[name], rtol=1e-6, atol=1e-6)
    assert int(s_fast["pos"]) == int(s_naive["pos"]) == case.prefill + case.steps


def test_window_decode_rejects_bad_shapes_in_one_line():
    ring = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match=r"qkv must be \[B, 3·H·D\]") as e:
        window_decode(torch.zeros(2, 16), ring, ring, torch.zeros((), dtype=torch.int64), torch.ones(4), torch.ones(4))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="pos a 0-dim int64"):
        window_decode(torch.zeros(2, 24), ring, ring, torch.zeros(1, dtype=torch.int64), torch.ones(4), torch.ones(4))
    with pytest.raises(ValueError, match="cos and sin must be"):
        window_decode(torch.zeros(2, 24), ring, ring, torch.zeros((), dtype=torch.int64), torch.ones(3), torch.ones(3))


def test_left_padded_generation_with_the_window_kernel_equals_the_pytorch_step():
    """ZooForCausalLM generating greedily from left-padded prompts with the sliding window's decoding kernel: the
    same tokens and scores as with the PyTorch step. The window is longer than the prompts, so it reaches the
    padding, which the rows' `start` in the window's state must keep out."""
    naive, fast = (generate_left_padded({"based": {"feature_dim": 4, "num_heads": 2},
                                         "sliding_window": {"window": 16, "num_heads": 2, "impl": impl}})
                   for impl in ("naive", "triton"))
    assert_same_generation(naive, fast)
