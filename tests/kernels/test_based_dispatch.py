"""Which kernels `chunk_based` runs (kernels/based/chunk.py FORWARD, BACKWARD): the split kernels only where they
were measured faster and checked on the H200, the fused ones elsewhere."""

import pytest
import torch

from kernels.based import chunk, split

BIG = 8 * 16 * 4096  # B·H·T of the benchmark at T=4096


def test_auto_backward_takes_the_split_kernels_only_where_measured(monkeypatch):
    monkeypatch.setattr(chunk, "BACKWARD", "auto")
    assert chunk.split_backward_applies(16, 64, torch.bfloat16, BIG)
    assert chunk.split_backward_applies(16, 112, torch.float16, BIG)
    assert chunk.split_backward_applies(8, 40, torch.bfloat16, BIG)
    assert not chunk.split_backward_applies(16, 64, torch.float32, BIG)  # fp32: not measured faster
    assert not chunk.split_backward_applies(16, 32, torch.bfloat16, BIG)  # value blocks of 32 fault on Triton 3.6
    assert not chunk.split_backward_applies(32, 64, torch.bfloat16, BIG)  # the split kernels hold K ≤ 16


def test_auto_backward_leaves_small_problems_fused_unless_captured(monkeypatch):
    """Below SPLIT_MIN_WORK (B·H·T) the fused kernels' fewer launches win eagerly; in a CUDA graph the split ones."""
    monkeypatch.setattr(chunk, "BACKWARD", "auto")
    small = chunk.SPLIT_MIN_WORK - 1
    assert not chunk.split_backward_applies(16, 64, torch.bfloat16, small)
    assert chunk.split_backward_applies(16, 64, torch.bfloat16, small + 1)
    assert chunk.split_backward_applies(16, 64, torch.bfloat16, small, capturing=True)
    assert not chunk.split_backward_applies(16, 64, torch.float32, small, capturing=True)


def test_forced_choices(monkeypatch):
    monkeypatch.setattr(chunk, "BACKWARD", "split")
    assert chunk.split_backward_applies(16, 32, torch.float32, 1)
    assert not chunk.split_backward_applies(32, 64, torch.bfloat16, BIG)
    monkeypatch.setattr(chunk, "BACKWARD", "fused")
    assert not chunk.split_backward_applies(16, 64, torch.bfloat16, BIG, capturing=True)


class Chosen(Exception):
    pass


def _which_forward(monkeypatch, dtype, requires_grad, grad_enabled=True):
    """"split" or "fused": the forward `chunk_based` starts, stopped at its first kernel (nothing runs)."""

    def split_forward(*args, return_states=False, **kwargs):
        raise Chosen("split" if return_states else "split without states")

    class Fused:
        def __getitem__(self, grid):
            raise Chosen("fused")

    monkeypatch.setattr(split, "split_forward", split_forward)
    monkeypatch.setattr(chunk, "_fwd_kernel", Fused())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors pass the device check; no kernel launches here
    q, k = (torch.randn(1, 64, 2, 16, dtype=dtype, requires_grad=requires_grad) for _ in range(2))
    v = torch.randn(1, 64, 2, 64, dtype=dtype, requires_grad=requires_grad)
    with torch.set_grad_enabled(grad_enabled), pytest.raises(Chosen) as chosen:
        chunk.chunk_based(q, k, v)
    return str(chosen.value)


def test_auto_forward_is_split_only_for_a_split_backward(monkeypatch):
    monkeypatch.setattr(chunk, "SPLIT_MIN_WORK", 1)  # the inputs below are small
    monkeypatch.setattr(chunk, "FORWARD", "auto")
    monkeypatch.setattr(chunk, "BACKWARD", "auto")
    assert _which_forward(monkeypatch, torch.bfloat16, requires_grad=True) == "split"
    assert _which_forward(monkeypatch, torch.bfloat16, requires_grad=True, grad_enabled=False) == "fused"
    assert _which_forward(monkeypatch, torch.bfloat16, requires_grad=False) == "fused"
    assert _which_forward(monkeypatch, torch.float32, requires_grad=True) == "fused"  # fp32: fused backward
    # fp16: the split forward as for bf16 where the split kernels take fp16 operands (the default settings); where
    # they would take tf32 ones (here: the features computed inside the walk), the fused forward's fp16 operands win
    # (the split backward then computes the states again); with tf32 operands everywhere (FP16_DOT), split again
    assert _which_forward(monkeypatch, torch.float16, requires_grad=True) == "split"
    monkeypatch.setattr(split, "CONFIG", {**split.CONFIG, "features": False})
    assert _which_forward(monkeypatch, torch.float16, requires_grad=True) == "fused"
    monkeypatch.setattr(chunk, "FP16_DOT", "tf32")
    assert _which_forward(monkeypatch, torch.float16, requires_grad=True) == "split"
    monkeypatch.setattr(chunk, "BACKWARD", "fused")
    assert _which_forward(monkeypatch, torch.bfloat16, requires_grad=True) == "fused"
    monkeypatch.setattr(chunk, "FORWARD", "fused")
    monkeypatch.setattr(chunk, "BACKWARD", "auto")
    assert _which_forward(monkeypatch, torch.bfloat16, requires_grad=True) == "fused"


