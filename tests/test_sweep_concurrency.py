"""zoo-sweep's concurrency on CPU: runs trained by concurrent workers equal the same runs trained one at a time,
a failing run among concurrent or packed ones is recorded while the others finish, CUDA MPS is used only where
the machine has it (a log line says why not), the costliest jobs start first, and every run compiles into the
sweep's compile cache."""

import json
import os
from pathlib import Path

import pytest
import torch
from tiny_run import TINY_RUN

from zoo.gpus import MPS
from zoo.jobs import order_jobs
from zoo.runs import RunDir
from zoo.sweep import run_sweep

TINY = [*TINY_RUN, "train.epochs=2", "train.early_stop=null", "train.log_every=1"]
GRID = [[f"model={m}", f"optim.lr={lr}"] for m in ("based", "attention") for lr in ("1e-3", "1e-2")]


def by_overrides(record: dict) -> dict[str, dict]:
    return {" ".join(r["overrides"]): r for r in record["runs"]}


@pytest.fixture(scope="module")
def serial_and_concurrent(tmp_path_factory):
    """The same 4 runs (and one that fails in training) trained by one worker and by two concurrent workers."""
    tmp = tmp_path_factory.mktemp("sweeps")
    bad = ["model=hyena", "model.mixers.hyena.max_seq_len=8"]  # valid config, raises in training
    out = {}
    for workers in (1, 2):
        root = tmp / f"w{workers}"
        extra = TINY + ["experiment_name=t", f"data.cache_dir={tmp / 'cache'}"]
        out[workers] = run_sweep(GRID + [bad], "t", workers=workers, device="cpu", extra=extra, runs_root=str(root))
    return out


@pytest.mark.parametrize("run", [" ".join(r) for r in GRID])
def test_a_concurrent_run_equals_the_same_run_alone(serial_and_concurrent, run):
    serial, concurrent = (by_overrides(serial_and_concurrent[w])[run] for w in (1, 2))
    assert serial["status"] == concurrent["status"] == "finished"
    a, b = (RunDir(r["run_dir"]) for r in (serial, concurrent))
    sa, sb = a.read_summary(), b.read_summary()
    for key in ("valid/accuracy", "test/accuracy", "steps", "epochs"):
        assert sa[key] == pytest.approx(sb[key], abs=1e-6), key
    rows = [[json.loads(line) for line in (d.path / "metrics.jsonl").read_text().splitlines()] for d in (a, b)]
    losses = [[r["train/loss"] for r in rs if "train/loss" in r] for rs in rows]
    assert losses[0] and losses[0] == pytest.approx(losses[1], rel=1e-5)
    pa, pb = a.load_checkpoint()["model"], b.load_checkpoint()["model"]
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=1e-5, atol=1e-6)


def test_a_failing_run_among_concurrent_ones_is_recorded_and_the_others_finish(serial_and_concurrent):
    record = serial_and_concurrent[2]
    statuses = [r["status"] for r in record["runs"]]
    assert statuses == ["finished"] * 4 + ["failed"]
    assert "exceed max_seq_len=8" in (Path(record["runs"][4]["run_dir"]) / "error.txt").read_text()


def test_a_failing_member_of_a_pack_is_recorded_and_the_others_train_packed(tmp_path):
    runs = [["model=based", f"optim.lr={lr}"] for lr in ("1e-3", "-1", "1e-2")]
    extra = TINY + ["experiment_name=p", f"data.cache_dir={tmp_path / 'cache'}"]
    record = run_sweep(runs, "p", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path), pack_lrs=True)
    statuses = [r["status"] for r in record["runs"]]
    assert statuses == ["finished", "failed", "finished"]
    assert "optim.lr must be > 0" in record["runs"][1]["error"]
    assert [record["runs"][i].get("packed") for i in (0, 2)] == [2, 2]


