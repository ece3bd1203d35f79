"""FLA fast paths on a GPU: impl="fla" against the naive recurrence, forward (chunk ops) and step (fused ops).

On the CPU only FLA's fused recurrent ops run (under the Triton interpreter); the chunk ops are checked here.
Inputs are bf16 (FLA's delta-rule chunk op refuses fp32); the reference is the naive path in fp64 and the
baseline is the naive path in bf16, with the kernels' tolerance rule widened for a whole mixer.
"""

import pytest
import torch

from kernels.testing import rel_error
from zoo.models.mixers import MIXERS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FLA_MIXERS = ["based", "gla", "deltanet", "gated_deltanet", "rwkv"]


def _pair(name: str, d_model: int = 64):
    torch.manual_seed(0)
    heads = {"num_heads": 2}
    naive = MIXERS[name](d_model, **heads).cuda()
    fast = MIXERS[name](d_model, impl="fla", **heads).cuda()
    fast.load_state_dict(naive.state_dict())
    return naive, fast


@pytest.mark.parametrize("name", FLA_MIXERS)
def test_fla_forward_and_step_match_naive_on_gpu(name):
    naive, fast = _pair(name)
    x = torch.randn(2, 100, 64, device="cuda")
    with torch.no_grad():
        reference = naive.double()(x.double())
        baseline = naive.to(torch.bfloat16)(x.bfloat16())
        full = fast.to(torch.bfloat16)(x.bfloat16())
        state = fast.init_state(2)
        steps = torch.stack([fast.step(x[:, t].bfloat16(), state) for t in range(x.shape[1])], dim=1)
    allowed = 2 * rel_error(baseline, reference) + 1e-2
    assert rel_error(full, reference) <= allowed, (name, "forward", rel_error(full, reference), allowed)
    assert rel_error(steps, reference) <= allowed, (name, "step", rel_error(steps, reference), allowed)
