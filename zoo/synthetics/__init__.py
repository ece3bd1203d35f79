"""Recall synthetics: one task per file (`<task>.py` holds its Config dataclass and generator).

`generate(cfg, seed)` dispatches on the config's type through `TASKS`. `cached_generate` keeps each
generated segment on disk as a Hugging Face `datasets` Dataset in `<cache_dir>/<task>-<hash>`, where the
hash covers the task, the config, the seed and `GENERATOR_VERSION`.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from zoo.atomic import publish_dir
from zoo.synthetics.base import IGNORE_INDEX, Segment
from zoo.synthetics.circuits import MajorityConfig, ParityConfig, generate_majority, generate_parity
from zoo.synthetics.compositional_mqar import CompositionalMQARConfig, generate_compositional_mqar
from zoo.synthetics.forgetting_mqar import ForgettingMQARConfig, generate_forgetting_mqar
from zoo.synthetics.mqar import MQARConfig, generate_mqar, generate_mqar_reference
from zoo.synthetics.stacked_mqar import StackedMQARConfig, generate_stacked_mqar

__all__ = [
    "GENERATOR_VERSION",
    "IGNORE_INDEX",
    "TASKS",
    "CompositionalMQARConfig",
    "ForgettingMQARConfig",
    "MQARConfig",
    "MajorityConfig",
    "ParityConfig",
    "StackedMQARConfig",
    "Segment",
    "cached_generate",
    "config_hash",
    "default_cache_dir",
    "generate",
    "generate_mqar",
    "generate_mqar_reference",
]

# Bump whenever a generator's output for a given (config, seed) changes, so stale caches are not reused.
GENERATOR_VERSION = 1

TASKS = {
    "mqar": (MQARConfig, generate_mqar),
    "compositional_mqar": (CompositionalMQARConfig, generate_compositional_mqar),
    "forgetting_mqar": (ForgettingMQARConfig, generate_forgetting_mqar),
    "stacked_mqar": (StackedMQARConfig, generate_stacked_mqar),
    "parity": (ParityConfig, generate_parity),
    "majority": (MajorityConfig, generate_majority),
}

_META_FILE = "zoo_segment.json"


def task_name(cfg) -> str:
    """The `TASKS` key whose config class is exactly `type(cfg)`."""
    for name, (config_cls, _) in TASKS.items():
        if type(cfg) is config_cls:
            return name
    raise ValueError(f"no synthetic task takes a {type(cfg).__name__} config (tasks: {sorted(TASKS)})")


def generate(cfg, seed: int) -> Segment:
    """Generate the segment of `cfg` with `seed` through the task that owns the config's type."""
    return TASKS[task_name(cfg)][1](cfg, seed)


def config_hash(cfg, seed: int) -> str:
    """16 hex digits of sha256 over the task name, the config fields (sorted JSON), the seed and version."""
    payload = {
        "task": task_name(cfg),
        "config": dataclasses.asdict(cfg),
        "seed": seed,
        "version": GENERATOR_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """`$ZOO_CACHE_DIR/synthetics` (default `~/.cache/zoo/synthetics`; zoo.paths)."""
    from zoo.paths import cache_dir

    return cache_dir("synthetics")


def cached_generate(cfg, seed: int, cache_dir: str | Path | None = None) -> Segment:
    """`generate(cfg, seed)`, loaded from `<cache_dir>/<task>-<hash>` when there, else generated and saved.

    The save goes to a temporary directory beside the target and is renamed into place once complete, so an
    interrupted write never leaves a directory that a later call would load.
    """
    name = f"{task_name(cfg)}-{config_hash(cfg, seed)}"
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / name
    if path.is_dir():
        return _load(path)
    segment = generate(cfg, seed)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        _save(segment, tmp, {"task": task_name(cfg), "seed": seed, "config": dataclasses.asdict(cfg)})
        publish_dir(tmp, path)
        try:
            os.replace(tmp, path)
        except OSError:
            # Another process finished the same segment first; its copy is identical.
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return segment


def _save(segment: Segment, path: Path, meta: dict) -> None:
    import datasets
    import pyarrow as pa

    n, length = segment.inputs.shape
    columns = {}
    for key in ("inputs", "labels"):
        flat = pa.array(getattr(segment, key).reshape(-1).numpy())
        columns[key] = pa.FixedSizeListArray.from_arrays(flat, length)
    features = datasets.Features({k: datasets.Sequence(datasets.Value("int64"), length=length) for k in columns})
    table = pa.table(columns).cast(features.arrow_schema)
    dataset = datasets.Dataset(table, info=datasets.DatasetInfo(features=features))
    # A cache write takes milliseconds; datasets' own per-write progress bar would only clutter training logs.
    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    try:
        dataset.save_to_disk(str(path))
    finally:
        if was_enabled:
            datasets.utils.logging.enable_progress_bar()
    meta = {**meta, "slices": segment.slices, "num_examples": n, "seq_len": length, "version": GENERATOR_VERSION}
    (path / _META_FILE).write_text(json.dumps(meta, indent=1))


def _load(path: Path) -> Segment:
    import datasets

    meta = json.loads((path / _META_FILE).read_text())
    ds = datasets.load_from_disk(str(path))
    n, length = meta["num_examples"], meta["seq_len"]
    if ds.num_rows != n:
        raise ValueError(f"cached segment {path} holds {ds.num_rows} rows, its metadata says {n}")
    tensors = []
    for key in ("inputs", "labels"):
        values = ds.data.column(key).combine_chunks().flatten().to_numpy()
        # Copy out of the memory-mapped Arrow file into memory the tensor owns.
        tensors.append(torch.from_numpy(np.array(values, dtype=np.int64).reshape(n, length)))
    return Segment(tensors[0], tensors[1], {k: int(v) for k, v in meta["slices"].items()})
