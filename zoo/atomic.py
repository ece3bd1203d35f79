"""Files and directories written whole: a temporary sibling, then a rename, so a kill at any moment leaves the old
version or the new one, never a torn one. What is written gets the mode `open` would give it (the umask's), or keeps
the mode of the file it replaces: mkstemp and mkdtemp alone would make everything private (0o600, 0o700).

Standard library only (torch is imported by `atomic_torch_save` alone), so any module of zoo can use it without an
import cycle.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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
