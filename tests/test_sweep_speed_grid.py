"""experiments/bench/sweep_speed.py --grid-from: the grid's wall and runs summed from zoo-sweep's shard records."""

import json
import sys
from pathlib import Path

import pytest


@pytest.fixture
def bench(sweep_speed_bench):
    return sweep_speed_bench


def record(name: str, wall_s: float, runs: list[tuple[str, str]]) -> dict:
    """A zoo-sweep record (zoo.sweep.SweepRecord.write's format): (run dir or "" for none, status) per run."""
    rows = [{"overrides": [f"run={d or i}"], "run_dir": d or None, "status": s} for i, (d, s) in enumerate(runs)]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("finished", "skipped", "failed", "pending")}
    return {"sweep": name, "runs": rows, **counts, "wall_s": wall_s}


def write(root: Path, *records: dict) -> Path:
    (root / "_sweeps" / "compile_cache").mkdir(parents=True)
    for r in records:
        (root / "_sweeps" / f"{r['sweep']}.json").write_text(json.dumps(r))
    return root


def grid(bench, *paths) -> dict:
    return bench.grid_from_records(bench.sweep_records([str(p) for p in paths]))


def test_shards_are_summed(bench, tmp_path):
    root = write(tmp_path, record("fig2.shard-0-of-2", 100.0, [("a", "finished"), ("b", "finished")]),
                 record("fig2.shard-1-of-2", 50.5, [("c", "finished"), ("d", "failed"), ("e", "pending")]))
    out = grid(bench, root)
    assert (out["grid_wall_s"], out["grid_runs"], out["grid_sharded"]) == (150.5, 3, True)
    assert (out["grid_runs_listed"], out["grid_runs_failed"], out["grid_runs_pending"]) == (5, 1, 1)


def test_one_record_is_not_sharded(bench, tmp_path):
    out = grid(bench, write(tmp_path, record("fig2", 42.0, [("a", "finished"), ("b", "skipped")])))
    assert (out["grid_wall_s"], out["grid_runs"], out["grid_sharded"], out["grid_runs_skipped"]) == (42.0, 1, False, 1)


def test_a_run_in_several_records_counts_once_at_its_best(bench, tmp_path):
    """A chain's kept records: a run pending at the first job's limit and finished by the second, then skipped
    by a third; a run without a run dir (skipped by --skip-summaries) is told apart by its overrides."""
    first = record("fig2.call1", 500.0, [("a", "pending"), ("b", "finished"), ("", "skipped")])
    second = record("fig2.call2", 200.0, [("a", "finished"), ("b", "skipped"), ("", "skipped")])
    third = record("fig2.call3", 1.0, [("a", "skipped"), ("b", "skipped")])
    out = grid(bench, write(tmp_path, first, second, third))
    assert (out["grid_wall_s"], out["grid_runs"], out["grid_runs_listed"], out["grid_runs_skipped"]) == (
        701.0, 2, 3, 1)


def test_record_files_and_sweeps_folders_are_taken_as_given(bench, tmp_path):
    root = write(tmp_path, record("x", 1.0, [("a", "finished")]), record("y", 2.0, [("b", "finished")]))
    assert grid(bench, root / "_sweeps" / "x.json")["grid_wall_s"] == 1.0
    assert grid(bench, root / "_sweeps", root / "_sweeps" / "x.json")["grid_wall_s"] == 3.0  # x once


def test_what_is_no_record_is_refused(bench, tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"valid/accuracy": 1.0}))
    with pytest.raises(SystemExit, match="not a zoo-sweep record"):
        grid(bench, tmp_path)
    with pytest.raises(SystemExit, match="no such file"):
        grid(bench, tmp_path / "missing")


def test_the_records_of_a_real_sharded_sweep(bench, tmp_path, monkeypatch, capsys):
    """Two shards run by zoo-sweep on CPU; the bench's last line is the JSON of their sums."""
    from zoo.sweep import run_sweep, shard

    tiny = ["model.d_model=16", "data.vocab_size=64", "train.epochs=1", "train.early_stop=null",
            "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
            "data.valid=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
            "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
            "experiment_name=g", f"data.cache_dir={tmp_path / 'cache'}"]
    runs = [[f"model={m}", f"optim.lr={lr}"] for m in ("based", "attention") for lr in ("1e-3", "1e-2")]
    records = [run_sweep(shard(runs, f"{i}/2"), f"g.shard-{i}-of-2", device="cpu", extra=tiny,
                         runs_root=str(tmp_path / "runs")) for i in range(2)]
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["sweep_speed.py", "--grid-from", str(tmp_path / "runs")])
    bench.main()
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["grid_wall_s"] == pytest.approx(sum(r["wall_s"] for r in records))
    assert (out["grid_runs"], out["grid_sharded"]) == (4, True)
    assert lines[0].startswith("sweep record") and any(line.startswith("g.shard-1-of-2.json") for line in lines)


def test_a_chain_of_calls_counts_every_call(bench, tmp_path):
    """One sweep name called three times on one runs root (a chain of limited jobs): its record lists the calls,
    and the grid's wall is their sum, not the last call's."""
    chained = record("fig2", 5.0, [("a", "finished"), ("b", "finished")])
    chained["calls"] = [{"started": None, "wall_s": 500.0}, {"started": None, "wall_s": 200.0},
                        {"started": None, "wall_s": 5.0}]
    out = grid(bench, write(tmp_path, chained))
    assert (out["grid_wall_s"], out["grid_runs"], out["grid_sharded"]) == (705.0, 2, True)
    assert out["grid_records"][0]["calls"] == 3


