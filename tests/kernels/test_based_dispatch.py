"""The rule that picks `chunk_based`'s kernels (kernels/based/ops.py `choose_path`), case by case, and the ways to
force a path. Nothing launches here."""

import pytest
import torch

from kernels.based import ops
from kernels.based.ops import BasedConfig, choose_path

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BIG = dict(B=8, T=4096, H=16)  # the benchmark's shape
SMALL = dict(B=1, T=300, H=2)
FEW_LONG = dict(B=1, T=16384, H=16)  # B·H < MIN_SEQUENCES and T > MAX_SHORT_T

# (id, sm90, dtype, shape, K, V, normalize, expected path); the rule does not depend on the gradient mode
RULE = [
    ("sm90-bf16", True, BF16, BIG, 16, 64, True, "gluon"),
    ("sm90-bf16-small", True, BF16, SMALL, 16, 64, True, "gluon"),
    ("sm90-bf16-few-long", True, BF16, FEW_LONG, 16, 64, True, "fused"),
    ("sm90-bf16-unnormalized", True, BF16, BIG, 16, 64, False, "fused"),
    ("sm90-bf16-V112", True, BF16, BIG, 16, 112, True, "fused"),
    ("sm90-bf16-K8", True, BF16, BIG, 8, 64, True, "fused"),
    ("sm90-fp16", True, FP16, BIG, 16, 64, True, "fused"),
    ("sm90-fp32", True, FP32, BIG, 16, 64, True, "fused"),
    ("other-gpu-bf16", False, BF16, BIG, 16, 64, True, "fused"),
    ("other-gpu-bf16-small", False, BF16, SMALL, 16, 64, True, "fused"),
    ("other-gpu-fp16", False, FP16, BIG, 16, 64, True, "fused"),
    ("other-gpu-bf16-K32", False, BF16, BIG, 32, 64, True, "fused"),
    ("other-gpu-bf16-V128", False, BF16, BIG, 16, 128, True, "fused"),
]


@pytest.mark.parametrize(("sm90", "dtype", "shape", "K", "V", "normalize", "expected"), [r[1:] for r in RULE],
                         ids=[r[0] for r in RULE])
def test_dispatch_rule(sm90, dtype, shape, K, V, normalize, expected):
    assert choose_path(sm90=sm90, dtype=dtype, K=K, V=V, normalize=normalize, **shape) == expected


def test_a_forced_path_that_cannot_take_the_call_says_why():
    with pytest.raises(ValueError, match="sm_90") as e:
        choose_path(sm90=False, dtype=BF16, K=16, V=64, normalize=True, forced="gluon", **BIG)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("sm90", "forced"), [(True, "gluon"), (True, "fused")])
def test_a_forced_path_is_taken(sm90, forced):
    assert choose_path(sm90=sm90, dtype=BF16, K=16, V=64, normalize=True, forced=forced, **FEW_LONG) == forced


def test_config_is_frozen_and_checked():
    with pytest.raises(ValueError, match="BasedConfig.path"):
        BasedConfig(path="split")
    with pytest.raises(AttributeError):
        BasedConfig().path = "fused"


@pytest.mark.parametrize(("env", "path"), [(None, "auto"), ("fused", "fused"), ("gluon", "gluon")])
def test_environment_variable(env, path, monkeypatch):
    if env is None:
        monkeypatch.delenv("ZOO_BASED_PATH", raising=False)
    else:
        monkeypatch.setenv("ZOO_BASED_PATH", env)
    assert BasedConfig.from_env().path == path


@pytest.mark.parametrize(("sm90", "expected"), [(False, "fused"), (True, "gluon")], ids=["other-gpu", "sm90"])
def test_chunk_based_passes_its_choice_to_the_kernels(sm90, expected, monkeypatch):
    """chunk_based decides from the inputs' metadata and hands the path to the forms; stopped at the first kernel
    call, so nothing runs."""
    class Chosen(Exception):
        pass

    def stop(*args, **kwargs):
        raise Chosen(args[6])  # _forward's path argument

    monkeypatch.setattr(ops, "_PLANS", {})
    monkeypatch.setattr(ops, "_is_sm90", lambda device: sm90)
    monkeypatch.setattr(ops, "_forward", stop)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors pass the device check; nothing launches
    q, k = (torch.randn(1, 64, 2, 16, dtype=BF16) for _ in range(2))
    v = torch.randn(1, 64, 2, 64, dtype=BF16)
    with pytest.raises(Chosen) as chosen:
        ops.chunk_based(q, k, v)
    assert str(chosen.value) == expected


@pytest.mark.parametrize(("sms", "segments"), [(132, 16), (16, 8), (2, 1)])
def test_fused_forward_segments_follow_the_device_sm_count(sms, segments, monkeypatch):
    """The fused forward splits a few long sequences into segments while its programs are fewer than the SMs of q's
    device (`launch.sm_count`): B·H = 2, one V block, 128 chunks of 32. Launches are recorded, not run."""
    from kernels.based import fused

    grids = []
    monkeypatch.setattr(fused, "sm_count", lambda device: sms if device == q.device else None)
    monkeypatch.setattr(fused, "launch", lambda kernel, grid, *args, **kwargs: grids.append(grid))
    q, k = (torch.randn(1, 4096, 2, 16) for _ in range(2))
    v = torch.randn(1, 4096, 2, 32)
    fused.forward(q, k, v, None, None, 0.25, False, True)
    assert {g[1] for g in grids} == {segments}  # the grid's segment axis, in every launch
