import os
import shutil
from pathlib import Path

import pytest
import torch

import zoo.synthetics as synthetics
from zoo.synthetics import MQARConfig, cached_generate, config_hash, generate_mqar

CFG = MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4, num_examples=50, num_passes=2)


@pytest.fixture
def calls(monkeypatch):
    """Counts generator calls: `cached_generate` reaches the generator only through `TASKS`."""
    seen = []

    def counting(cfg, seed):
        seen.append(seed)
        return generate_mqar(cfg, seed)

    monkeypatch.setitem(synthetics.TASKS, "mqar", (MQARConfig, counting))
    return seen


def entries(root):
    return sorted(p.name for p in root.iterdir())


def test_second_call_loads_equal_tensors(tmp_path, calls):
    first = cached_generate(CFG, 3, tmp_path)
    second = cached_generate(CFG, 3, str(tmp_path))
    assert calls == [3], "the second call must load from disk, not generate"
    expected = generate_mqar(CFG, 3)
    for seg in (first, second):
        assert seg.inputs.dtype == seg.labels.dtype == torch.int64
        assert torch.equal(seg.inputs, expected.inputs) and torch.equal(seg.labels, expected.labels)
        assert seg.slices == {"seq_len": 64, "num_kv_pairs": 4, "num_passes": 2}
    assert entries(tmp_path) == [f"mqar-{config_hash(CFG, 3)}"]


def test_seed_and_config_pick_different_dirs(tmp_path, calls):
    cached_generate(CFG, 3, tmp_path)
    cached_generate(CFG, 4, tmp_path)
    cached_generate(MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4, num_examples=50), 3, tmp_path)
    assert calls == [3, 4, 3]
    assert len(entries(tmp_path)) == 3
    assert not torch.equal(cached_generate(CFG, 3, tmp_path).inputs, cached_generate(CFG, 4, tmp_path).inputs)
    assert calls == [3, 4, 3]


def test_config_hash_is_stable_and_covers_version(monkeypatch):
    h = config_hash(CFG, 3)
    assert h == config_hash(MQARConfig(**vars(CFG)), 3) and len(h) == 16
    assert h != config_hash(CFG, 4)
    monkeypatch.setattr(synthetics, "GENERATOR_VERSION", synthetics.GENERATOR_VERSION + 1)
    assert h != config_hash(CFG, 3)


def test_interrupted_write_leaves_nothing_that_loads(tmp_path, calls, monkeypatch):
    """A process killed while saving (no cleanup runs) must not leave a directory under the final name."""
    real_save, real_rmtree = synthetics._save, shutil.rmtree

    def killed_midway(segment, path, meta):
        real_save(segment, path, meta)  # every file written, the rename not yet done
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetics, "_save", killed_midway)
    monkeypatch.setattr(synthetics.shutil, "rmtree", lambda *args, **kwargs: None)  # killed: no cleanup
    with pytest.raises(KeyboardInterrupt):
        cached_generate(CFG, 3, tmp_path)
    name = f"mqar-{config_hash(CFG, 3)}"
    assert name not in entries(tmp_path)
    assert len(entries(tmp_path)) == 1, "the temp dir stays behind"
    monkeypatch.setattr(synthetics, "_save", real_save)
    monkeypatch.setattr(synthetics.shutil, "rmtree", real_rmtree)
    seg = cached_generate(CFG, 3, tmp_path)
    assert calls == [3, 3], "the next call must generate, not load the interrupted write"
    assert torch.equal(seg.inputs, generate_mqar(CFG, 3).inputs)
    assert name in entries(tmp_path)


def test_leftover_temp_dir_is_not_picked_up(tmp_path, calls):
    """A process killed mid-write leaves its temp dir behind; later calls ignore it and write the real one."""
    other = tmp_path / "other"
    cached_generate(CFG, 9, other)  # a complete dataset, but of another seed
    name = f"mqar-{config_hash(CFG, 3)}"
    leftover = tmp_path / f".{name}.tmp-killed"
    shutil.copytree(other / f"mqar-{config_hash(CFG, 9)}", leftover)
    seg = cached_generate(CFG, 3, tmp_path)
    assert calls == [9, 3]
    assert torch.equal(seg.inputs, generate_mqar(CFG, 3).inputs)
    assert torch.equal(cached_generate(CFG, 3, tmp_path).inputs, seg.inputs)
    assert calls == [9, 3]
    assert leftover.is_dir() and (tmp_path / name).is_dir()


def test_default_cache_dir_follows_env(tmp_path, monkeypatch, calls):
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "env-cache"))
    cached_generate(CFG, 3)
    assert os.listdir(tmp_path / "env-cache" / "synthetics") == [f"mqar-{config_hash(CFG, 3)}"]
    monkeypatch.delenv("ZOO_CACHE_DIR")
    assert synthetics.default_cache_dir() == Path.home() / ".cache" / "zoo" / "synthetics"