def test_a_sweep_record_keeps_its_earlier_calls(tmp_path):
    """zoo-sweep called twice under one name: the second call's record lists both calls (the second finds the
    first's runs done), and `calls_wall_s` is their sum."""
    from zoo.sweep import run_sweep

    tiny = ["model.d_model=16", "data.vocab_size=64", "train.epochs=1", "train.early_stop=null",
            "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
            "data.valid=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
            "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
            "experiment_name=g", f"data.cache_dir={tmp_path / 'cache'}"]
    runs = [["model=attention", "optim.lr=1e-3"]]
    first = run_sweep(runs, "chain", device="cpu", extra=tiny, runs_root=str(tmp_path / "runs"))
    second = run_sweep(runs, "chain", device="cpu", extra=tiny, runs_root=str(tmp_path / "runs"))
    assert len(first["calls"]) == 1 and len(second["calls"]) == 2
    assert second["calls"][0]["wall_s"] == first["wall_s"] and second["calls"][0]["finished"] == 1
    assert second["calls_wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"])
    # the run the first call trained stays finished in the chain's record; the second call's counts skip it
    assert second["calls"][1]["skipped"] == 1 and second["calls"][1]["finished"] == 0
    assert second["finished"] == 1 and second["runs"][0]["status"] == "finished"
    assert second["runs"][0]["wall_s"] == first["runs"][0]["wall_s"]


def test_a_sweep_record_keeps_runs_an_earlier_call_selected(tmp_path):
    """A chain whose second call selects other runs (other MIXERS or D): the first call's finished run stays in the
    chain's record beside the second's."""
    from zoo.sweep import run_sweep

    tiny = ["model.d_model=16", "data.vocab_size=64", "train.epochs=1", "train.early_stop=null",
            "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
            "data.valid=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
            "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
            "experiment_name=g", f"data.cache_dir={tmp_path / 'cache'}"]
    root = str(tmp_path / "runs")
    first = run_sweep([["model=attention", "optim.lr=1e-3"]], "chain", device="cpu", extra=tiny, runs_root=root)
    second = run_sweep([["model=attention", "optim.lr=2e-3"]], "chain", device="cpu", extra=tiny, runs_root=root)
    assert second["calls"][0]["finished"] == 1 and second["calls"][1]["finished"] == 1
    assert second["finished"] == 2 and len(second["runs"]) == 2
    assert {r["run_dir"] for r in second["runs"]} == {first["runs"][0]["run_dir"], second["runs"][0]["run_dir"]}


def test_a_record_from_before_calls_counts_as_one_call(tmp_path):
    from zoo.sweep import earlier_calls

    path = tmp_path / "old.json"
    path.write_text(json.dumps(record("old", 12.5, [("a", "finished"), ("b", "pending")])))
    assert earlier_calls(path) == [{"started": None, "wall_s": 12.5, "finished": 1, "skipped": 0, "failed": 0,
                                    "pending": 1}]
    assert earlier_calls(tmp_path / "missing.json") == []
    (tmp_path / "torn.json").write_text("{")
    assert earlier_calls(tmp_path / "torn.json") == []


def test_side_by_side_calls_count_their_shared_time_once(bench, tmp_path):
    """Two sweeps started together on one GPU (each its own record, two calls each, as a chain of two jobs on one
    machine): the grid's wall is the time the machine spent, not the sum of the four calls."""
    a = record("fig2-h3", 96.0, [("a", "finished")])
    a["calls"] = [{"started": "2026-12-07T05:07:11+0000", "wall_s": 189.0},
                  {"started": "2026-12-07T05:10:44+0000", "wall_s": 96.0}]
    b = record("fig2-base_conv", 169.0, [("b", "pending")])
    b["calls"] = [{"started": "2026-12-07T05:07:11.500000+00:00", "wall_s": 190.0},
                  {"started": "2026-12-07T05:10:44+0000", "wall_s": 169.0}]
    out = grid(bench, write(tmp_path, a, b))
    assert out["grid_wall_s"] == pytest.approx(190.5 + 169.0)
    assert [r["wall_s"] for r in out["grid_records"]] == pytest.approx([169.0 + 190.0, 189.0 + 96.0])
    assert (out["grid_runs"], out["grid_runs_pending"], out["grid_sharded"]) == (1, 1, True)


def test_a_call_without_a_start_time_adds_its_whole_wall(bench):
    calls = [{"started": None, "wall_s": 10.0}, {"started": "2026-12-07T05:00:00+00:00", "wall_s": 5.0},
             {"started": "2026-12-07T05:00:02+00:00", "wall_s": 1.0}, {"wall_s": 2.0}]
    assert bench.calls_wall(calls) == pytest.approx(17.0)


def test_from_json_refuses_a_missing_file(bench, tmp_path, monkeypatch):
    """`--from-json` with a mistyped path stops with one line, not a traceback."""
    monkeypatch.setattr(sys, "argv", ["sweep_speed.py", "--from-json", str(tmp_path / "typo.json")])
    with pytest.raises(SystemExit, match="--from-json .*typo.json: no such file"):
        bench.main()
