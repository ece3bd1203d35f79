"""A compiled run gets torch.compile's room for its graphs (zoo.train.compile_scope): a fresh cache, and one graph
per batch shape and pack width up to RECOMPILE_LIMIT, so that in a process training run after run (a zoo-sweep
worker) no later run silently falls back to eager code."""

import torch
from torch._dynamo.utils import counters

from zoo.steps import pack_members
from zoo.train import load_config, train_runs

TINY = ["model=based", "model.d_model=16", "data.vocab_size=256", "train.epochs=1", "train.progress=false",
        "data.valid=[{seq_len:16,num_kv_pairs:2,num_examples:16,batch_size:16}]",
        "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:16,batch_size:16}]"]


def test_a_compiled_pack_keeps_one_graph_per_batch_shape(tmp_path):
    """40 examples in batches of 16: shapes 16 and 8, so the vmapped loss needs two graphs (and the update one).
    Under an outer recompile limit of 1 the second shape would run eagerly; inside a run the limit is
    RECOMPILE_LIMIT."""
    cfg, _ = load_config([*TINY, "train.compile=true", f"runs_root={tmp_path}",
                          "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:40,batch_size:16}]"])
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(recompile_limit=1):
        train_runs(pack_members(cfg, [1e-3, 2e-3]))
    assert counters["stats"]["unique_graphs"] - before >= 3


def test_each_compiled_run_starts_from_an_empty_compile_cache(tmp_path, monkeypatch):
    resets = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the mechanism only: nothing is compiled
    for i, compile_ in enumerate(("true", "false", "true")):
        cfg, _ = load_config([*TINY, f"train.compile={compile_}", f"runs_root={tmp_path / str(i)}",
                              "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:16}]"])
        train_runs(pack_members(cfg, [1e-3, 2e-3]))
    assert len(resets) == 2  # the two compiled runs, not the eager one
