"""Which kernels `chunk_based`'s backward runs (kernels/based/chunk.py BACKWARD): the split kernels only where they
were measured faster and checked on the H200, the fused ones elsewhere."""

import torch

from kernels.based import chunk


def test_auto_backward_takes_the_split_kernels_only_where_measured(monkeypatch):
    monkeypatch.setattr(chunk, "BACKWARD", "auto")
    assert chunk.split_backward_applies(16, 64, torch.bfloat16)
    assert chunk.split_backward_applies(16, 112, torch.float16)
    assert chunk.split_backward_applies(8, 40, torch.bfloat16)
    assert not chunk.split_backward_applies(16, 64, torch.float32)  # fp32: not measured faster
    assert not chunk.split_backward_applies(16, 32, torch.bfloat16)  # value blocks of 32 fault on Triton 3.6
    assert not chunk.split_backward_applies(32, 64, torch.bfloat16)  # the split kernels hold K ≤ 16


def test_forced_choices(monkeypatch):
    monkeypatch.setattr(chunk, "BACKWARD", "split")
    assert chunk.split_backward_applies(16, 32, torch.float32)
    assert not chunk.split_backward_applies(32, 64, torch.bfloat16)
    monkeypatch.setattr(chunk, "BACKWARD", "fused")
    assert not chunk.split_backward_applies(16, 64, torch.bfloat16)
