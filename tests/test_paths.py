"""One place for package data and caches (zoo/paths.py): presets and the corpus from the package, every cache
below $ZOO_CACHE_DIR, $ZOO_CONFIG_DIR replacing the presets."""

import shutil
from pathlib import Path

import pytest

from zoo import paths

REPO = Path(__file__).resolve().parent.parent


def test_package_data_is_found_through_the_package():
    assert paths.config_dir() == REPO / "zoo" / "configs"
    assert (paths.config_dir() / "train.yaml").is_file()
    assert sorted(p.name for p in paths.corpus_dir().glob("*.txt"))[0] == "01_bread.txt"
    assert paths.package_path("cartridges", "configs") == REPO / "cartridges" / "configs"


def test_missing_package_data_is_one_clear_error():
    with pytest.raises(FileNotFoundError, match="zoo ships no nothing/here"):
        paths.package_path("zoo", "nothing", "here")


def test_every_cache_is_below_one_root(tmp_path, monkeypatch):
    from zoo import lm_data, pretrained, synthetics

    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path))
    assert synthetics.default_cache_dir() == tmp_path / "synthetics"
    assert pretrained.models_cache_dir() == tmp_path / "models"
    assert lm_data.cache_root(None) == tmp_path / "lm_data"
    monkeypatch.delenv("ZOO_CACHE_DIR")
    assert paths.cache_root() == Path.home() / ".cache" / "zoo"
    with pytest.raises(ValueError, match="unknown cache kind"):
        paths.cache_dir("tmp")


def test_zoo_config_dir_replaces_the_presets(tmp_path, monkeypatch):
    from zoo.train import load_config

    mine = tmp_path / "configs"
    shutil.copytree(paths.config_dir(), mine)
    (mine / "model" / "mine.yaml").write_text((mine / "model" / "based.yaml").read_text().replace("64", "48", 1))
    monkeypatch.setenv("ZOO_CONFIG_DIR", str(mine))
    cfg, _ = load_config(["model=mine"])
    assert cfg.model.d_model == 48
