"""zoo-pretrain: data packing, presets, exact resume, a finished run kept or returned, DDP on 2 CPU processes ==
1 process with twice the batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from zoo.config import ModelConfig, register_pretrain_configs
from zoo.lm_data import PackedWindows, prepare, read_documents
from zoo.models import LanguageModel
from zoo.pretrain import pretrain
from zoo.train import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent
# A small model and short windows: every run below takes seconds.
TINY = [
    "model.d_model=32",
    "model.n_layers=5",
    "model.mixers.based.num_heads=2",
    "model.mixers.based.head_dim_v=16",
    "model.mixers.sliding_window.window=8",
    "data.seq_len=32",
    "data.bpe_vocab_size=512",
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=2",
    "train.eval_windows=6",
    "train.progress=false",
]


def config(tmp_path, *overrides):
    register_pretrain_configs()
    cfg, _ = load_config([*TINY, f"runs_root={tmp_path}", *overrides], config_name="pretrain")
    return cfg


def losses(run_dir: Path) -> list[tuple[int, str, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], k, r[k]) for r in records for k in ("train/loss", "valid/loss") if k in r]


def test_documents_from_files_and_from_a_saved_dataset(tmp_path):
    import datasets

    (tmp_path / "texts" / "sub").mkdir(parents=True)
    (tmp_path / "texts" / "a.txt").write_text("first document\n")
    (tmp_path / "texts" / "sub" / "b.md").write_text("second one")
    (tmp_path / "texts" / "skip.bin").write_text("not text")
    assert read_documents(str(tmp_path / "texts")) == ["first document", "second one"]
    datasets.Dataset.from_dict({"body": ["x y z", "", "u v"]}).save_to_disk(str(tmp_path / "ds"))
    assert read_documents(str(tmp_path / "ds"), text_field="body") == ["x y z", "u v"]
    with pytest.raises(ValueError, match="no column"):
        read_documents(str(tmp_path / "ds"))


def test_prepare_trains_a_bpe_and_separates_documents_with_eos(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    text = "the quick brown fox jumps over the lazy dog. " * 20
    for i in range(4):
        (docs / f"{i}.txt").write_text(f"document {i}: {text}")
    data = prepare(str(docs), "bpe", bpe_vocab_size=300, valid_frac=0.25, cache_dir=str(tmp_path / "cache"))
    stream = torch.cat([data.train, data.valid])
    eos = data.tokenizer.eos_token_id
    assert int((stream == eos).sum()) == 4 and int(stream[-1]) == eos
    first = stream[: int((stream == eos).nonzero()[0])]
    assert data.tokenizer.decode(first.tolist()) == f"document 0: {text}".strip()
    assert len(data.valid) == int(len(stream) * 0.25)
    again = prepare(str(docs), "bpe", bpe_vocab_size=300, valid_frac=0.25, cache_dir=str(tmp_path / "cache"))
    assert torch.equal(again.train, data.train)  # from the caches, same tokens


def test_packed_windows_split_a_global_batch_and_cover_each_epoch_once():
    tokens = torch.arange(10 * 8 + 1)
    packer = PackedWindows(tokens, seq_len=8, global_batch=4, seed=3)
    full_x, full_y = packer.batch(step=1, start=0, count=4)
    parts = [packer.batch(step=1, start=2 * r, count=2) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(full_y, full_x + 1)  # targets are the next tokens
    firsts = torch.cat([packer.batch(s, 0, 4)[0][:, 0] for s in range(5)])  # 20 windows = 2 epochs of 10
    for epoch in firsts.view(2, 10):
        assert sorted(epoch.tolist()) == list(range(0, 80, 8))


def test_a_tokenized_dataset_with_labels_takes_the_loss_where_they_say(tmp_path):
    """input_ids + labels (-100: no loss) pass through unchanged, end-of-text after each row; the windows'
    targets come from the labels; the loss averages over the labelled positions only, 0 when there are none."""
    import datasets

    from zoo.lm_data import train_bpe, valid_windows
    from zoo.pretrain import lm_loss

    tok_dir = tmp_path / "tok"
    train_bpe(["a b c d e f g h"] * 10, 300).save_pretrained(str(tok_dir))
    ids = [[5, 6, 7, 8, 9], [10, 11, 12]]
    labels = [[-100, -100, 7, -100, 9], [-100, 11, 12]]
    datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}).save_to_disk(str(tmp_path / "ds"))
    data = prepare(str(tmp_path / "ds"), str(tok_dir), valid_frac=0.2, cache_dir=str(tmp_path / "cache"))
    eos = data.tokenizer.eos_token_id
    assert torch.cat([data.train, data.valid]).tolist() == [5, 6, 7, 8, 9, eos, 10, 11, 12, eos]
    labelled = [-100, -100, 7, -100, 9, eos, -100, 11, 12, eos]
    assert torch.cat([data.train_labels, data.valid_labels]).tolist() == labelled
    x, y = PackedWindows(data.train, seq_len=4, global_batch=1, seed=0, labels=data.train_labels).batch(0, 0, 1)
    start = int(x[0, 0] == 9) * 4  # the one window of 8 training tokens starts at 0 or 4
    assert y.tolist() == [data.train_labels[start + 1 : start + 5].tolist()]
    vx, vy = valid_windows(torch.arange(9), 4, 2, labels=torch.arange(9) * -1)
    assert vy.tolist() == [[-1, -2, -3, -4], [-5, -6, -7, -8]]

    class Uniform(torch.nn.Module):  # equal logits: the cross-entropy of every position is log(V)
        def forward(self, inputs):
            return torch.zeros(*inputs.shape, 16, requires_grad=True)

    targets = torch.tensor([[3, -100, -100], [-100, 2, -100]])
    inputs = torch.zeros(2, 3, dtype=torch.long)
    assert torch.isclose(lm_loss(Uniform(), inputs, targets), torch.log(torch.tensor(16.0)))
    assert lm_loss(Uniform(), torch.zeros(1, 3, dtype=torch.long), torch.full((1, 3), -100)).item() == 0.0
    with pytest.raises(ValueError, match="already tokenized"):
        prepare(str(tmp_path / "ds"), "bpe", cache_dir=str(tmp_path / "cache"))
    datasets.Dataset.from_dict({"input_ids": [[5, 6]], "labels": [[5]]}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="must match its input_ids"):
        prepare(str(tmp_path / "bad"), str(tok_dir), cache_dir=str(tmp_path / "cache"))


def test_presets_have_the_released_layer_pattern():
    for name, d, n_layers, dv, params in (("based_360m", 1024, 27, 64, 360e6), ("based_1b", 1792, 36, 112, 1.35e9)):
        node = OmegaConf.merge(
            OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "zoo/configs/model" / f"{name}.yaml")
        )
        mc = OmegaConf.to_object(node)
        layers = mc.layers()
        assert (mc.d_model, len(layers), mc.mlp, mc.norm, mc.tie_embeddings) == (d, n_layers, "swiglu", "rmsnorm", True)
        assert [i for i, x in enumerate(layers) if x == "based"] == list(range(1, 5 * (n_layers // 5), 5))
        assert layers.count("sliding_window") == n_layers // 5
        assert layers.count("base_conv") == n_layers - 2 * (n_layers // 5)
        assert mc.mixers["based"]["head_dim_v"] == dv and mc.mixers["based"]["feature_dim"] == 16
        with torch.device("meta"):
            lm = LanguageModel(mc)
        assert abs(lm.num_parameters() - params) / params < 0.05, name


def test_unknown_key_or_missing_source_fails_before_work(tmp_path):
    with pytest.raises(ConfigError):
        config(tmp_path, "train.stepz=3")
    with pytest.raises(ConfigError, match="data.source"):
        config(tmp_path, "lm_data@data=files")


def test_a_validation_split_shorter_than_one_window_fails_before_training(tmp_path):
    with pytest.raises(ConfigError, match="validation split"):
        pretrain(config(tmp_path, "data.seq_len=4096"))
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_resume_after_a_stop_reproduces_the_uninterrupted_run(tmp_path):
    whole = pretrain(config(tmp_path, "run=whole", "train.sample_tokens=0", "train.export_hf=false"))
    assert whole["steps"] == 4
    assert pretrain(config(tmp_path, "run=cut", "train.stop_after=2")) == {}
    assert not (tmp_path / "pretrain" / "cut" / "summary.json").exists()
    resumed = pretrain(
        config(tmp_path, "run=cut", "train.resume=true", "train.sample_tokens=0", "train.export_hf=false")
    )
    assert resumed["valid/loss"] == pytest.approx(whole["valid/loss"], rel=1e-6)
    a, b = losses(tmp_path / "pretrain" / "whole"), losses(tmp_path / "pretrain" / "cut")
    assert [s[:2] for s in a] == [s[:2] for s in b]
    assert [s[2] for s in a] == pytest.approx([s[2] for s in b], rel=1e-6)
    assert whole["valid/loss"] < losses(tmp_path / "pretrain" / "whole")[0][2]  # it learned something


QUICK = ("run=done", "train.sample_tokens=0", "train.export_hf=false")


def test_a_finished_run_is_kept_without_resume_or_overwrite(tmp_path):
    pretrain(config(tmp_path, *QUICK))
    summary = (tmp_path / "pretrain" / "done" / "summary.json").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        pretrain(config(tmp_path, *QUICK))
    assert (tmp_path / "pretrain" / "done" / "summary.json").read_text() == summary


def test_resuming_a_finished_run_returns_its_summary_without_training(tmp_path):
    first = pretrain(config(tmp_path, *QUICK))
    metrics = (tmp_path / "pretrain" / "done" / "metrics.jsonl").read_text()
    assert pretrain(config(tmp_path, *QUICK, "train.resume=true")) == first
    assert (tmp_path / "pretrain" / "done" / "metrics.jsonl").read_text() == metrics


def test_export_loads_with_auto_classes_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = pretrain(config(tmp_path, "run=exp", "train.steps=2", "train.sample_tokens=4"))
    assert "⟶" in summary["sample"]
    hf_dir = tmp_path / "pretrain" / "exp" / "hf"
    model, tok = AutoModelForCausalLM.from_pretrained(hf_dir).eval(), AutoTokenizer.from_pretrained(hf_dir)
    ids = tok("The river", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5)
    state = torch.load(tmp_path / "pretrain" / "exp" / "ckpt" / "last.pt", weights_only=True)["model"]
    torch.testing.assert_close(model.model.embedding.weight, state["embedding.weight"])


@pytest.mark.slow  # two torchrun processes each import torch and transformers: ~35 s on a busy 2-core CPU
def test_ddp_on_two_processes_equals_one_process_with_twice_the_batch(tmp_path):
    common = [*TINY, f"runs_root={tmp_path}", "train.sample_tokens=0", "train.export_hf=false"]
    single = pretrain(config(tmp_path, "run=single", "train.batch_size=4", *common[len(TINY) + 1 :]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "zoo.pretrain",
        *common,
        "run=ddp",
        "train.batch_size=2",
        "train.parallel=ddp",
        "train.device=cpu",
    ]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ddp = json.loads((tmp_path / "pretrain" / "ddp" / "summary.json").read_text())
    assert ddp["world_size"] == 2 and ddp["parallel"] == "ddp"
    a, b = losses(tmp_path / "pretrain" / "single"), losses(tmp_path / "pretrain" / "ddp")
    assert [s[:2] for s in a] == [s[:2] for s in b] and len(a) == 6
    assert [s[2] for s in b] == pytest.approx([s[2] for s in a], rel=1e-5)
    assert ddp["valid/loss"] == pytest.approx(single["valid/loss"], rel=1e-5)


def test_compile_mode_reaches_torch_compile(tmp_path, monkeypatch):
    """train.compile_mode is torch.compile's mode here too; a bad one fails before any work."""
    import zoo.pretrain

    seen = []

    def compile(module, mode=None):
        seen.append(mode)
        return module

    monkeypatch.setattr(zoo.pretrain.torch, "compile", compile)
    pretrain(config(tmp_path, "train.compile=true", "train.compile_mode=max-autotune", "train.sample_tokens=0",
                    "train.export_hf=false"))
    assert seen == ["max-autotune"]
    with pytest.raises(ConfigError, match="compile_mode must be"):
        config(tmp_path, "train.compile=true", "train.compile_mode=turbo")
