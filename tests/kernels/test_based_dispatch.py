"""The rule that picks `chunk_based`'s kernels (kernels/based/ops.py `choose_path`), case by case, and the ways to
force a path. Nothing launches here."""

import pytest
import torch

from kernels.based import ops
from kernels.based.ops import BasedConfig, choose_path

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BIG = dict(B=8, T=4096, H=16)  # the benchmark's shape: B·H·T ≥ SPLIT_MIN_WORK
SMALL = dict(B=1, T=300, H=2)  # B·H·T < SPLIT_MIN_WORK
FEW_LONG = dict(B=1, T=16384, H=16)  # B·H < MIN_SEQUENCES and T > MAX_SHORT_T

# (id, sm90, dtype, shape, K, V, normalize, grad, capturing, expected path)
RULE = [
    ("sm90-bf16-train", True, BF16, BIG, 16, 64, True, True, False, "gluon"),
    ("sm90-bf16-infer", True, BF16, BIG, 16, 64, True, False, False, "gluon"),
    ("sm90-bf16-small-train", True, BF16, SMALL, 16, 64, True, True, False, "gluon"),
    ("sm90-bf16-few-long-infer", True, BF16, FEW_LONG, 16, 64, True, False, False, "fused"),
    ("sm90-bf16-few-long-train", True, BF16, FEW_LONG, 16, 64, True, True, False, "split"),
    ("sm90-bf16-unnormalized-train", True, BF16, BIG, 16, 64, False, True, False, "split"),
    ("sm90-bf16-V112-train", True, BF16, BIG, 16, 112, True, True, False, "split"),
    ("sm90-bf16-K8-infer", True, BF16, BIG, 8, 64, True, False, False, "fused"),
    ("sm90-fp16-train", True, FP16, BIG, 16, 64, True, True, False, "split"),
    ("sm90-fp32-train", True, FP32, BIG, 16, 64, True, True, False, "fused"),
    ("other-gpu-bf16-train", False, BF16, BIG, 16, 64, True, True, False, "split"),
    ("other-gpu-bf16-infer", False, BF16, BIG, 16, 64, True, False, False, "fused"),
    ("other-gpu-bf16-small-train", False, BF16, SMALL, 16, 64, True, True, False, "fused"),
    ("other-gpu-bf16-small-train-captured", False, BF16, SMALL, 16, 64, True, True, True, "split"),
    ("other-gpu-fp16-train", False, FP16, BIG, 16, 64, True, True, False, "split"),
    ("other-gpu-fp32-train-captured", False, FP32, BIG, 16, 64, True, True, True, "fused"),
    ("other-gpu-bf16-K32-train", False, BF16, BIG, 32, 64, True, True, False, "fused"),
    ("other-gpu-bf16-V32-train", False, BF16, BIG, 16, 32, True, True, False, "fused"),
    ("other-gpu-bf16-V128-train", False, BF16, BIG, 16, 128, True, True, False, "split"),
    ("other-gpu-bf16-K8-V40-train", False, BF16, BIG, 8, 40, True, True, False, "split"),
]


@pytest.mark.parametrize(("sm90", "dtype", "shape", "K", "V", "normalize", "grad", "capturing", "expected"),
                         [r[1:] for r in RULE], ids=[r[0] for r in RULE])
def test_dispatch_rule(sm90, dtype, shape, K, V, normalize, grad, capturing, expected):
    assert choose_path(sm90=sm90, dtype=dtype, K=K, V=V, normalize=normalize, grad=grad, capturing=capturing,
                       **shape) == expected


def test_split_min_work_is_the_boundary():
    args = dict(sm90=False, dtype=BF16, B=1, H=1, K=16, V=64, normalize=True, grad=True, capturing=False)
    assert choose_path(T=ops.SPLIT_MIN_WORK, **args) == "split"
    assert choose_path(T=ops.SPLIT_MIN_WORK - 1, **args) == "fused"


@pytest.mark.parametrize(("forced", "K", "message"), [("gluon", 16, "sm_90"), ("split", 32, "K ≤ 16")])
def test_a_forced_path_that_cannot_take_the_call_says_why(forced, K, message):
    with pytest.raises(ValueError, match=message) as e:
        choose_path(sm90=False, dtype=BF16, K=K, V=64, normalize=True, grad=True, capturing=False, forced=forced,
                    **BIG)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("forced", ["split", "fused"])
def test_a_forced_path_is_taken(forced):
    assert choose_path(sm90=True, dtype=BF16, K=16, V=64, normalize=True, grad=True, capturing=False, forced=forced,
                       **BIG) == forced


def test_config_is_frozen_and_checked():
    with pytest.raises(ValueError, match="BasedConfig.path"):
        BasedConfig(path="walk")
    with pytest.raises(AttributeError):
        BasedConfig().path = "fused"


@pytest.mark.parametrize(("env", "path"), [(None, "auto"), ("fused", "fused"), ("split", "split")])
def test_environment_variable(env, path, monkeypatch):
    if env is None:
        monkeypatch.delenv("ZOO_BASED_PATH", raising=False)
    else:
        monkeypatch.setenv("ZOO_BASED_PATH", env)
    assert BasedConfig.from_env().path == path


@pytest.mark.parametrize(("grad", "expected"), [(False, "fused"), (True, "split")])
def test_chunk_based_passes_its_choice_to_the_kernels(grad, expected, monkeypatch):
    """chunk_based decides from the inputs' metadata (the gradient mode included) and hands the path to the forms;
    stopped at the first kernel call, so nothing runs."""
    class Chosen(Exception):
        pass

    def stop(*args, **kwargs):
        raise Chosen(args[6])  # _forward's path argument

    monkeypatch.setattr(ops, "SPLIT_MIN_WORK", 1)
    monkeypatch.setattr(ops, "_PLANS", {})
    monkeypatch.setattr(ops, "_forward", stop)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors pass the device check; nothing launches
    q, k = (torch.randn(1, 64, 2, 16, dtype=BF16, requires_grad=grad) for _ in range(2))
    v = torch.randn(1, 64, 2, 64, dtype=BF16, requires_grad=grad)
    with pytest.raises(Chosen) as chosen:
        ops.chunk_based(q, k, v)
    assert str(chosen.value) == expected
