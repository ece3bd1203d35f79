"""zoo-sweep's record says how busy the GPUs were (zoo.gpus.GpuMonitor), read from nvidia-smi; here a fake
nvidia-smi on PATH prints the samples, so the parsing, the record and the monitor's end run on CPU."""

import os
import time
from pathlib import Path

import pytest
from tiny_run import TINY_RUN

from zoo.gpus import GpuMonitor
from zoo.sweep import run_sweep

SAMPLES = ["0, 50, 1000", "1, 100, 2000", "0, [N/A], 1500", "0, 70, 3000", ""]


def fake_smi(tmp_path: Path, lines: list[str]) -> Path:
    """An executable `nvidia-smi` that prints `lines`, writes its pid, then samples forever (as `-lms` does)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    body = "".join(f"echo '{line}'\n" for line in lines)
    exe.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'smi.pid'}\necho \"$@\" > {tmp_path / 'smi.args'}\n{body}"
                   "exec sleep 600\n")
    exe.chmod(0o755)
    return bin_dir


def wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_samples_are_averaged_per_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path, SAMPLES)}:{os.environ['PATH']}")
    monitor = GpuMonitor("cuda")
    wait_for(lambda: sum(len(v) for v in monitor.samples.values()) == 3)
    monitor.stop()
    assert monitor.summary() == {
        "0": {"util_mean_pct": 60.0, "mem_peak_mib": 3000.0, "samples": 2},  # the "[N/A]" line is no sample
        "1": {"util_mean_pct": 100.0, "mem_peak_mib": 2000.0, "samples": 1},
    }
    assert not alive(int((tmp_path / "smi.pid").read_text()))
    args = (tmp_path / "smi.args").read_text().split()
    assert args == ["--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits", "--loop-ms=2000"]


def test_nothing_is_sampled_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path, SAMPLES)}:{os.environ['PATH']}")
    monitor = GpuMonitor("cpu")
    assert monitor.proc is None and monitor.summary() == {}
    monitor.stop()
    assert not (tmp_path / "smi.pid").exists()


def test_without_nvidia_smi_nothing_is_sampled(monkeypatch):
    monitor = GpuMonitor("cuda", exe="no-such-nvidia-smi-here")
    assert monitor.proc is None and monitor.summary() == {}
    monitor.stop()


TINY = ["model=based", *TINY_RUN, "train.epochs=1", "train.early_stop=null"]


@pytest.mark.parametrize("workers", [1, 2])
def test_sweep_record_holds_the_gpus_and_the_sampler_ends(tmp_path, monkeypatch, capfd, workers):
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path, SAMPLES)}:{os.environ['PATH']}")
    runs = [["optim.lr=1e-3"], ["optim.lr=3e-3"]]
    extra = TINY + ["experiment_name=t", f"data.cache_dir={tmp_path / 'cache'}", "train.device=cpu"]
    record = run_sweep(runs, "t", workers=workers, device="auto", extra=extra, runs_root=str(tmp_path / "runs"),
                       mps="off")
    assert record["finished"] == 2
    assert record["gpus"]["0"]["util_mean_pct"] == 60.0
    assert "GPU 0 ran kernels 60% of the time (2 samples), peak memory 2.9 GiB" in capfd.readouterr().err
    assert not alive(int((tmp_path / "smi.pid").read_text()))
