"""The cartridge file format: the one reader and writer, for every kind of cartridge.

A cartridge file is safetensors: the tensors, and one JSON metadata entry (`METADATA_KEY`) holding the format
version, the `kind`, a sha256 `checksum` of the tensor data, the model signature (`model`) and provenance. Each
kind adds its own keys:

- "kv" (`cartridges.cache.Cartridge`): `layers.{l}.keys` / `layers.{l}.values` `[kv_heads, p, head_dim]`;
  num_layers, num_kv_heads, head_dim, num_frozen, rope_convention.
- "state" (`cartridges.state.StateCartridge`): `layers.{l}.{entry}` per state entry; num_layers and the
  per-layer `layout`.

`KINDS` is the static table of kinds: each names its class (imported when a file of that kind is built, so
this module imports neither cartridge module) and the check of its metadata. Reading checks everything the
loaders rely on before they see it: the header's structure, every metadata field's type and range, the
checksum, and that every floating tensor is finite. Any defect raises `CartridgeFileError` with one line that
names the file by `label` (default: its path), so a server can name it by its id instead.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoo.atomic import atomic_write_bytes

FORMAT_VERSION = 1
METADATA_KEY = "zoo.cartridge"
# Keys are cached after the model's rotary embedding, at absolute positions 0..p-1; queries continue at p.
ROPE_CONVENTION = "post-rope;keys-at-positions-0..p-1;queries-start-at-p"
# A safetensors header larger than this is not one this code wrote (a cartridge's header is a few KiB).
MAX_HEADER_BYTES = 16 << 20
# Bounds on counts in the metadata: far above any real model, low enough that loops over them stay short.
MAX_LAYERS = 4096
MAX_COUNT = 1 << 40
# The fields of `cartridges.cache.ModelSignature`, as the file stores them.
SIGNATURE_FIELDS = ("model_id", "config_hash", "num_layers", "num_kv_heads", "head_dim", "weights_sample")
STATE_ROLES = ("state", "accumulator", "bookkeeping")


class CartridgeError(ValueError):
    """A cartridge cannot be built, loaded or used as asked."""


class CartridgeFileError(CartridgeError):
    """A cartridge file is missing, truncated, corrupted or not a cartridge."""


class CartridgeMismatchError(CartridgeError):
    """A cartridge does not belong to the model (or the other cartridge) it is used with."""


# ---- checks of JSON values (each raises CartridgeFileError naming the field)


def _fail(label: str, message: str):
    raise CartridgeFileError(f"{label}: {message}")


def _int(label: str, name: str, value, low: int = 0, high: int = MAX_COUNT) -> int:
    if type(value) is not int or not low <= value <= high:
        _fail(label, f"metadata field {name!r} must be an integer in [{low}, {high}], got {_show(value)}")
    return value


def _str(label: str, name: str, value) -> str:
    if not isinstance(value, str):
        _fail(label, f"metadata field {name!r} must be a string, got {_show(value)}")
    return value


def _show(value) -> str:
    text = json.dumps(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
    return text[:40]


def _check_signature(label: str, model) -> None:
    if not isinstance(model, dict) or set(model) != set(SIGNATURE_FIELDS):
        got = sorted(model) if isinstance(model, dict) else type(model).__name__
        _fail(label, f"metadata field 'model' must be an object with exactly {list(SIGNATURE_FIELDS)}, got {got}")
    _str(label, "model.model_id", model["model_id"])
    _str(label, "model.config_hash", model["config_hash"])
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        _int(label, f"model.{name}", model[name], high=MAX_COUNT)
    sample = model["weights_sample"]
    if not isinstance(sample, list) or len(sample) > 1024:
        _fail(label, "metadata field 'model.weights_sample' must be a list of at most 1024 numbers")
    if any(type(x) not in (int, float) or not math.isfinite(x) for x in sample):
        _fail(label, "metadata field 'model.weights_sample' must hold finite numbers only")


def _check_kv(label: str, meta: dict) -> None:
    _int(label, "num_layers", meta["num_layers"], 1, MAX_LAYERS)
    _int(label, "num_kv_heads", meta["num_kv_heads"], 1)
    _int(label, "head_dim", meta["head_dim"], 1)
    _int(label, "num_tokens", meta["num_tokens"], 1)
    _int(label, "num_frozen", meta["num_frozen"], 0, meta["num_tokens"])
    if meta["rope_convention"] != ROPE_CONVENTION:
        _fail(label, f"RoPE convention {_show(meta['rope_convention'])}, expected {ROPE_CONVENTION!r}")


def _check_state(label: str, meta: dict) -> None:
    layers = _int(label, "num_layers", meta["num_layers"], 1, MAX_LAYERS)
    layout = meta["layout"]
    if not isinstance(layout, list) or len(layout) != layers:
        _fail(label, f"the layout does not list num_layers={layers} layers")
    for i, spec in enumerate(layout):
        if spec is None:
            continue
        where = f"layout[{i}]"
        if not isinstance(spec, dict) or not {"mixer", "entries"} <= set(spec) <= {"mixer", "entries", "rows"}:
            _fail(label, f"{where} must be null or an object with 'mixer', 'entries' (and 'rows')")
        _str(label, f"{where}.mixer", spec["mixer"])
        if "rows" in spec:
            _int(label, f"{where}.rows", spec["rows"])
        entries = spec["entries"]
        if not isinstance(entries, dict):
            _fail(label, f"{where}.entries must be an object")
        for key, entry in entries.items():
            if not isinstance(entry, dict) or set(entry) != {"shape", "role"}:
                _fail(label, f"{where}.entries.{key[:40]} must be an object with 'shape' and 'role'")
            shape = entry["shape"]
            if not isinstance(shape, list) or len(shape) > 8 or any(type(d) is not int or d < 0 for d in shape):
                _fail(label, f"{where}.entries.{key[:40]}.shape must be a list of at most 8 sizes")
            if entry["role"] not in STATE_ROLES:
                _fail(label, f"{where}.entries.{key[:40]}.role must be one of {list(STATE_ROLES)}")
    _int(label, "num_tokens", meta["num_tokens"], 0)


@dataclass(frozen=True)
class Kind:
    """One kind of cartridge: the class that builds it (`module:name`), its metadata keys and their check."""

    cls: str
    keys: tuple[str, ...]
    check: Callable[[str, dict], None]


KINDS: dict[str, Kind] = {
    "kv": Kind(
        "cartridges.cache:Cartridge",
        ("num_layers", "num_kv_heads", "head_dim", "num_frozen", "rope_convention"),
        _check_kv,
    ),
    "state": Kind("cartridges.state:StateCartridge", ("num_layers", "layout"), _check_state),
}
COMMON_KEYS = ("model", "num_tokens", "init_method", "corpus_hash", "training_config", "checksum", "dtype")


def cartridge_class(kind: str) -> type:
    """The class of `kind` (a key of `KINDS`)."""
    module, name = KINDS[kind].cls.split(":")
    return getattr(importlib.import_module(module), name)


def check_metadata(meta, label: str) -> dict[str, Any]:
    """`meta` (decoded JSON) if it can describe a cartridge of a known kind; else CartridgeFileError."""
    if not isinstance(meta, dict):
        _fail(label, f"the {METADATA_KEY} metadata must be a JSON object, got {type(meta).__name__}")
    if meta.get("format_version") != FORMAT_VERSION or type(meta.get("format_version")) is not int:
        _fail(label, f"cartridge format version {_show(meta.get('format_version'))}, this code reads {FORMAT_VERSION}")
    kind = meta.get("kind", "kv")
    if not isinstance(kind, str) or kind not in KINDS:
        _fail(label, f"unknown cartridge kind {_show(kind)} (known: {sorted(KINDS)})")
    missing = [k for k in (*COMMON_KEYS, *KINDS[kind].keys) if k not in meta]
    if missing:
        _fail(label, f"cartridge metadata lacks {missing}")
    _check_signature(label, meta["model"])
    for name in ("init_method", "corpus_hash", "checksum", "dtype"):
        _str(label, name, meta[name])
    if not isinstance(meta["training_config"], dict):
        _fail(label, "metadata field 'training_config' must be an object")
    KINDS[kind].check(label, meta)
    return meta


def _check_header(header, label: str) -> int:
    """The end of the tensor data that a decoded safetensors header describes; CartridgeFileError when any entry
    is not {"dtype": str, "shape": [int...], "data_offsets": [begin, end]}."""
    if not isinstance(header, dict):
        _fail(label, "not a cartridge file (the safetensors header is not a JSON object)")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            _fail(label, f"corrupted header: tensor {name[:60]!r} is not a dtype/shape/data_offsets entry")
        offsets, shape = entry["data_offsets"], entry["shape"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or any(type(o) is not int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            _fail(label, f"corrupted header: tensor {name[:60]!r} has bad data_offsets")
        if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
            _fail(label, f"corrupted header: tensor {name[:60]!r} has a bad shape")
        if not isinstance(entry["dtype"], str):
            _fail(label, f"corrupted header: tensor {name[:60]!r} has a bad dtype")
        end = max(end, offsets[1])
    return end


def _parse_header(raw: bytes, label: str) -> tuple[int, dict]:
    """(end of the tensor data, metadata) decoded from the header bytes, both checked."""
    try:
        header = json.loads(raw)
        blob = header["__metadata__"][METADATA_KEY]
        if not isinstance(blob, str):
            raise TypeError
        meta = json.loads(blob)
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CartridgeFileError(f"{label} is not a cartridge file (no readable {METADATA_KEY} metadata)") from None
    end = _check_header(header, label)
    return end, check_metadata(meta, label)


def read_header(path: str | os.PathLike, label: str | None = None) -> dict[str, Any]:
    """The checked metadata of a cartridge file, from its header alone (the tensors are neither read nor
    checksummed: for listings)."""
    label = label or str(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                _fail(label, "not a cartridge: too short for a safetensors header")
            (size,) = struct.unpack("<Q", head)
            if size > MAX_HEADER_BYTES:
                _fail(label, f"not a cartridge: a {size}-byte header")
            raw = f.read(size)
    except OSError as e:
        raise CartridgeFileError(f"cannot read cartridge {label}: {e.strerror or e}") from None
    if len(raw) < size:
        _fail(label, f"truncated: the header needs {8 + size} bytes")
    return _parse_header(raw, label)[1]


def tensor_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes of the tensors, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_cartridge_file(path: str | os.PathLike, kind: str, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write `path` atomically (temp file + rename): safetensors of `tensors` and the JSON metadata `meta`,
    completed with the format version, the `kind` and a checksum of the tensor data."""
    from safetensors.torch import save as st_save

    if kind not in KINDS:
        raise CartridgeError(f"unknown cartridge kind {kind!r} (known: {sorted(KINDS)})")
    path = Path(path)
    meta = {**meta, "format_version": FORMAT_VERSION, "kind": kind, "checksum": "sha256:" + tensor_checksum(tensors)}
    data = st_save(tensors, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})
    atomic_write_bytes(path, data)
    return path


