"""kernels/launch.py: its plain-Python cdiv and next_power_of_2 equal Triton's, and the device checks."""

import triton

from kernels.launch import cdiv, next_power_of_2


def test_next_power_of_2_equals_tritons():
    for n in range(0, 70000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_equals_tritons():
    for a in range(0, 700):
        for b in (1, 2, 3, 7, 16, 32, 64, 100, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_kernels_refuse_tensors_triton_cannot_launch_on(monkeypatch):
    """CPU tensors outside the interpreter, or inputs on two devices: one clear line, before any launch."""
    import pytest
    import torch

    from kernels.based import chunk_based, feature_dim, fused_recurrent_based

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 64)
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1") as e:
        chunk_based(q, q, v)
    assert "\n" not in str(e.value)
    state = (torch.zeros(1, 2, feature_dim(16), 64), torch.zeros(1, 2, feature_dim(16)))
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        fused_recurrent_based(q[:, 0], q[:, 0], v[:, 0], state)
    with pytest.raises(ValueError, match="different devices"):
        chunk_based(q, q.to("meta"), v)
