"""The cartridge store: cartridge files of one directory, loaded on first use and kept in an LRU bounded by bytes.

An id names `<dir>/<id>.safetensors` or `<dir>/<id>/cartridge.safetensors` (the output of `cartridges-distill`).
Every message names a cartridge by its id, never by its path on the server. Files are read through
`cartridges.format` (the one reader): any defect in a file is a `ServeError` (400) for the requests that name it,
and a listing shows every file, readable or not (with the reason).
"""

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cartridges.engine.errors import CartridgeNotFound, ServeError
from cartridges.format import CartridgeError, load_cartridge, read_header

log = logging.getLogger(__name__)

# Ids are file names inside the cartridge dir: no separators, no leading dot, nothing that resolves elsewhere.
CARTRIDGE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FILE_SUFFIX = ".safetensors"


@dataclass
class Entry:
    cartridge: Any
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values [L, H, p, D] in the serving dtype
    nbytes: int = 0


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:300]


class CartridgeStore:
    """Cartridges of one directory in an LRU bounded by bytes.

    A composition (several ids) is built once with the first cartridge's `concat` and cached under the tuple of
    ids. The bytes of an entry are the cartridge's `memory_bytes()` plus the serving-dtype copy of its keys and
    values that the shared-prefix path prepares.
    """

    def __init__(self, directory, model, max_bytes: int = 4 << 30, dtype: torch.dtype | None = None):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ServeError(f"cartridge directory {self.directory} does not exist")
        self.root = self.directory.resolve()
        self.model = model
        self.max_bytes = max_bytes
        self.dtype = dtype or model.dtype
        self.loads = 0  # files read so far (each id once while it stays cached)
        self._entries: OrderedDict[tuple[str, ...], Entry] = OrderedDict()
        self._headers: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}  # path -> ((mtime, size), row)
        self._lock = threading.RLock()

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def cached_ids(self) -> list[tuple[str, ...]]:
        with self._lock:
            return list(self._entries)

    def check(self, cartridge_id: str) -> None:
        """Raise as `path` does for an id that cannot be served; a loaded id passes without touching the disk."""
        with self._lock:
            if (cartridge_id,) in self._entries:
                return
        self.path(cartridge_id)

    def path(self, cartridge_id: str) -> Path:
        """The file of `cartridge_id`; raises ServeError (bad id, 400) or CartridgeNotFound (404).

        A bad id is refused before any file-system call, so no path outside the directory is ever looked at.
        """
        if not isinstance(cartridge_id, str) or not CARTRIDGE_ID.fullmatch(cartridge_id) or ".." in cartridge_id:
            raise ServeError(
                f"invalid cartridge id {str(cartridge_id)[:64]!r}: use letters, digits, '.', '_' and '-' "
                "(no path separators, no '..')"
            )
        candidates = (
            self.directory / f"{cartridge_id}{FILE_SUFFIX}",
            self.directory / cartridge_id / f"cartridge{FILE_SUFFIX}",
        )
        for candidate in candidates:
            # a symlink inside the directory that points outside it is treated as absent
            if candidate.is_file() and candidate.resolve().is_relative_to(self.root):
                return candidate
        raise CartridgeNotFound(f"cartridge {cartridge_id!r} not found")

    def available(self) -> list[dict[str, Any]]:
        """Every id in the directory with its file size and, from the file header only, its kind and token count;
        a file whose header cannot be read is listed with `readable: false` and the reason."""
        found = {}
        for path in sorted(self.directory.glob(f"*{FILE_SUFFIX}")):
            found.setdefault(path.name[: -len(FILE_SUFFIX)], path)
        for path in sorted(self.directory.glob(f"*/cartridge{FILE_SUFFIX}")):
            found.setdefault(path.parent.name, path)
        out = []
        loaded = {ids[0] for ids in self.cached_ids() if len(ids) == 1}
        for cid, path in sorted(found.items()):
            try:
                if not CARTRIDGE_ID.fullmatch(cid) or not path.resolve().is_relative_to(self.root):
                    continue
                row = self._header_row(cid, path)
            except OSError:  # gone or unreadable between the listing and the stat
                continue
            out.append({**row, "loaded": cid in loaded})
        return out

    def _header_row(self, cid: str, path: Path) -> dict[str, Any]:
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._headers.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        row: dict[str, Any] = {"id": cid, "object": "cartridge", "file_bytes": stat.st_size}
        try:
            meta = read_header(path, label=repr(cid))
            row.update(readable=True, kind=meta.get("kind", "kv"), num_tokens=meta["num_tokens"])
        except CartridgeError as e:
            row.update(readable=False, error=_first_line(e))
        with self._lock:
            self._headers[path] = (stamp, row)
        return row

    def peek(self, ids: Sequence[str]) -> Entry | None:
        """The cached entry of `ids` (marked as used), or None when it is not loaded."""
        with self._lock:
            entry = self._entries.get(tuple(ids))
            if entry is not None:
                self._entries.move_to_end(tuple(ids))
            return entry

    def get(self, ids: Sequence[str]) -> Entry | None:
        """The entry for a cartridge or a composition (None for no cartridge), loading what is missing; raises
        ServeError (or CartridgeNotFound) for anything that cannot be served."""
        key = tuple(ids)
        if not key:
            return None
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            if len(key) == 1:
                cartridge = self._load(key[0])
            else:
                parts = [self.get((cid,)).cartridge for cid in key]
                if not hasattr(type(parts[0]), "concat"):
                    raise ServeError(f"cartridges of kind {getattr(parts[0], 'KIND', '?')!r} cannot be composed")
                try:
                    cartridge = type(parts[0]).concat(parts)
                except CartridgeError as e:
                    raise ServeError(f"cartridges {list(key)} cannot be composed: {_first_line(e)}") from None
            entry = Entry(cartridge)
            entry.nbytes = cartridge.memory_bytes()
            self._entries[key] = entry
            self._evict(keep=key)
            return entry

    def prefix(self, entry: Entry) -> tuple[torch.Tensor, torch.Tensor]:
        """The entry's keys and values `[L, H, p, D]` in the serving dtype, prepared once."""
        with self._lock:
            if entry.prefix is None:
                keys = entry.cartridge.keys().detach().to(self.dtype).contiguous()
                values = entry.cartridge.values().detach().to(self.dtype).contiguous()
                entry.prefix = (keys, values)
                entry.nbytes += _tensor_bytes(keys, values)
                self._evict(keep=next((k for k, e in self._entries.items() if e is entry), None))
            return entry.prefix

    def _load(self, cartridge_id: str):
        path = self.path(cartridge_id)
        try:
            cartridge = load_cartridge(path, self.model, label=repr(cartridge_id))
        except CartridgeError as e:
            raise ServeError(f"cartridge {cartridge_id!r} cannot be used: {_first_line(e)}") from None
        cartridge.requires_grad_(False)
        self.loads += 1
        log.info("loaded cartridge %s (%d tokens)", cartridge_id, cartridge.num_tokens)
        return cartridge

    def _evict(self, keep) -> None:
        while len(self._entries) > 1 and sum(e.nbytes for e in self._entries.values()) > self.max_bytes:
            oldest = next(k for k in self._entries if k != keep)
            log.info("evicting cartridge %s from the cache", "+".join(oldest))
            del self._entries[oldest]
