"""`train.resume=true` continues the killed run: the README's two literal commands, with a kill -9 between
them, give the demo's uninterrupted result; the lookup finds the latest run of the same config whatever its
directory is called, and without one it says what it looked for."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_readme import marked_block
from tiny_run import TINY_RUN

from zoo.runs import RunDir, find_resumable
from zoo.train import EXECUTION_KEYS, ConfigError, load_config, train

RESUME_LINES = [line.split("  #", 1)[0].strip() for line in marked_block("resume").splitlines() if line.strip()]


def as_argv(line: str) -> list[str]:
    """A README line `.venv/bin/zoo-train ARGS` as this interpreter's `python -m zoo.cli zoo-train ARGS`."""
    prog, *args = shlex.split(line)
    assert prog == ".venv/bin/zoo-train", prog
    return [sys.executable, "-m", "zoo.cli", "zoo-train", *args]


def test_readme_has_the_two_commands():
    assert len(RESUME_LINES) == 2
    first, second = RESUME_LINES
    assert second == first + " train.resume=true"


def test_readme_resume_continues_the_killed_run(demo_runs, tmp_path):
    rows, _ = demo_runs
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    first = subprocess.Popen(as_argv(RESUME_LINES[0]), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "runs" / "demo").glob("*/ckpt/last.pt")):
        assert first.poll() is None, first.stderr.read()
        assert time.monotonic() < deadline, "no checkpoint after 300 s"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    (run_dir,) = (tmp_path / "runs" / "demo").iterdir()
    assert not RunDir(run_dir).is_finished(), "the first command finished before the kill"

    second = subprocess.run(as_argv(RESUME_LINES[1]), cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resuming {Path('runs') / 'demo' / run_dir.name} at epoch" in second.stderr
    assert [p.name for p in (tmp_path / "runs" / "demo").iterdir()] == [run_dir.name]
    resumed = RunDir(run_dir).read_summary()
    uninterrupted = dict(rows)["based"]
    for key in ("valid/accuracy", "test/accuracy", "epochs", "steps", "best_valid_accuracy"):
        assert resumed[key] == uninterrupted[key], key


QUICK = ["model=based", *TINY_RUN, "train.epochs=1", "train.progress=false"]


def started_run(root: Path, *extra: str) -> RunDir:
    """A run dir holding only the config of a started run (as a kill before the first checkpoint leaves it)."""
    cfg, resolved = load_config([*QUICK, f"runs_root={root}", *extra])
    run = RunDir(root / cfg.experiment_name / (cfg.run or "x"))
    run.write_config(resolved + f"run_dir: {run.path}\n")
    return run


def test_finds_a_run_under_another_name(tmp_path):
    other = started_run(tmp_path, "run=my-run")
    _, resolved = load_config([*QUICK, f"runs_root={tmp_path}", "train.resume=true", "train.threads=1"])
    assert find_resumable(tmp_path / "default", resolved, EXECUTION_KEYS["train"]).path == other.path


def test_takes_the_latest_of_two(tmp_path):
    old = started_run(tmp_path, "run=old")
    new = started_run(tmp_path, "run=new")
    os.utime(old.path / "config.yaml", (time.time() - 60, time.time() - 60))
    _, resolved = load_config([*QUICK, f"runs_root={tmp_path}"])
    assert find_resumable(tmp_path / "default", resolved, EXECUTION_KEYS["train"]).path == new.path


def test_another_config_is_not_resumed(tmp_path):
    started_run(tmp_path, "run=mine")
    cfg, resolved = load_config([*QUICK, f"runs_root={tmp_path}", "optim.lr=0.01", "train.resume=true"])
    with pytest.raises(ConfigError) as e:
        train(cfg, resolved)
    message = str(e.value)
    assert f"no run in {tmp_path / 'default'}/ has this config (1 runs there" in message
    assert "train.resume" in message and "drop train.resume" in message
    assert not (tmp_path / "default" / "mine" / "metrics.jsonl").exists()


def test_run_control_fields_are_ignored(tmp_path):
    run = started_run(tmp_path, "run=r")
    tree = yaml.safe_load((run.path / "config.yaml").read_text())
    assert "run_dir" in tree
    _, resolved = load_config([*QUICK, f"runs_root={tmp_path}", "train.device=cpu", "logger.mode=disabled"])
    assert find_resumable(tmp_path / "default", resolved, EXECUTION_KEYS["train"]).path == run.path


def test_overwrite_keeps_the_earlier_run_until_the_new_one_is_built(tmp_path, monkeypatch):
    """train.overwrite=true clears the run dir only once the data and the model are built: a failure there (a
    full disk for the data cache, an out-of-memory model) leaves the earlier run as it was."""
    import zoo.train as train_mod

    args = [*TINY_RUN, "train.epochs=1", "train.device=cpu", f"runs_root={tmp_path}", "run=r",
            f"data.cache_dir={tmp_path / 'cache'}"]
    train(*load_config(args))
    run = tmp_path / "default" / "r"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert "summary.json" in before

    def fails(members):
        raise OSError("No space left on device")

    monkeypatch.setattr(train_mod, "_setup", fails)
    with pytest.raises(OSError, match="No space"):
        train(*load_config([*args, "train.overwrite=true"]))
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
