"""The run directory: the one place that knows its on-disk layout.

    runs/<experiment_name>/<run>/
        config.yaml      the resolved config, with the git SHA and library versions
        metrics.jsonl    one JSON object per log step and per evaluation
        summary.json     final metrics, parameters, state size, wall time, tokens/s
        ckpt/last.pt     the last checkpoint (written to a temp file, then renamed)

Every write that replaces a file is atomic, so a kill at any moment leaves either the old or the new file.
`find_resumable` finds the run that `train.resume=true` continues. torch is imported only to read and write
checkpoints, so listing and plotting runs stays light.
"""

import contextlib
import functools
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CKPT = "ckpt/last.pt"


def umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only be read by setting it,
    which would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def published_mode(path: Path, directory: bool = False) -> int:
    """The mode a file written at `path` should get: the mode of the file it replaces, else what `open` would give
    a new one (0o666, or 0o777 for a directory, less the umask). mkstemp and mkdtemp create 0o600 and 0o700, which
    would hide a run's files from the other users of a shared filesystem."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        return (0o777 if directory else 0o666) & ~umask()


def publish_dir(staging: Path, target: Path) -> None:
    """Before a directory made by mkdtemp (0o700) is renamed to `target`: give it the mode a new directory there
    would get, and every file and directory inside it the umask's mode too. The libraries that fill such trees
    (safetensors' `save_file` among them) may write their files 0o600."""
    mask = umask()
    os.chmod(staging, published_mode(target, directory=True))
    for root, dirs, files in os.walk(staging):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            executable = os.stat(path).st_mode & 0o100
            os.chmod(path, (0o777 if executable else 0o666) & ~mask)


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """A temporary sibling of `target` to fill; when the block ends without error it takes `target`'s place whole
    (the old tree, if any, is removed after the swap), with `publish_dir`'s modes. An error leaves the old `target`
    as it was and removes the temporary tree; a kill may leave a temporary tree (its name starts with a dot), never a
    half-written `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        yield staging
        publish_dir(staging, target)
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-old-"))
            os.replace(target, old)  # onto the empty directory mkdtemp made
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _atomic_replace(path: Path, write, keep_suffix: bool = False) -> None:
    """`write(fd, tmp)` fills a temporary file beside `path` (`.<name>.*.tmp`, or `.<stem>.*<suffix>` with
    `keep_suffix`), which then takes `path`'s place with `published_mode`: a kill at any moment leaves the old file
    whole or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if keep_suffix:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    else:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, published_mode(path))
        write(fd, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    def write(fd: int, tmp: str) -> None:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    _atomic_replace(path, write)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_savefig(fig: Any, path: Path, **kwargs: Any) -> None:
    """matplotlib's `fig.savefig(path, **kwargs)` through a temporary file beside `path`, then a rename: a killed
    plot leaves the old figure whole, never a truncated one. The temporary file keeps the suffix, which sets the
    format."""

    def write(fd: int, tmp: str) -> None:
        os.close(fd)
        fig.savefig(tmp, **kwargs)

    _atomic_replace(path, write, keep_suffix=True)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename: a killed save leaves the old file whole."""
    import torch

    def write(fd: int, tmp: str) -> None:
        os.close(fd)
        torch.save(obj, tmp)

    _atomic_replace(path, write)


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
