"""experiments/bench/sweep_speed.py's probe: what it reads back from the sweep's record and the runs' summaries."""

import json
import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def bench(sweep_speed_bench):
    return sweep_speed_bench


def fake_sweep(runs: list[tuple[str, float, int, float]], stderr: str):
    """A stand-in for the probe's `zoo-sweep` subprocess: writes a record with one row per (name, job wall_s,
    packed, training wall_time_s) and each run's summary, under the --runs-root it is given."""

    def run(cmd, **kwargs):
        root = Path(cmd[cmd.index("--runs-root") + 1])
        name = cmd[cmd.index("--name") + 1]
        rows = []
        for run_name, wall, packed, train in runs:
            run_dir = root / "probe16" / f"{run_name}-0123abcd"
            run_dir.mkdir(parents=True)
            (run_dir / "summary.json").write_text(json.dumps({"wall_time_s": train}))
            rows.append({"run_dir": str(run_dir), "status": "finished", "wall_s": wall, "valid/accuracy": 0.5,
                         "packed": packed})
        (root / "_sweeps").mkdir()
        (root / "_sweeps" / f"{name}.json").write_text(json.dumps({"runs": rows}))
        return subprocess.CompletedProcess(cmd, 0, "", stderr)

    return run


def test_a_pack_counts_once_in_the_jobs_and_training_time(bench, monkeypatch):
    runs = [("attention-lr1-s0", 40.0, 2, 30.0), ("attention-lr2-s0", 40.0, 2, 30.0), ("based-lr1-s0", 25.0, 1, 20.0)]
    monkeypatch.setattr(bench.subprocess, "run", fake_sweep(runs, ""))
    out = bench.run_probe("x", "", "--workers 2", {})
    assert out["finished"] == 3
    assert out["jobs_s"] == pytest.approx(40.0 + 25.0)
    assert out["training_s"] == pytest.approx(30.0 + 20.0)
    assert set(out["valid_accuracy"]) == {name for name, *_ in runs}


def test_the_mps_line_drops_the_progress_bar_before_it(bench, monkeypatch):
    stderr = "\rsweep probe16-x:   0%|   | 0/16 [00:00<?, ?it/s]zoo-sweep probe16-x: CUDA MPS not used (--mps off)\n"
    monkeypatch.setattr(bench.subprocess, "run", fake_sweep([("a-lr1-s0", 1.0, 1, 1.0)], stderr))
    assert bench.run_probe("x", "", "", {})["mps"] == "zoo-sweep probe16-x: CUDA MPS not used (--mps off)"


def test_a_variant_s_environment_reaches_its_sweep_and_its_record(bench, monkeypatch):
    seen = {}
    sweep = fake_sweep([("based-lr1-s0", 1.0, 1, 1.0)], "")

    def run(cmd, **kwargs):
        seen.update(kwargs["env"])
        return sweep(cmd, **kwargs)

    monkeypatch.setattr(bench.subprocess, "run", run)
    out = bench.run_probe("t", "", "", {"KEEP": "1"}, "ZOO_PROBE_BASED_IMPL=triton")
    assert seen["ZOO_PROBE_BASED_IMPL"] == "triton" and seen["KEEP"] == "1"
    assert out["env"] == "ZOO_PROBE_BASED_IMPL=triton"
    assert "env" not in bench.run_probe("u", "", "", {})


def test_a_variant_s_environment_must_be_assignments(bench):
    with pytest.raises(SystemExit, match="NAME=VALUE items, got 'triton'"):
        bench.variant_env("triton")


def test_the_probe_s_based_impl_reaches_the_based_runs_only(monkeypatch):
    from zoo.sweep import load_sweep

    probe = Path(__file__).resolve().parents[1] / "experiments" / "bench" / "probe16.py"
    monkeypatch.setenv("ZOO_PROBE_BASED_IMPL", "triton")
    runs = load_sweep(str(probe))
    based = [r for r in runs if "model=based" in r]
    assert len(based) == 8 and all("+model.mixers.based.impl=triton" in r for r in based)
    assert not any("impl" in o for r in runs if "model=attention" in r for o in r)
    monkeypatch.delenv("ZOO_PROBE_BASED_IMPL")
    assert not any("impl" in o for r in load_sweep(str(probe)) for o in r)
