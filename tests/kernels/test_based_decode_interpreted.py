"""The Based decode step with its state's kv stored in bf16 or fp32 (`fused_recurrent_based`), on the CPU through
Triton's interpreter in fp32 compute, against `bf16_state.rounded_recurrent`; and the mixer's impl="triton" with
state_dtype="bf16" (prefill rounds its fp32 final state once, decode keeps kv in bf16).

The interpreter converts fp32 to bf16 toward zero (the GPU to nearest: test_based_decode_gpu.py), so the reference
rounds toward zero here. tests/kernels/conftest.py runs this module's items with TRITON_INTERPRET=1.
"""

import pytest
import torch
from bf16_state import CASES, check_decode

from kernels.based import fused_recurrent_based
from kernels.testing import rel_error


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bf16_state_decode_matches_rounded_reference(case):
    check_decode(case, "cpu", torch.bfloat16, "toward_zero")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fp32_state_decode_matches_reference(case):
    check_decode(case, "cpu", torch.float32, "toward_zero")


@pytest.mark.parametrize("kv_dtype, ks_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["kv-fp16", "k_sum-bf16"])
def test_decode_rejects_other_state_dtypes(kv_dtype, ks_dtype):
    q = torch.randn(1, 1, 4)
    kv, k_sum = torch.zeros(1, 1, 15, 8, dtype=kv_dtype), torch.zeros(1, 1, 15, dtype=ks_dtype)
    with pytest.raises(ValueError, match="kv fp32 or bf16 and k_sum fp32") as err:
        fused_recurrent_based(q, q, torch.randn(1, 1, 8), (kv, k_sum))
    assert "\n" not in str(err.value)


def test_mixer_bf16_state_prefill_then_decode():
    """Based(impl="triton", state_dtype="bf16"): a prefill leaves kv = the fp32-state prefill's kv rounded once (to
    nearest: the cast is PyTorch's), k_sum in fp32 equal to it; decode steps keep kv bf16 and match the naive mixer
    with the same bf16 state to within 3% (the kernel rounds toward zero here, the naive step to nearest, and the
    gap grows by up to a bf16 step per token; test_based_decode_gpu.py checks the steps tightly)."""
    from zoo.models.mixers import Based

    torch.manual_seed(0)
    opts = dict(num_heads=2, feature_dim=16)
    fp32 = Based(64, impl="triton", **opts)
    fast = Based(64, impl="triton", state_dtype="bf16", **opts)
    naive = Based(64, impl="naive", state_dtype="bf16", **opts)
    fast.load_state_dict(fp32.state_dict())
    naive.load_state_dict(fp32.state_dict())
    x = torch.randn(2, 21, 64)
    s32, s_fast, s_naive = (m.init_state(2) for m in (fp32, fast, naive))
    assert s_fast["kv"].dtype == torch.bfloat16 and s_fast["k_sum"].dtype == torch.float32
    with torch.no_grad():
        y32, y_fast = fp32(x, s32), fast(x, s_fast)
        naive(x, s_naive)
        torch.testing.assert_close(y_fast, y32, rtol=0, atol=0)  # the prefill's output never reads the rounded kv
        assert torch.equal(s_fast["kv"], s32["kv"].to(torch.bfloat16))
        assert torch.equal(s_fast["k_sum"], s32["k_sum"])
        for _ in range(3):
            x_t = torch.randn(2, 64)
            y_t, ref_t = fast.step(x_t, s_fast), naive.step(x_t, s_naive)
            assert rel_error(y_t, ref_t) <= 3e-2, f"step output: relative error {rel_error(y_t, ref_t):.3g}"
    assert s_fast["kv"].dtype == torch.bfloat16
    err = rel_error(s_fast["kv"], s_naive["kv"])
    assert err <= 3e-2, f"kv: relative error {err:.3g}"