def test_auto_forward_of_a_small_problem_is_fused(monkeypatch):
    """B·H·T = 128 here: under the default SPLIT_MIN_WORK the forward (and so the backward) stays fused."""
    monkeypatch.setattr(chunk, "FORWARD", "auto")
    monkeypatch.setattr(chunk, "BACKWARD", "auto")
    assert _which_forward(monkeypatch, torch.bfloat16, requires_grad=True) == "fused"
    monkeypatch.setattr(chunk, "SPLIT_MIN_WORK", 128)
    assert _which_forward(monkeypatch, torch.bfloat16, requires_grad=True) == "split"


def test_auto_forward_under_torch_compile_is_split(monkeypatch):
    """While torch.compile traces, a small problem takes the split kernels too (as under CUDA-graph capture)."""
    monkeypatch.setattr(chunk, "FORWARD", "auto")
    monkeypatch.setattr(chunk, "BACKWARD", "auto")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _which_forward(monkeypatch, torch.bfloat16, requires_grad=True) == "split"
    assert _which_forward(monkeypatch, torch.float32, requires_grad=True) == "fused"  # fp32: fused backward


def test_fp32_dot_precision(monkeypatch):
    """fp32 inputs take tf32x3 dots by default (the tensor cores at ≈ fp32 accuracy), exact ones on request; bf16 and
    fp16 are unaffected; anything else is refused in one line."""
    assert chunk._dot_mode(torch.float32) == chunk.DOT_TF32X3
    assert chunk._dot_mode(torch.float32, 32) == chunk.DOT_IEEE  # tf32x3 overflows shared memory at K=32
    monkeypatch.setattr(chunk, "FP32_DOT", "ieee")
    assert chunk._dot_mode(torch.float32) == chunk.DOT_IEEE
    assert chunk._dot_mode(torch.bfloat16) == chunk.DOT_BF16
    assert chunk._dot_mode(torch.float16) == chunk.DOT_TF32
    monkeypatch.setattr(chunk, "FP32_DOT", "tf32")
    with pytest.raises(ValueError, match="FP32_DOT"):
        chunk._dot_mode(torch.float32)


def test_fp16_operands_in_the_fused_forward_and_the_split_kernels(monkeypatch):
    """fp16 inputs: the fused forward and the split kernels take fp16 operands (FP16_DOT = "fp16", the default) or
    tf32 ones on request; the fused backward keeps tf32 (`_dot_mode`); other dtypes are unaffected; anything else is
    refused in one line. The split kernels take fp16 only on their default path (stored features, one segment, no
    scan), whose kernels scale what they carry into fp16's range."""
    assert split.takes_fp16(chunk.DOT_FP16) == chunk.DOT_FP16
    assert split.takes_fp16(chunk.DOT_BF16) == chunk.DOT_BF16
    for config in ({"features": False}, {"NS": 2}, {"scan": True}):
        monkeypatch.setattr(split, "CONFIG", {**split.CONFIG, **config})
        assert split.takes_fp16(chunk.DOT_FP16) == chunk.DOT_TF32
        assert split.takes_fp16(chunk.DOT_BF16) == chunk.DOT_BF16
    monkeypatch.undo()
    assert chunk._fused_forward_dot(torch.float16) == chunk.DOT_FP16
    assert chunk._dot_mode(torch.float16) == chunk.DOT_TF32
    assert chunk._fused_forward_dot(torch.bfloat16) == chunk.DOT_BF16
    assert chunk._fused_forward_dot(torch.float32) == chunk.DOT_TF32X3
    monkeypatch.setattr(chunk, "FP16_DOT", "tf32")
    assert chunk._fused_forward_dot(torch.float16) == chunk.DOT_TF32
    monkeypatch.setattr(chunk, "FP16_DOT", "bf16")
    with pytest.raises(ValueError, match="FP16_DOT") as e:
        chunk._fused_forward_dot(torch.float16)
    assert "\n" not in str(e.value)
