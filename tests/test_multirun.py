"""`zoo-train -m`: a Hydra multirun through Hydra's joblib launcher; finished runs skipped, a bad run recorded."""

import subprocess
import sys
from pathlib import Path

TINY = [
    "+experiment=demo",
    "train.epochs=1",
    "data.train=[{seq_len:32,num_kv_pairs:2,num_examples:128,batch_size:64}]",
    "data.valid=[{seq_len:32,num_kv_pairs:2,num_examples:64,batch_size:64}]",
    "data.test=[{seq_len:32,num_kv_pairs:2,num_examples:64,batch_size:64}]",
    "model.d_model=16",
    "train.progress=false",
]


def multirun(tmp_path: Path, *overrides: str) -> list[str]:
    cmd = [sys.executable, "-m", "zoo.cli", "zoo-train", "-m", *TINY, f"runs_root={tmp_path / 'runs'}", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count("zoo-train -m: CUDA MPS not used (") == 1, proc.stderr[-3000:]  # once, not per job
    return sorted(line for line in proc.stdout.splitlines() if line.startswith("zoo-train -m: job"))


def test_multirun_with_joblib_skips_finished_runs_and_records_a_bad_one(tmp_path):
    sweep = ["model=attention", "optim.lr=3e-3,-1", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    first = multirun(tmp_path, *sweep)
    assert len(first) == 2
    assert "finished" in first[0] and "/attention-d16-lr0.003" in first[0]
    assert "failed" in first[1] and "optim.lr" in first[1]
    runs = list((tmp_path / "runs" / "demo").iterdir())
    assert len(runs) == 1 and (runs[0] / "summary.json").is_file()
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()  # under the runs root
    again = multirun(tmp_path, *sweep[:2])  # Hydra's basic launcher this time
    assert "skipped" in again[0] and "failed" in again[1]


def test_multirun_sweeps_an_option_of_a_mixer_the_preset_lacks(tmp_path):
    """`model.mixers.<mixer>.<option>=a,b` sweeps an option of a mixer that the command line's pattern brought in,
    as a single run sets it (each job composed by Hydra first, then by zoo-train)."""
    jobs = multirun(tmp_path, "model=attention", "model.pattern=[short_conv,attention]",
                    "model.mixers.short_conv.kernel_size=2,4")
    assert len(jobs) == 2 and all("finished" in job for job in jobs)
    kernels = sorted((run / "config.yaml").read_text().split("kernel_size: ")[1].split()[0]
                     for run in (tmp_path / "runs" / "demo").iterdir())
    assert kernels == ["2", "4"]
