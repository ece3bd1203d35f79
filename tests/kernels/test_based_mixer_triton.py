"""Based(impl="triton") against Based(impl="naive") with the same weights: forward, prefill with a state, decode.

On the CPU the same check runs under the Triton interpreter as
tests/kernels/test_based_interpreted.py::test_mixer_triton_matches_naive; here it runs on a CUDA GPU (skipped
without one).
"""

import pytest
import torch
from based_cases import check_mixer_triton_vs_naive


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixer_triton_matches_naive_gpu():
    check_mixer_triton_vs_naive("cuda", torch.float32, T=1000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon kernel needs a Hopper GPU (sm_90)")
def test_mixer_triton_bf16_generation_gpu(monkeypatch):
    """Generation's case: bf16 under no_grad with 64-wide heads, where the prefill runs kernels/based/gluon.py.
    Prefill in two pieces with a state, then decode steps: outputs and states against the naive mixer in float64,
    by kernels/testing.py's rule (the naive mixer in bf16 as the baseline)."""
    from kernels.based import gluon
    from kernels.testing import assert_close
    from zoo.models.mixers import Based

    calls = []
    real = gluon.forward
    monkeypatch.setattr(gluon, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(0)
    ref = Based(128, num_heads=2, feature_dim=16, impl="naive").to("cuda", torch.float64)
    base = Based(128, num_heads=2, feature_dim=16, impl="naive").to("cuda", torch.bfloat16)
    fast = Based(128, num_heads=2, feature_dim=16, impl="triton").to("cuda", torch.bfloat16)
    base.load_state_dict(ref.state_dict())
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(2, 300, 128, device="cuda", dtype=torch.float64)
    mixers = ((ref, torch.float64), (base, torch.bfloat16), (fast, torch.bfloat16))
    states = [m.init_state(2, "cuda", dt) for m, dt in mixers]
    with torch.no_grad():
        for lo, hi in ((0, 200), (200, 300)):
            r, b, f = (m(x[:, lo:hi].to(dt), s) for (m, dt), s in zip(mixers, states))
            assert_close(f"prefill {lo}:{hi}", f, r, b, torch.bfloat16)
        for _ in range(3):
            x_t = torch.randn(2, 128, device="cuda", dtype=torch.float64)
            r, b, f = (m.step(x_t.to(dt), s) for (m, dt), s in zip(mixers, states))
            assert_close("decode", f, r, b, torch.bfloat16)
    for name in ("kv", "k_sum"):
        assert_close(name, states[2][name], states[0][name], states[1][name], torch.bfloat16)
    assert calls, "the prefill did not take the Gluon kernel"