def read_cartridge_file(
    path: str | os.PathLike, expected_kind: str | None = None, label: str | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a cartridge file, after checking its structure, metadata, checksum and values (and,
    when given, that it holds a cartridge of `expected_kind`)."""
    from safetensors.torch import load as st_load

    label = label or str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CartridgeFileError(f"cannot read cartridge {label}: {e.strerror or e}") from None
    if len(data) < 8:
        raise CartridgeFileError(f"{label} is not a cartridge: {len(data)} bytes, too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > MAX_HEADER_BYTES:
        raise CartridgeFileError(f"{label} is not a cartridge: a {header_len}-byte header")
    if 8 + header_len > len(data):
        raise CartridgeFileError(f"{label} is truncated: header needs {8 + header_len} bytes, file has {len(data)}")
    data_end, meta = _parse_header(data[8 : 8 + header_len], label)
    if 8 + header_len + data_end > len(data):
        raise CartridgeFileError(
            f"{label} is truncated: {len(data)} bytes, the header promises {8 + header_len + data_end}"
        )
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own error types for malformed data
        raise CartridgeFileError(f"{label} is corrupted: {str(e).splitlines()[0][:200]}") from None
    kind = meta.get("kind", "kv")
    if expected_kind is not None and kind != expected_kind:
        raise CartridgeMismatchError(f"{label} holds a {kind!r} cartridge, not a {expected_kind!r} one")
    if meta["checksum"] != "sha256:" + tensor_checksum(tensors):
        raise CartridgeFileError(f"{label} is corrupted: the tensor data does not match its checksum")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CartridgeFileError(f"{label}: tensor {name[:60]!r} holds NaN or infinite values")
    return meta, tensors


def load_cartridge(path: str | os.PathLike, model, check_model_id: bool = True, device=None, label: str | None = None):
    """Load any kind of cartridge file (the metadata's `kind` picks the class) and check it against `model`.

    Raises `CartridgeFileError` for a file that cannot describe a cartridge (anything the class's builder
    rejects included) and `CartridgeMismatchError` for a cartridge of another model.
    """
    label = label or str(path)
    meta, tensors = read_cartridge_file(path, label=label)  # read and checksummed once
    cls = cartridge_class(meta.get("kind", "kv"))
    try:
        return cls.from_file(label, meta, tensors, model, check_model_id=check_model_id, device=device)
    except (CartridgeError, torch.OutOfMemoryError):
        raise
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as e:
        # the checks above admit only what the builders handle; this keeps the one error type if they miss one
        raise CartridgeFileError(f"{label}: tensors do not fit the metadata ({type(e).__name__}: {e})") from None
