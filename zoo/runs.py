"""The run directory: the one place that knows its on-disk layout.

    runs/<experiment_name>/<run>/
        config.yaml      the resolved config, with the git SHA and library versions
        metrics.jsonl    one JSON object per log step and per evaluation
        summary.json     final metrics, parameters, state size, wall time, tokens/s
        ckpt/last.pt     the last checkpoint (written to a temp file, then renamed)

Every write that replaces a file is atomic (`zoo.atomic`), so a kill at any moment leaves either the old or the new
file.
`find_resumable` finds the run that `train.resume=true` continues. torch is imported only to read and write
checkpoints, so listing and plotting runs stays light.
"""

import functools
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zoo.atomic import atomic_torch_save, atomic_write_text

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CKPT = "ckpt/last.pt"


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("zoo", "torch", "triton", "transformers", "datasets", "hydra-core", "flash-linear-attention"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return versions


class RunDir:
    """Reads and writes one run directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def exists(self) -> bool:
        return (self.path / CONFIG).exists()

    def is_finished(self) -> bool:
        return (self.path / SUMMARY).exists()

    def write_config(self, resolved_yaml: str) -> None:
        header = {"git_sha": git_sha(), "versions": library_versions()}
        meta = "".join(f"# {line}\n" for line in json.dumps(header, sort_keys=True).splitlines())
        atomic_write_text(self.path / CONFIG, meta + resolved_yaml)

    def append_metrics(self, record: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / METRICS, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        path = self.path / METRICS
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                # A kill mid-append can leave one torn last line; everything before it is intact.
                break
        return records

    def truncate_metrics(self, max_step: int) -> None:
        """Drop records logged after `max_step` (they belong to work a resume will redo)."""
        kept = [r for r in self.read_metrics() if r.get("step", 0) <= max_step]
        atomic_write_text(self.path / METRICS, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.path / SUMMARY, json.dumps(summary, indent=2, sort_keys=True) + "\n")

    def read_summary(self) -> dict[str, Any]:
        return json.loads((self.path / SUMMARY).read_text())

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        atomic_torch_save(state, self.path / CKPT)

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.path / CKPT
        if not path.exists():
            return None
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)

    def checkpoint_position(self) -> tuple[int, int] | None:
        """(epoch, step) of the last checkpoint, or None: the file is memory-mapped, so its tensors (hundreds of MB
        for a wide pack) are not read."""
        path = self.path / CKPT
        if not path.exists():
            return None
        import torch

        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return ckpt["epoch"], ckpt["step"]

    def clear(self) -> None:
        """Remove the files of an earlier run (for overwrite=true); leaves unrelated files alone."""
        for name in (CONFIG, METRICS, SUMMARY, CKPT):
            (self.path / name).unlink(missing_ok=True)


def find_runs(root: str | Path) -> Iterator[RunDir]:
    """Every run dir below `root` (a directory holding config.yaml)."""
    for config in sorted(Path(root).rglob(CONFIG)):
        yield RunDir(config.parent)


# Top-level fields that say where a run goes and how it is logged, not what it computes.
RUN_CONTROL = ("logger", "run", "runs_root", "run_dir")


def run_identity(tree: dict[str, Any], train_control) -> dict[str, Any]:
    """A config tree without its run-control fields (RUN_CONTROL, and `train_control` under train): two runs
    with equal identities compute the same thing."""
    out = {k: v for k, v in tree.items() if k not in RUN_CONTROL}
    if isinstance(out.get("train"), dict):
        out["train"] = {k: v for k, v in out["train"].items() if k not in train_control}
    return out


# Data fields that say where the segments are cached, not what they are.
DATA_CACHE = ("cache", "cache_dir")


def training_setup(tree: dict[str, Any], train_control) -> dict[str, Any]:
    """What a run trains on and how, beyond its point (`point_key`): its data (without where they are cached), its
    optimiser and its training fields but the run-control ones (`run_identity`). A committed summary holds it
    (`zoo.plot.copy_summaries`), so a sweep skips a run for it only when the two trained alike."""
    identity = run_identity(tree, train_control)
    data = {k: v for k, v in (identity.get("data") or {}).items() if k not in DATA_CACHE}
    return {"data": data, "optim": identity.get("optim") or {}, "train": identity.get("train") or {}}


@functools.cache
def _defaults(schema: str) -> dict[str, Any]:
    """Field -> current default of the config dataclass `schema` (a name in zoo.config), for the fields that have
    one."""
    import dataclasses

    from zoo import config

    out = {}
    for f in dataclasses.fields(getattr(config, schema)):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def without_defaults(section: dict[str, Any], schema: str) -> dict[str, Any]:
    """A resolved config section without the top-level fields at `schema`'s current defaults: a record written
    before a field existed then reads the same as a config that leaves it at its default."""
    defaults = _defaults(schema)
    return {k: v for k, v in section.items() if not (k in defaults and v == defaults[k])}


def model_without_defaults(model: dict[str, Any]) -> dict[str, Any]:
    """The model section without the fields at ModelConfig's current defaults (`without_defaults`)."""
    return without_defaults(model, "ModelConfig")


def same_setup(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two `training_setup`s train alike, fields at their current defaults aside (`without_defaults`, per
    section and per data segment): a setup recorded before a field existed matches a run that leaves it at its
    default, so adding a config field does not make every committed run look trained otherwise."""
    from zoo.config import SPLITS

    def normal(setup: dict[str, Any]) -> dict[str, Any]:
        data = without_defaults(setup.get("data") or {}, "DataConfig")
        for split in SPLITS:
            if isinstance(data.get(split), list):
                data[split] = [without_defaults(seg, "SegmentConfig") if isinstance(seg, dict) else seg
                               for seg in data[split]]
        return {"data": data, "optim": without_defaults(setup.get("optim") or {}, "OptimConfig"),
                "train": without_defaults(setup.get("train") or {}, "TrainConfig")}

    return normal(a) == normal(b)


def point_key(experiment: str, model: dict[str, Any], lr: float, seed: int, seq_len: int) -> str:
    """What makes two runs the same point of a reproduction, as its committed summaries can tell: experiment,
    resolved model config (`model_without_defaults`), lr, seed and the longest training length (a panel's L).
    Run names cannot say it across code versions: their hash changed in commit 391d691."""
    return json.dumps({"experiment": experiment, "model": model_without_defaults(model), "lr": float(lr),
                       "seed": int(seed), "seq_len": int(seq_len)}, sort_keys=True)


def summary_point_key(record: dict[str, Any]) -> str:
    """`point_key` of a committed summary (summary.json plus its resolved "model", `zoo.plot.copy_summaries`)."""
    return point_key(record["experiment"], record.get("model", {}), record["lr"], record["seed"],
                     record["state_bytes_seq_len"])


def config_point_key(tree: dict[str, Any]) -> str:
    """`point_key` of a resolved config tree (what config.yaml holds)."""
    return point_key(tree["experiment_name"], tree["model"], tree["optim"]["lr"], tree["train"]["seed"],
                     max(seg["seq_len"] for seg in tree["data"]["train"]))


def identity_digest(tree: dict[str, Any], train_control) -> str:
    """8 hex digits of the run's identity (`run_identity`): where a run goes (runs_root, run_dir) and how it is
    logged never change its name, so a sweep under another runs root, or a moved runs folder, still skips it."""
    import hashlib

    import yaml

    text = yaml.safe_dump(run_identity(tree, train_control), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def read_config_tree(run: RunDir) -> dict[str, Any] | None:
    import yaml

    try:
        tree = yaml.safe_load((run.path / CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return tree if isinstance(tree, dict) else None


def last_activity(run: RunDir) -> float:
    """When the run last wrote anything (checkpoint, metrics, summary or config)."""
    paths = [run.path / name for name in (CKPT, METRICS, SUMMARY, CONFIG)]
    times = [p.stat().st_mtime for p in paths if p.exists()]
    return max(times, default=0.0)


def find_resumable(experiment_dir: str | Path, resolved_yaml: str, train_control) -> RunDir:
    """The run `train.resume=true` continues: the latest run dir directly below `experiment_dir` whose
    config.yaml equals `resolved_yaml` apart from run-control fields (`run_identity`).

    Raises ValueError naming what it looked for when there is none."""
    import yaml

    want = run_identity(yaml.safe_load(resolved_yaml), train_control)
    root = Path(experiment_dir)
    candidates = []
    for config in sorted(root.glob(f"*/{CONFIG}")):
        run = RunDir(config.parent)
        tree = read_config_tree(run)
        if tree is not None and run_identity(tree, train_control) == want:
            candidates.append((last_activity(run), str(run.path), run))
    if not candidates:
        ignored = ", ".join([*RUN_CONTROL, *(f"train.{k}" for k in train_control)])
        runs = len(list(root.glob(f"*/{CONFIG}"))) if root.is_dir() else 0
        raise ValueError(
            f"train.resume=true: no run in {root}/ has this config ({runs} runs there; compared every config.yaml "
            f"apart from {ignored}): repeat the killed run's overrides, or drop train.resume to start a new run"
        )
    return max(candidates)[2]
