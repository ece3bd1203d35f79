"""Training end to end on CPU: the tiny preset learns, run dirs follow the layout, a killed run resumes exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zoo.eval import QuerySegment, query_logits
from zoo.models import LanguageModel
from zoo.runs import RunDir
from zoo.synthetics import MQARConfig, generate
from zoo.train import ConfigError, epoch_plan, load_config, run_name, train

# A small, quick config for the mechanics tests (not for accuracy).
QUICK = [
    "model=based", "model.d_model=32", "data.vocab_size=128",
    "data.train=[{seq_len:32,num_kv_pairs:4,num_examples:256,batch_size:32},"
    "{seq_len:64,num_kv_pairs:4,num_examples:128,batch_size:32}]",
    "data.valid=[{seq_len:32,num_kv_pairs:4,num_examples:64,batch_size:64}]",
    "data.test=[{seq_len:32,num_kv_pairs:4,num_examples:64,batch_size:64},"
    "{seq_len:64,num_kv_pairs:8,num_examples:64,batch_size:64}]",
    "train.early_stop=null", "train.progress=false", "train.log_every=4",
]


def quick(tmp_path, *extra):
    return load_config([*QUICK, f"runs_root={tmp_path}", *extra])


@pytest.mark.parametrize("model", ["based", "attention"])
def test_tiny_preset_reaches_90_percent(demo_runs, model):
    """The demo's preset (`+experiment=demo`, mqar_tiny) trains each model past 90%: the session's demo runs
    (tests/conftest.py), which are exactly those trainings."""
    rows, _ = demo_runs
    summary = dict(rows)[model]
    assert summary["valid/accuracy"] >= 0.9, summary
    assert summary["test/accuracy/seq_len=64"] >= 0.9, summary


def test_run_dir_layout_and_summary(tmp_path):
    cfg, resolved = quick(tmp_path, "train.epochs=2")
    summary = train(cfg, resolved)
    run = RunDir(tmp_path / "default" / run_name(cfg))
    config_text = (run.path / "config.yaml").read_text()
    assert "git_sha" in config_text and "torch" in config_text and "pattern" in config_text
    records = run.read_metrics()
    assert any("train/loss" in r for r in records) and any("valid/accuracy" in r for r in records)
    on_disk = json.loads((run.path / "summary.json").read_text())
    assert on_disk == summary
    for key in ("test/accuracy", "test/accuracy/seq_len=32", "test/accuracy/seq_len=64",
                "test/accuracy/num_kv_pairs=4", "test/accuracy/num_kv_pairs=8"):
        assert 0.0 <= summary[key] <= 1.0
    model = LanguageModel(cfg.model)
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    assert summary["state_bytes_fp32"] == 4 * model.state_size(64)
    assert summary["wall_time_s"] > 0 and summary["train_tokens_per_s"] > 0
    assert (run.path / "ckpt" / "last.pt").exists()
    # The same config again refuses to clobber the run; resume=true on a finished run returns its summary.
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg, resolved)
    cfg2, _ = quick(tmp_path, "train.epochs=2", "train.resume=true")
    assert train(cfg2) == summary


def test_query_logits_are_the_logits_at_label_positions():
    torch.manual_seed(0)
    cfg, _ = load_config(["model=based", "model.d_model=32"])
    model = LanguageModel(cfg.model).eval()
    seg = generate(MQARConfig(vocab_size=128, seq_len=32, num_kv_pairs=4, num_examples=8), seed=3)
    qs = QuerySegment.from_segment(seg, batch_size=8, device=torch.device("cpu"))
    full = model(seg.inputs)  # [N, L, V]
    rows, cols = (seg.labels != -100).nonzero(as_tuple=True)
    torch.testing.assert_close(query_logits(model, qs.inputs, qs.query_pos).flatten(0, 1), full[rows, cols])
    assert torch.equal(qs.query_labels.flatten(), seg.labels[rows, cols])


def test_epoch_plan_covers_each_example_once_and_never_mixes_lengths():
    segs = []
    for L, n in ((32, 70), (64, 50)):
        seg = generate(MQARConfig(vocab_size=128, seq_len=L, num_kv_pairs=4, num_examples=n), seed=L)
        segs.append(QuerySegment.from_segment(seg, batch_size=16, device=torch.device("cpu")))
    plan = epoch_plan(segs, seed=0, epoch=0)
    for s, seg in enumerate(segs):
        seen = torch.cat([idx for t, idx in plan if t == s])
        assert sorted(seen.tolist()) == list(range(len(seg)))
    assert len(plan) == sum(seg.num_batches() for seg in segs)
    assert [i.tolist() for _, i in plan] != [i.tolist() for _, i in epoch_plan(segs, seed=0, epoch=1)]


def test_fixed_batch_order_is_zoologys_dataloader():
    """train.batch_order=fixed: segment after segment in config order, each one's batches in example order (the
    last one short), the same plan every epoch, whatever the seed."""
    segs = []
    for L, n in ((32, 70), (64, 50)):
        seg = generate(MQARConfig(vocab_size=128, seq_len=L, num_kv_pairs=4, num_examples=n), seed=L)
        segs.append(QuerySegment.from_segment(seg, batch_size=16, device=torch.device("cpu")))
    plan = epoch_plan(segs, seed=0, epoch=0, order="fixed")
    assert [s for s, _ in plan] == [0] * 5 + [1] * 4
    assert torch.equal(torch.cat([i for s, i in plan if s == 0]), torch.arange(70))
    assert torch.equal(torch.cat([i for s, i in plan if s == 1]), torch.arange(50))
    assert [len(i) for _, i in plan] == [16, 16, 16, 16, 6, 16, 16, 16, 2]
    again = epoch_plan(segs, seed=3, epoch=7, order="fixed")
    assert [(s, i.tolist()) for s, i in again] == [(s, i.tolist()) for s, i in plan]


def test_training_takes_its_batch_order(tmp_path, monkeypatch):
    """A run with train.batch_order=fixed trains on the fixed plan (the loop passes the option through)."""
    import zoo.train as train_module

    seen = []
    real = train_module.epoch_plan

    def recording(segments, seed, epoch, order="shuffle"):
        seen.append(order)
        return real(segments, seed, epoch, order)

    monkeypatch.setattr(train_module, "epoch_plan", recording)
    cfg, resolved = quick(tmp_path, "train.epochs=2", "train.batch_order=fixed")
    train(cfg, resolved)
    assert seen and set(seen) == {"fixed"}


def test_batch_order_must_be_known(tmp_path):
    with pytest.raises(ValueError, match="train.batch_order must be shuffle|fixed, got 'sorted'"):
        quick(tmp_path, "train.batch_order=sorted")


def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    epochs = 8
    ref_cfg, resolved = quick(tmp_path / "ref", f"train.epochs={epochs}")
    reference = train(ref_cfg, resolved)

    root = tmp_path / "killed"
    cfg, _ = quick(root, f"train.epochs={epochs}")
    ckpt = root / "default" / run_name(cfg) / "ckpt" / "last.pt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "zoo.cli", "zoo-train", *QUICK, f"runs_root={root}", f"train.epochs={epochs}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ckpt.exists(), "the run died before its first checkpoint"
    killed_at = torch.load(ckpt, weights_only=True)["epoch"]
    assert killed_at < epochs, "the run finished before it could be killed; make it longer"
    assert not (ckpt.parent.parent / "summary.json").exists()

    resumed_cfg, resolved = quick(root, f"train.epochs={epochs}", "train.resume=true")
    resumed = train(resumed_cfg, resolved)
    for key, value in reference.items():
        if key.startswith(("valid/", "test/")) or key in ("steps", "epochs", "best_valid_accuracy"):
            assert resumed[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    steps = [r["step"] for r in RunDir(ckpt.parent.parent).read_metrics() if "train/loss" in r]
    assert steps == sorted(set(steps)), "metrics.jsonl repeats steps after the resume"


def test_wandb_mirror_offline_keeps_local_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg, resolved = quick(tmp_path, "train.epochs=1", "logger=wandb")
    assert cfg.logger.mode == "offline"
    train(cfg, resolved)
    run = Path(tmp_path / "default" / run_name(cfg))
    assert (run / "summary.json").exists()
    assert list(run.glob("wandb/offline-run-*")), "wandb offline run not written"


def test_compile_mode_reaches_torch_compile_and_bad_values_fail_in_one_line(tmp_path, monkeypatch):
    """train.compile_mode is torch.compile's mode (reduce-overhead: CUDA graphs, for the Triton kernels at short T);
    a mode torch.compile lacks, or a mode without train.compile, is a one-line config error before any work."""
    import zoo.train

    seen = []

    def compile(fn, mode=None, dynamic=None):
        seen.append(mode)
        return fn

    monkeypatch.setattr(zoo.train.torch, "compile", compile)
    cfg, resolved = quick(tmp_path, "train.epochs=1", "train.compile=true", "train.compile_mode=reduce-overhead")
    train(cfg, resolved)
    assert seen == ["reduce-overhead"]
    for bad, match in ((["train.compile=true", "train.compile_mode=fast"], "compile_mode must be"),
                       (["train.compile_mode=reduce-overhead"], "needs train.compile=true")):
        with pytest.raises(ConfigError, match=match) as e:
            quick(tmp_path, *bad)
        assert "\n" not in str(e.value)
