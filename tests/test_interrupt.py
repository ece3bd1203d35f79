"""A run stopped mid-epoch (train.stop_at, SIGTERM) checkpoints where it is, and train.resume=true continues it
to the same result as a run that never stopped; zoo-sweep --time-limit records such runs as pending and its next
call finishes them."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zoo.train
from zoo.runs import RunDir
from zoo.sweep import run_sweep
from zoo.train import Interrupted, load_config, run_name, train

TINY = [
    "model=attention",
    "model.d_model=16",
    "data.vocab_size=64",
    "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:64,batch_size:16}]",  # 4 steps an epoch
    "data.valid=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
    "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
    "train.epochs=3",
    "train.early_stop=null",
    "train.log_every=1",
    "train.progress=false",
    "train.threads=1",
]


def stop_after(steps: int):
    """A stand-in for zoo.train.stop_requests that asks to stop after `steps` steps."""

    @contextlib.contextmanager
    def requests(stop_at):
        calls = iter(range(10**9))
        yield lambda: next(calls) >= steps  # call 0 is the check before training starts, call k follows step k

    return requests


def run_dir(root: Path, *extra) -> RunDir:
    cfg, _ = load_config([*TINY, f"runs_root={root}", *extra])
    return RunDir(root / cfg.experiment_name / run_name(cfg))


@pytest.mark.parametrize("stop_step", [1, 4, 6], ids=["mid-epoch-0", "epoch-end", "mid-epoch-1"])
def test_stopped_and_resumed_run_equals_the_uninterrupted_one(tmp_path, monkeypatch, stop_step):
    cfg, resolved = load_config([*TINY, f"runs_root={tmp_path / 'ref'}"])
    ref = train(cfg, resolved)
    monkeypatch.setattr(zoo.train, "stop_requests", stop_after(stop_step))
    cfg, resolved = load_config([*TINY, f"runs_root={tmp_path / 'got'}"])
    with pytest.raises(Interrupted, match=f"step {stop_step}"):
        train(cfg, resolved)
    run = run_dir(tmp_path / "got")
    assert run.load_checkpoint()["step"] == stop_step and not run.is_finished()
    monkeypatch.undo()
    cfg, resolved = load_config([*TINY, f"runs_root={tmp_path / 'got'}", "train.resume=true"])
    got = train(cfg, resolved)
    for key in ("valid/accuracy", "test/accuracy", "best_valid_accuracy", "steps", "epochs"):
        if key in ref:
            assert got[key] == pytest.approx(ref[key], rel=1e-5), key
    ref_metrics = RunDir(Path(ref["run_dir"]) if "run_dir" in ref else run_dir(tmp_path / "ref").path).read_metrics()
    got_metrics = run.read_metrics()
    assert [m["step"] for m in got_metrics] == [m["step"] for m in ref_metrics]
    for r, g in zip(ref_metrics, got_metrics):
        for k, v in r.items():
            if isinstance(v, float):
                assert g[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (k, r["step"])


def test_stop_at_in_the_past_starts_nothing(tmp_path):
    cfg, resolved = load_config([*TINY, f"runs_root={tmp_path}", f"train.stop_at={time.time() - 1:.3f}"])
    with pytest.raises(Interrupted, match="before the run started"):
        train(cfg, resolved)
    assert not run_dir(tmp_path).exists()


def test_sweep_time_limit_leaves_runs_pending_and_the_next_call_finishes_them(tmp_path, monkeypatch):
    runs = [[*TINY, f"optim.lr={lr}"] for lr in (1e-3, 1e-2)]
    monkeypatch.setattr(zoo.train, "stop_requests", stop_after(5))
    first = run_sweep(runs, "interrupt", workers=1, runs_root=str(tmp_path))
    # the first run stops at step 5 and the sweep starts nothing more
    assert [r["status"] for r in first["runs"]] == ["pending", "pending"]
    assert "interrupted" in first["runs"][0] and first["runs"][1]["run_dir"] is None
    monkeypatch.undo()
    second = run_sweep(runs, "interrupt", workers=1, runs_root=str(tmp_path))
    assert [r["status"] for r in second["runs"]] == ["finished", "finished"]


def test_sigterm_stops_zoo_train_with_a_checkpoint(tmp_path):
    """A real SIGTERM to a zoo-train process: exit status 75, a checkpoint, and resume finishes the run."""
    args = [*TINY, "train.epochs=400", f"runs_root={tmp_path}"]
    cmd = [sys.executable, "-m", "zoo.cli", "zoo-train", *args]
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    run = run_dir(tmp_path, "train.epochs=400")
    deadline = time.time() + 120
    while not (run.path / "metrics.jsonl").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "checkpointed" in err
    step = run.load_checkpoint()["step"]
    assert 0 < step < 400 * 4
    steps = [json.loads(line)["step"] for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) <= step


def test_sigterm_to_a_parallel_zoo_sweep_checkpoints_its_runs(tmp_path):
    """`timeout` sends SIGTERM to the sweep process only: the sweep passes it to its workers, whose runs
    checkpoint and come back pending, and the run not started stays pending (its job was already queued)."""
    sweep_file = tmp_path / "sweep.py"
    long_tiny = [o for o in TINY if not o.startswith("train.epochs")] + ["train.epochs=400"]
    runs = [[*long_tiny, f"optim.lr={lr}"] for lr in (1e-3, 2e-3, 3e-3)]
    sweep_file.write_text(f"def sweep():\n    return {runs!r}\n")
    root = tmp_path / "runs"
    cmd = [sys.executable, "-m", "zoo.sweep", str(sweep_file), "--workers", "2", "--device", "cpu", "--runs-root",
           str(root), "--mps", "off", "--order", "file"]
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 180
    while len(list(root.glob("*/*/metrics.jsonl"))) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    record = json.loads(next((root / "_sweeps").glob("*.json")).read_text())
    statuses = [r["status"] for r in record["runs"]]
    assert statuses == ["pending"] * 3, (statuses, err[-2000:])
    interrupted = [r for r in record["runs"] if "interrupted" in r]
    assert len(interrupted) == 2 and record["runs"][2]["run_dir"] is None
    for r in interrupted:
        ckpt = RunDir(r["run_dir"]).load_checkpoint()
        assert 0 < ckpt["step"] < 400 * 4
        assert r["epochs_done"] == ckpt["epoch"]  # how far it got, for planning the next call
    assert "finished epochs; the same command resumes them" in out


def test_a_stopped_pack_resumes_to_the_uninterrupted_packs_result(tmp_path, monkeypatch):
    from zoo.steps import pack_members
    from zoo.train import train_runs

    lrs = [1e-3, 1e-2]
    cfg, _ = load_config([*TINY, f"runs_root={tmp_path / 'ref'}"])
    ref = train_runs(pack_members(cfg, lrs))
    monkeypatch.setattr(zoo.train, "stop_requests", stop_after(6))
    cfg, _ = load_config([*TINY, f"runs_root={tmp_path / 'got'}"])
    with pytest.raises(Interrupted):
        train_runs(pack_members(cfg, lrs))
    monkeypatch.undo()
    cfg, _ = load_config([*TINY, f"runs_root={tmp_path / 'got'}", "train.resume=true"])
    got = train_runs(pack_members(cfg, lrs))
    for r, g in zip(ref, got):
        for key in ("valid/accuracy", "test/accuracy", "best_valid_accuracy"):
            assert g[key] == pytest.approx(r[key], rel=1e-5), key
