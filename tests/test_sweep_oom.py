"""zoo-sweep and GPU memory: a job that runs out of device memory beside other jobs is retried alone after them
and ends as the same run trained alone; one that runs out alone is failed; a pack is retried as a pack.

The workers are spawned processes, so the out-of-memory errors are injected by a `sitecustomize` module on
their PYTHONPATH (written by the fixture below), which wraps the step strategies' `step` before any job runs."""

import json
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_run import TINY_RUN

from zoo.jobs import error_line, out_of_memory
from zoo.runs import RunDir
from zoo.sweep import run_sweep

TINY = [*TINY_RUN, "train.epochs=2", "train.early_stop=null", "train.log_every=1"]

INJECT = '''
import os

if os.environ.get("OOM_TEST_RULES"):
    import json

    import torch

    from zoo import steps

    rules = json.loads(os.environ["OOM_TEST_RULES"])  # {lr: times}: raise at step 2 (epoch 1) that many times
    marks = os.environ["OOM_TEST_MARKS"]

    def wrap(step_fn):
        def step(self, seg, idx, step):
            members = [self.members[i] for i in self.live] if hasattr(self, "members") else [self.cfg]
            for member in members:
                times = rules.get(repr(member.optim.lr), 0)
                done = [f for f in os.listdir(marks) if f.startswith(repr(member.optim.lr) + "-")]
                if step == 2 and times == -1:  # the worker process dies (a segfault, the OOM killer)
                    os._exit(1)
                if step == 2 and len(done) < times:
                    open(os.path.join(marks, f"{member.optim.lr!r}-{len(done)}"), "w").close()
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
            return step_fn(self, seg, idx, step)
        return step

    for cls in (steps.PlainStep, steps.PackedStep):
        cls.step = wrap(cls.step)
'''


