"""Sharing GPUs between a sweep's worker processes: which GPU a worker sees (`visible_device`, `devices_for`), a
CUDA MPS daemon so that workers on one GPU run their kernels at the same time (`MPS`), and how busy the GPUs were
(`GpuMonitor`). torch is imported only where a GPU is asked about, so `zoo-sweep --dry-run` stays light."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

MPS_CONTROL = "nvidia-cuda-mps-control"


def visible_device(index: int, environ=os.environ) -> str:
    """The CUDA_VISIBLE_DEVICES entry of the sweep's GPU `index` (cuda:index in the sweep's process).

    Indices count the GPUs the sweep sees, so under CUDA_VISIBLE_DEVICES=2,3 GPU 1 is device "3"; writing the
    bare index would move a worker onto another GPU (it once put a sweep meant for GPU 1 onto GPU 0)."""
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return str(index)
    if index >= len(visible):
        raise ValueError(f"GPU {index} is not among CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}")
    return visible[index]


def devices_for(device: str, workers: int) -> list[str]:
    """One device per worker: GPUs round-robin (cuda:i), or cpu."""
    if device == "cpu":
        return ["cpu"] * workers
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        if device == "cuda":
            raise RuntimeError("zoo-sweep --device cuda: no CUDA device visible")
        return ["cpu"] * workers
    return [f"cuda:{i % count}" for i in range(workers)]


class MPS:
    """A CUDA MPS control daemon for the sweep's lifetime, so the runs sharing a GPU execute their kernels at
    the same time instead of time-slicing it. Its pipe and log directories are private to this sweep and are
    exported to the worker processes, which connect to it when they initialise CUDA."""

    def __init__(self, exe: str, directory: Path) -> None:
        self.exe, self.directory = exe, directory
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(directory / "log"),
        }

    @classmethod
    def start(cls, device: str, workers: int, mode: str) -> tuple[MPS | None, str]:
        """Start a daemon when `mode` (auto | on | off) and the machine allow it; return it (or None) and the
        reason, which the sweep logs. mode=on makes an impossible start an error."""
        reason = None
        if mode == "off":
            reason = "--mps off"
        elif device == "cpu" or workers <= 1:
            reason = f"{workers} worker(s) on {device}: nothing shares a GPU"
        elif os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
            pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
            return None, f"CUDA MPS already set up by the caller (CUDA_MPS_PIPE_DIRECTORY={pipe})"
        elif shutil.which(MPS_CONTROL) is None:
            reason = f"{MPS_CONTROL} is not on PATH"
        if reason is None:
            import torch

            if torch.cuda.device_count() == 0:
                reason = "no CUDA device visible"
        if reason is not None:
            if mode == "on":
                raise SystemExit(f"zoo-sweep: --mps on, but CUDA MPS cannot be used: {reason}")
            shared = workers > 1 and device != "cpu"
            return None, f"CUDA MPS not used ({reason})" + ("; runs sharing a GPU time-slice it" if shared else "")
        daemon = cls(shutil.which(MPS_CONTROL), Path(tempfile.mkdtemp(prefix="zoo-mps-")))
        for d in daemon.env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        r = subprocess.run([daemon.exe, "-d"], env=os.environ | daemon.env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            shutil.rmtree(daemon.directory, ignore_errors=True)
            why = (r.stderr or r.stdout).strip() or f"exit status {r.returncode}"
            if mode == "on":
                raise SystemExit(f"zoo-sweep: --mps on, but {MPS_CONTROL} -d failed: {why}")
            return None, f"CUDA MPS not used ({MPS_CONTROL} -d failed: {why})"
        os.environ.update(daemon.env)
        return daemon, f"CUDA MPS started for this sweep ({daemon.env['CUDA_MPS_PIPE_DIRECTORY']})"

    @staticmethod
    def multirun_reason(environ=os.environ) -> str:
        """The line of `zoo-train -m`, whose jobs Hydra's launcher starts: it starts no daemon itself."""
        if environ.get("CUDA_MPS_PIPE_DIRECTORY"):
            return f"CUDA MPS set up by the caller (CUDA_MPS_PIPE_DIRECTORY={environ['CUDA_MPS_PIPE_DIRECTORY']})"
        return (f"CUDA MPS not used (zoo-train -m starts no daemon: Hydra's launcher starts the jobs; run "
                f"`{MPS_CONTROL} -d` first, or use zoo-sweep); jobs sharing a GPU time-slice it")

    def stop(self) -> None:
        subprocess.run([self.exe], input="quit\n", env=os.environ | self.env, capture_output=True, text=True,
                       timeout=60)
        for key in self.env:
            os.environ.pop(key, None)
        shutil.rmtree(self.directory, ignore_errors=True)


class GpuMonitor:
    """How busy the sweep kept its GPUs: `nvidia-smi` sampled every `interval_s` in a background process for the
    pool's lifetime. `summary()` gives per GPU the mean of `utilization.gpu` (the share of the sample period in
    which a kernel ran, so under CUDA MPS it says whether the GPU ever idled, not how full its SMs were) and the
    peak memory used, for the sweep's record. Without nvidia-smi, or on the CPU, it records nothing."""

    QUERY = ["--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"]

    def __init__(self, device: str, interval_s: float = 2.0, exe: str = "nvidia-smi") -> None:
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.proc = self.thread = None
        path = shutil.which(exe)
        if device == "cpu" or path is None:
            return
        try:
            self.proc = subprocess.Popen([path, *self.QUERY, f"--loop-ms={max(100, int(interval_s * 1000))}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                index, util, mem = (x.strip() for x in line.split(","))
                self.samples.setdefault(index, []).append((float(util), float(mem)))
            except ValueError:  # a header, a blank or "[N/A]": not a sample
                continue

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.thread.join(timeout=10)
            self.proc = None

    def summary(self) -> dict[str, dict[str, float]]:
        """{gpu index: {"util_mean_pct", "mem_peak_mib", "samples"}}; empty when nothing was sampled."""
        snapshot = {index: list(rows) for index, rows in list(self.samples.items())}  # the reader thread appends
        return {
            index: {"util_mean_pct": round(sum(u for u, _ in rows) / len(rows), 1),
                    "mem_peak_mib": max(m for _, m in rows), "samples": len(rows)}
            for index, rows in sorted(snapshot.items()) if rows
        }
