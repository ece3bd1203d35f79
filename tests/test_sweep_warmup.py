"""Compile warm-ups: `zoo.train.compile_warmup` compiles a run's (or a pack's) training step into the on-disk compile
caches, so that a later process training a run of that shape, at any lr and seed, compiles nothing; zoo-sweep
runs one warm-up per shape that several of its compiled jobs share before starting those jobs."""

import json
import os
import subprocess
import sys

from tiny_run import TINY_RUN

from zoo.jobs import shape_key, shared_shapes
from zoo.sweep import run_sweep

# 80 training examples in batches of 32: the epoch's last batch holds 16, a second graph to compile.
SEGMENT = "{seq_len:16,num_kv_pairs:2,num_examples:%d,batch_size:32}"
TINY = [*TINY_RUN, f"data.train=[{SEGMENT % 80}]", "train.epochs=1", "train.early_stop=null", "train.compile=true"]

CHILD = """
import json, sys
from torch._dynamo.utils import counters
from zoo.train import compile_warmup, load_config, train_runs
mode, lrs, extra = sys.argv[1], sys.argv[2].split(","), json.loads(sys.argv[3])
members = [load_config(extra + [f"optim.lr={lr}"])[0] for lr in lrs]
compile_warmup(members) if mode == "warm" else train_runs(members)
print(json.dumps({k: dict(counters[k]) for k in ("inductor", "aot_autograd")}))
"""


def test_the_shape_key_ignores_lr_and_seed_only():
    a = shape_key([["model=attention", "optim.lr=1e-3", "train.seed=0"]])
    assert a == shape_key([["model=attention", "optim.lr=1e-2", "train.seed=1"]])
    assert a != shape_key([["model=based", "optim.lr=1e-3", "train.seed=0"]])
    assert a != shape_key([["model=attention", "optim.lr=1e-3"], ["model=attention", "optim.lr=1e-2"]])


def test_only_shapes_that_several_jobs_share_are_warmed():
    runs = [["model=attention", "optim.lr=1e-3"], ["model=based", "optim.lr=1e-3"],
            ["model=attention", "optim.lr=1e-2"], ["model=attention", "optim.lr=1e-3", "train.seed=1"],
            ["model=attention", "optim.lr=1e-2", "train.seed=1"]]
    assert shared_shapes([[0], [1], [2]], runs) == {shape_key([runs[0]]): [0]}
    assert shared_shapes([[0, 2], [1], [3, 4]], runs) == {shape_key([runs[0], runs[2]]): [0, 2]}
    assert shared_shapes([[0, 2], [1], [3]], runs) == {}


def test_a_warmed_pack_trains_without_compiling(tmp_path):
    """After the warm-up of a pack of two lrs in one process, another process trains the same pack at another
    seed with every graph (forward, backward and the AdamW update, at both batch sizes) from the cache. The sweep
    test below covers single runs."""
    lrs = "1e-3,1e-2"
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "t")}
    extra = TINY + [f"data.cache_dir={tmp_path / 'data'}", "train.progress=false"]

    def child(mode: str, lrs: str, *more: str) -> dict:
        args = [sys.executable, "-c", CHILD, mode, lrs, json.dumps(extra + list(more))]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    warm = child("warm", lrs, f"runs_root={tmp_path / 'warm'}")
    assert warm["inductor"].get("fxgraph_cache_miss", 0) >= 4  # forward and backward at 32 and at 16 examples
    assert not (tmp_path / "warm").exists()  # the warm-up writes no run dir
    trained = child("train", lrs, f"runs_root={tmp_path / 'runs'}", "train.seed=1")
    assert trained["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert trained["inductor"].get("fxgraph_cache_hit", 0) == warm["inductor"]["fxgraph_cache_miss"]
    assert trained["aot_autograd"].get("autograd_cache_miss", 0) == 0


def test_a_sweep_warms_the_shape_its_compiled_jobs_share(tmp_path, capsys):
    """Two compiled attention runs (one shape) with two workers: one warm-up, recorded in the sweep's record,
    and both runs finish."""
    runs = [["model=attention", "optim.lr=1e-3"], ["model=attention", "optim.lr=1e-2"]]
    extra = TINY + ["experiment_name=w", f"data.cache_dir={tmp_path / 'data'}"]
    record = run_sweep(runs, "w", workers=2, device="cpu", extra=extra, runs_root=str(tmp_path))
    assert [r["status"] for r in record["runs"]] == ["finished"] * 2
    (warmup,) = record["compile_warmups"]
    assert warmup["overrides"] == runs[0] and warmup["shapes"] == 2 and "error" not in warmup
    assert "1 shape that several compiled jobs share: one warm-up" in capsys.readouterr().err
    eager = run_sweep(runs, "e", workers=2, device="cpu", extra=extra + ["train.compile=false"],
                      runs_root=str(tmp_path / "eager"))
    assert eager["finished"] == 2 and "compile_warmups" not in eager  # nothing to warm without compiling