def test_a_member_failing_in_training_fails_alone_and_the_others_finish(tmp_path, monkeypatch):
    """A pack whose member raises in its second epoch (a divergence) is retried one run at a time, from the pack's
    checkpoints: that run is recorded failed with its error.txt, and the others finish, equal to the same runs
    trained alone."""
    from zoo import steps

    bad = 0.005

    def failing(step_fn):
        def step(self, seg, idx, step):
            members = [self.members[i] for i in self.live] if hasattr(self, "members") else [self.cfg]
            if step >= 3 and any(m.optim.lr == bad for m in members):
                raise FloatingPointError(f"lr={bad} diverged at step {step}")
            return step_fn(self, seg, idx, step)
        return step

    for cls in (steps.PlainStep, steps.PackedStep):
        monkeypatch.setattr(cls, "step", failing(cls.step))
    runs = [["model=based", f"optim.lr={lr}"] for lr in ("1e-3", str(bad), "1e-2")]
    extra = TINY + ["experiment_name=f", f"data.cache_dir={tmp_path / 'cache'}"]
    record = run_sweep(runs, "f", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path / "packed"),
                       pack_lrs=True)
    assert [r["status"] for r in record["runs"]] == ["finished", "failed", "finished"]
    assert record["runs"][1]["error"] == f"FloatingPointError: lr={bad} diverged at step 3"
    assert "diverged" in (Path(record["runs"][1]["run_dir"]) / "error.txt").read_text()
    assert all("the pack failed (FloatingPointError" in r["unpacked"] for r in record["runs"])
    alone = run_sweep([runs[0], runs[2]], "f", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path / "alone"))
    for retried, single in zip((record["runs"][0], record["runs"][2]), alone["runs"]):
        a, b = RunDir(retried["run_dir"]).read_summary(), RunDir(single["run_dir"]).read_summary()
        for key in ("valid/accuracy", "test/accuracy", "steps", "epochs"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
        rows = [[json.loads(line) for line in (Path(r["run_dir"]) / "metrics.jsonl").open()] for r in (retried, single)]
        losses = [[row["train/loss"] for row in rs if "train/loss" in row] for rs in rows]
        assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-5)  # 2 packed steps, then 2 alone


@pytest.mark.parametrize(
    "device,workers,which,reason",
    [("cpu", 4, "/bin/true", "nothing shares a GPU"), ("cuda", 1, "/bin/true", "nothing shares a GPU"),
     ("cuda", 4, None, "not on PATH")],
    ids=["cpu", "one-worker", "no-mps-binary"],
)
def test_mps_is_used_only_where_available(monkeypatch, device, workers, which, reason):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr("zoo.gpus.shutil.which", lambda name: which)
    daemon, why = MPS.start(device, workers, "auto")
    assert daemon is None and "MPS not used" in why and reason in why
    with pytest.raises(SystemExit, match="--mps on"):
        MPS.start(device, workers, "on")