@pytest.fixture
def inject(tmp_path, monkeypatch):
    """Set `{lr: times}` for the workers spawned after the call: a run (or pack holding a member) of that lr raises
    torch.OutOfMemoryError at its step 2, the first `times` times; times -1: its worker process exits there."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(INJECT))
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{site}:{Path(__file__).resolve().parents[1]}")
    monkeypatch.setenv("OOM_TEST_MARKS", str(marks))

    def rules(times: dict[float, int]) -> Path:
        monkeypatch.setenv("OOM_TEST_RULES", json.dumps({repr(lr): n for lr, n in times.items()}))
        return marks

    return rules


def losses(run_dir: str) -> list[float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    return [row["train/loss"] for row in rows if "train/loss" in row]


def same_run(a: str, b: str) -> None:
    sa, sb = RunDir(a).read_summary(), RunDir(b).read_summary()
    for key in ("valid/accuracy", "test/accuracy", "steps", "epochs"):
        assert sa[key] == pytest.approx(sb[key], abs=1e-6), key
    assert len(losses(a)) == 4 and losses(a) == pytest.approx(losses(b), rel=1e-5)


def test_a_run_out_of_memory_beside_others_is_retried_and_equals_the_run_alone(tmp_path, inject, capfd):
    """lr 1e-3 runs out of memory once: the sweep lowers its jobs at once and runs it again later. lr 3e-3 always
    does: again beside the others, then alone, and then it has failed."""
    marks = inject({1e-3: 1, 3e-3: 9})
    runs = [["model=based", f"optim.lr={lr}"] for lr in ("1e-3", "1e-2", "3e-3")]
    extra = TINY + ["experiment_name=o", f"data.cache_dir={tmp_path / 'cache'}"]
    record = run_sweep(runs, "o", workers=2, device="cpu", extra=extra, runs_root=str(tmp_path / "shared"))
    retried, plain, hopeless = record["runs"]
    assert [r["status"] for r in record["runs"]] == ["finished", "finished", "failed"]
    assert retried["retried_after"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB."
    assert "retried_after" not in plain
    assert hopeless["oom"] and hopeless["retried_after"].startswith("OutOfMemoryError")  # out of memory alone too
    assert "OutOfMemoryError" in (Path(hopeless["run_dir"]) / "error.txt").read_text()
    assert not (Path(retried["run_dir"]) / "error.txt").exists()
    assert len(list(marks.iterdir())) == 1 + 3  # 1e-3 once; 3e-3 twice beside the others, then alone
    err = capfd.readouterr().err
    assert "at most 1 job at once from now" in err and "1 run ran out of GPU memory twice" in err
    alone = run_sweep([runs[0]], "o", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path / "alone"))
    same_run(retried["run_dir"], alone["runs"][0]["run_dir"])


def test_a_dead_worker_fails_its_pools_running_jobs_and_the_rest_go_on(tmp_path, inject):
    """A worker that dies breaks its process pool: the jobs running in it are recorded failed, and the jobs not
    started yet run in a new pool instead of failing with it. With 2 workers one other job at most runs beside the
    dying one; which one it is depends on how fast the dying worker reaches its step 2 (a loaded machine lets the
    other worker finish a run or two first), so the test allows any one, and six runs leave some to the new pool."""
    inject({1e-3: -1})
    runs = [["model=based", f"optim.lr={lr}"] for lr in ("1e-3", "2e-3", "3e-3", "5e-3", "7e-3", "9e-3")]
    extra = TINY + ["experiment_name=d", f"data.cache_dir={tmp_path / 'cache'}"]
    record = run_sweep(runs, "d", workers=2, device="cpu", extra=extra, runs_root=str(tmp_path), order="file")
    dead, *others = record["runs"]
    assert dead["status"] == "failed" and "BrokenProcessPool" in dead["error"]
    failed = [r for r in others if r["status"] != "finished"]
    assert len(failed) <= 1, [r["status"] for r in others]  # the one running beside it when the pool broke
    assert all(r["status"] == "failed" and "BrokenProcessPool" in r["error"] for r in failed)


def test_a_serial_sweep_does_not_retry_out_of_memory(tmp_path, monkeypatch):
    """One worker: nothing shared the GPU, so a run out of memory failed on its own and is not run again."""
    from zoo import steps

    calls = []

    def step(self, seg, idx, step):
        calls.append(step)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")

    monkeypatch.setattr(steps.PlainStep, "step", step)
    extra = TINY + ["experiment_name=s", f"data.cache_dir={tmp_path / 'cache'}"]
    record = run_sweep([["model=based", "optim.lr=1e-3"]], "s", workers=1, device="cpu", extra=extra,
                       runs_root=str(tmp_path))
    (run,) = record["runs"]
    assert run["status"] == "failed" and run["oom"] and "retried_after" not in run
    assert calls == [0]


def test_a_pack_out_of_memory_beside_others_is_retried_as_a_pack(tmp_path, inject):
    inject({1e-2: 1})
    runs = [[f"model={m}", f"optim.lr={lr}"] for m in ("based", "attention") for lr in ("1e-3", "1e-2")]
    extra = TINY + ["experiment_name=p", f"data.cache_dir={tmp_path / 'cache'}"]
    record = run_sweep(runs, "p", workers=2, device="cpu", extra=extra, runs_root=str(tmp_path / "packed"),
                       pack_lrs=True)
    assert [r["status"] for r in record["runs"]] == ["finished"] * 4
    assert [r.get("packed") for r in record["runs"]] == [2] * 4
    assert not any("unpacked" in r for r in record["runs"])
    first = [r for r in record["runs"] if "retried_after" in r]
    assert len(first) in (2, 4)  # the pack that raised first was retried whole; the other may have raised too
    assert all(r["retried_after"].startswith("OutOfMemoryError") for r in first)


@pytest.mark.parametrize(
    "error,want",
    [(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."), True),
     (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
     (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
     (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
     (MemoryError(), False),
     (FloatingPointError("diverged"), False)],
    ids=["allocator", "cuda-call", "cublas", "illegal-access", "host-memory", "divergence"],
)
def test_out_of_memory_is_told_from_other_failures(error, want):
    assert out_of_memory(error) is want


@pytest.mark.parametrize("inner,want", [(torch.OutOfMemoryError("CUDA out of memory."), True),
                                        (ValueError("bad shape"), False)], ids=["oom", "other"])
def test_out_of_memory_is_found_behind_a_compiler_wrapper(inner, want):
    """torch.compile raises BackendCompilerFailed from what went wrong inside it (an allocation while autotuning);
    the record's line names both."""
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        try:
            raise inner
        except Exception as e:
            raise BackendCompilerFailed(lambda *a: None, e, None) from e
    except BackendCompilerFailed as wrapped:
        assert out_of_memory(wrapped) is want
        assert error_line(wrapped).endswith(f"(from {type(inner).__name__}: {inner})")
