"""experiments/bench/generation.py's summary fields and its decode profile's kernel table, on made-up inputs."""

from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

from experiments.bench.decode_profile import top_kernels
from experiments.bench.generation import prefill_ratio_per_seq


def test_prefill_at_the_best_batches_compares_time_per_sequence():
    based = {"batch": 1024, "prefill_ms": 4096.0}  # 4 ms a sequence
    llama = {"batch": 128, "prefill_ms": 1024.0}  # 8 ms a sequence
    assert prefill_ratio_per_seq(based, llama) == 2.0
    assert prefill_ratio_per_seq(None, llama) is None


def event(key, count, device_us=0.0, cpu_us=0.0, device=DeviceType.CUDA):
    return SimpleNamespace(key=key, count=count, device_type=device, self_device_time_total=device_us,
                           self_cpu_time_total=cpu_us)


def test_kernel_table_ranks_device_kernels_per_step():
    averages = [
        event("part:mixer based", 2, device_us=900.0, cpu_us=50.0, device=DeviceType.CPU),  # a label, not a kernel
        event("aten::mm", 20, cpu_us=400.0, device=DeviceType.CPU),  # the op whose kernel is below
        event("gemm_kernel", 20, device_us=600.0),
        event("_decode_kernel", 2, device_us=300.0),
        event("elementwise", 40, device_us=100.0),
    ]
    rows = top_kernels(averages, cuda=True, steps=2, n=2)
    assert [r["name"] for r in rows] == ["gemm_kernel", "_decode_kernel"]
    assert rows[0] == {"name": "gemm_kernel", "calls_per_step": 10.0, "ms": 0.3, "share": 0.6}
    assert rows[1]["share"] == 0.3  # of all three kernels' 1,000 µs, the one left out included


def test_kernel_table_on_the_cpu_ranks_ops_by_self_time():
    averages = [event("part:head", 1, cpu_us=500.0, device=DeviceType.CPU),
                event("aten::linear", 1, cpu_us=20.0, device=DeviceType.CPU),
                event("aten::mm", 1, cpu_us=80.0, device=DeviceType.CPU)]
    rows = top_kernels(averages, cuda=False, steps=1)
    assert [(r["name"], r["share"]) for r in rows] == [("aten::mm", 0.8), ("aten::linear", 0.2)]


def test_a_first_batch_that_does_not_fit_is_halved_until_one_does(monkeypatch):
    """A card with less memory: the model's first batch runs out of memory, so the bench tries half of it, then half
    again, and measures the first that fits; later batches of the list are not tried after that."""
    from experiments.bench import generation

    def measure(kind, model, batch, args, timer, device, reference):
        if batch > 32:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"batch": batch, "prefill_ms": 1.0, "decode_tokens_per_s": 10.0 * batch, "ms_per_step": 1.0,
                "decode_GB_per_s": 1.0}

    monkeypatch.setattr(generation, "measure", measure)
    args = SimpleNamespace(model_batches={"llama": [128, 256]}, batches=[1], budget_s=0)
    rows = generation.sweep("llama", None, args, None, torch.device("cpu"))
    assert [r["batch"] for r in rows] == [32]


def test_a_later_batch_that_does_not_fit_ends_the_sweep(monkeypatch):
    from experiments.bench import generation

    tried = []

    def measure(kind, model, batch, args, timer, device, reference):
        tried.append(batch)
        if batch > 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"batch": batch, "prefill_ms": 1.0, "decode_tokens_per_s": 1.0, "ms_per_step": 1.0,
                "decode_GB_per_s": 1.0}

    monkeypatch.setattr(generation, "measure", measure)
    args = SimpleNamespace(model_batches={"based": [1, 64, 256, 1024]}, batches=[1], budget_s=0)
    rows = generation.sweep("based", None, args, None, torch.device("cpu"))
    assert [r["batch"] for r in rows] == [1, 64] and tried == [1, 64, 256]
