"""BaseConv's decoding kernel (kernels/base_conv) on the CPU through Triton's interpreter, in fp32 (the interpreter
truncates casts to bf16 where the GPU rounds them to nearest, so bf16 is tested on the GPU): the mixer's
impl="triton" step against its impl="naive" step, on outputs and on the history it leaves.
tests/kernels/conftest.py runs this module's items with TRITON_INTERPRET=1."""

import pytest
import torch
from conv_cases import CASES, run_steps
from generation_check import assert_same_generation, generate_left_padded

from kernels.base_conv.decode import conv_decode


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conv_decode_step_equals_the_pytorch_step(case):
    (o_naive, h_naive), (o_fast, h_fast) = run_steps(case, "cpu")
    torch.testing.assert_close(o_fast, o_naive, rtol=1e-5, atol=1e-6)
    assert torch.equal(h_fast, h_naive)  # the shift and the append are copies


def test_conv_decode_rejects_bad_shapes_in_one_line():
    ug, weight, bias = torch.zeros(2, 8), torch.zeros(4, 1, 3), torch.zeros(4)
    with pytest.raises(ValueError, match=r"history \[B, k−1, C\]") as e:
        conv_decode(ug, torch.zeros(2, 3, 4), weight, bias)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="must be contiguous"):
        conv_decode(ug, torch.zeros(2, 4, 2).transpose(1, 2), weight, bias)


def test_generation_with_the_conv_kernel_equals_the_pytorch_step():
    """ZooForCausalLM (BaseConv, Based and the sliding window) generating greedily from left-padded prompts with
    BaseConv's decoding kernel: the same tokens and scores as with the PyTorch step."""
    naive, fast = (generate_left_padded({"based": {"feature_dim": 4, "num_heads": 2},
                                         "sliding_window": {"window": 16, "num_heads": 2}, "base_conv": {"impl": impl}})
                   for impl in ("naive", "triton"))
    assert_same_generation(naive, fast)