def test_mps_off_and_a_caller_daemon_start_nothing(monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/elsewhere")
    daemon, why = MPS.start("cuda", 4, "auto")
    assert daemon is None and "already set up by the caller" in why
    daemon, why = MPS.start("cuda", 4, "off")
    assert daemon is None and "--mps off" in why


@pytest.mark.parametrize("workers,device", [(2, "cpu"), (1, "cpu"), (1, "auto")],
                         ids=["pool", "serial", "serial-auto"])
def test_every_sweep_says_once_why_mps_is_not_used(tmp_path, capfd, caplog, workers, device):
    extra = TINY + ["experiment_name=m", "train.epochs=1", f"data.cache_dir={tmp_path / 'cache'}"]
    with caplog.at_level("INFO", logger="zoo.sweep"):
        run_sweep(GRID[:2], "m", workers=workers, device=device, extra=extra, runs_root=str(tmp_path))
    line = f"zoo-sweep m: CUDA MPS not used ({workers} worker(s) on {device}: nothing shares a GPU)"
    assert capfd.readouterr().err.count(line) == 1
    assert sum("CUDA MPS" in r.getMessage() for r in caplog.records) == 1


def test_multirun_says_why_mps_is_not_used():
    assert MPS.multirun_reason({}).startswith("CUDA MPS not used (zoo-train -m starts no daemon")
    assert "set up by the caller" in MPS.multirun_reason({"CUDA_MPS_PIPE_DIRECTORY": "/tmp/elsewhere"})


def test_jobs_start_in_the_order_asked():
    def run(d, L, epochs):
        return [f"model.d_model={d}", f"data.train=[{{seq_len: {L}, num_kv_pairs: 4}}]", f"train.epochs={epochs}"]

    runs = [run(64, 64, 64), run(512, 256, 64), run(128, 128, 64), run(512, 256, 16), run(128, 128, 64)]
    jobs = [[i] for i in range(len(runs))]
    assert order_jobs(jobs, runs, "longest") == [[1], [3], [2], [4], [0]]  # ties (2, 4) keep the file's order
    assert order_jobs(jobs, runs, "shortest") == [[0], [2], [4], [3], [1]]
    assert order_jobs(jobs, runs, "file") == jobs
    with pytest.raises(ValueError, match="order must be one of longest, shortest, file"):
        order_jobs(jobs, runs, "random")


def test_a_pack_costs_its_members():
    """A pack of four d = 256 runs (`--pack-max-d 256`) outweighs one d = 512 run trained alone."""
    runs = [[f"model.d_model={d}", f"optim.lr={lr}"] for d, lr in [(512, 1e-3)] + [(256, lr) for lr in (1, 2, 3, 4)]]
    jobs = [[0], [1, 2, 3, 4]]
    assert order_jobs(jobs, runs, "longest") == [[1, 2, 3, 4], [0]]
    assert order_jobs(jobs, runs, "shortest") == [[0], [1, 2, 3, 4]]


# logger.project is a free string outside the run's identity: here it records what a run's process saw
SEES_CACHE = "logger.project=${oc.env:TRITON_CACHE_DIR,unset}|${oc.env:TORCHINDUCTOR_CACHE_DIR,unset}"


def _seen(record: dict) -> set[str]:
    import yaml

    seen = set()
    for r in record["runs"]:
        text = (Path(r["run_dir"]) / "config.yaml").read_text()
        seen.add(yaml.safe_load(text)["logger"]["project"])
    return seen


@pytest.mark.parametrize("workers", [1, 2])
def test_runs_compile_into_the_sweeps_cache(tmp_path, workers, monkeypatch):
    """Serial and pool runs see TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR under <runs_root>/_sweeps/compile_cache,
    and the sweep's own environment is as before once it returns."""
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    extra = TINY + ["experiment_name=c", "train.epochs=1", f"data.cache_dir={tmp_path / 'data'}", SEES_CACHE]
    record = run_sweep(GRID[:2], "c", workers=workers, device="cpu", extra=extra, runs_root=str(tmp_path))
    cache = (tmp_path / "_sweeps" / "compile_cache").resolve()
    assert record["finished"] == 2 and _seen(record) == {f"{cache / 'triton'}|{cache / 'inductor'}"}
    assert "TRITON_CACHE_DIR" not in os.environ and "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_the_callers_cache_and_none_are_kept(tmp_path, monkeypatch):
    """A cache variable the caller set wins; cache="none" sets nothing."""
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    extra = TINY + ["experiment_name=c", "train.epochs=1", f"data.cache_dir={tmp_path / 'data'}", SEES_CACHE]
    kept = run_sweep(GRID[:1], "c", device="cpu", extra=extra, runs_root=str(tmp_path / "a"))
    inductor = (tmp_path / "a" / "_sweeps" / "compile_cache" / "inductor").resolve()
    assert _seen(kept) == {f"/elsewhere/triton|{inductor}"}
    monkeypatch.delenv("TRITON_CACHE_DIR")
    none = run_sweep(GRID[:1], "c", device="cpu", extra=extra, runs_root=str(tmp_path / "b"), cache="none")
    assert _seen(none) == {"unset|unset"}
