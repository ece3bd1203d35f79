"""train.cuda_graph on CUDA: the captured, replayed training step trains exactly as the eager step (a pack of
lrs, a pack of seeds and lrs, whose members each step on their own batch, and a single run, which trains as a pack
of one). Skipped without CUDA; run on the H200."""

import pytest
import torch

from zoo.runs import RunDir
from zoo.steps import pack_members
from zoo.train import load_config, train, train_runs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SMALL = [
    "model.d_model=32",
    "data.vocab_size=128",
    "data.train=[{seq_len:32,num_kv_pairs:4,num_examples:600,batch_size:64}]",  # a last batch of 24
    "data.valid=[{seq_len:32,num_kv_pairs:4,num_examples:128,batch_size:64}]",
    "data.test=[{seq_len:32,num_kv_pairs:4,num_examples:128,batch_size:64}]",
    "train.epochs=3",
    "train.early_stop=null",
    "train.progress=false",
    "train.device=cuda",
    "train.precision=fp32",
    "optim.warmup_frac=0.2",
]


def params(run_dir):
    return RunDir(run_dir).load_checkpoint()["model"]


PACKS = {"lrs": {"lrs": [1e-3, 1e-2]}, "seeds": {"lrs": [1e-3, 1e-2], "seeds": [0, 1]}}


@pytest.mark.parametrize("pack", PACKS)
@pytest.mark.parametrize("model", ["based", "attention"])
def test_graphed_pack_equals_eager_pack(tmp_path, model, pack):
    runs = {}
    for graph in (False, True):
        # one runs_root for both (it is part of a run's name), each training moved aside after it
        cfg, _ = load_config([*SMALL, f"model={model}", f"runs_root={tmp_path / 'runs'}"])
        cfg.train.cuda_graph = graph
        runs[graph] = train_runs(pack_members(cfg, **PACKS[pack]))
        (tmp_path / "runs" / "default").rename(tmp_path / str(graph))
    for eager, graphed in zip(runs[False], runs[True]):
        assert eager["run"] == graphed["run"] and eager["steps"] == graphed["steps"] == 30
        assert graphed["test/accuracy"] == pytest.approx(eager["test/accuracy"], abs=1 / 128)
        ref = params(tmp_path / "False" / eager["run"])
        got = params(tmp_path / "True" / graphed["run"])
        for name, value in ref.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5)


def test_graphed_single_run_trains_as_a_pack_of_one(tmp_path):
    cfg, resolved = load_config([*SMALL, "model=based", f"runs_root={tmp_path}", "train.cuda_graph=true"])
    summary = train(cfg, resolved)
    assert summary["pack_size"] == 1 and summary["steps"] == 30
    assert RunDir(tmp_path / "default" / summary["run"]).is_finished()
