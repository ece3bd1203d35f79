"""Serving cartridges: a Python API (`Server`) and an OpenAI-compatible HTTP server (`cartridges-serve`).

`Server(model, cartridge_dir).generate(requests)` groups requests by the cartridges they use and runs each group
as one batch. A cartridge is loaded once (through `cartridges.cache.load_cartridge`, which dispatches on the
file's kind) and kept in an LRU bounded by bytes; a request may compose several (`Cartridge.concat`).

Sharing without copies. transformers' `DynamicCache` appends with `torch.cat`, which turns a cartridge expanded
over the batch into one copy per sequence at the first decode step. For KV cartridges on Llama-family models
the server keeps instead a `SharedPrefixCache`: the cartridge's keys and values once per layer (`[H, p, D]`)
plus a preallocated per-request suffix (`[B, H, S, D]`, the prompt and the generated tokens), and runs
attention through a function registered with transformers' `AttentionInterface`. It attends to the prefix
with every query of the batch folded into one matrix (the prefix is read once per step) and to each request's
suffix separately, then merges the two softmaxes with their log-sum-exp (cascade attention). Other cartridge
kinds (and other models) take the plain path: `cartridge.as_cache(batch_size, dtype=, config=)` and the
model's own cache, batching only prompts of equal length.

Decoding without host overhead. A small model's decode step is a few thousand kernel launches, so eager
PyTorch is bound by the host, not the GPU. The shared-prefix decode step therefore has fixed shapes for a
batch: it attends over the whole preallocated suffix (masked), reads the next column and the positions from
device tensors, and takes its inputs from static buffers; on CUDA it is captured once as a CUDA graph and
replayed per token (`Server(cuda_graphs=...)`). The eager and the captured path run the same step function. The
loop reads the generated tokens back every `SYNC_EVERY` steps unless a row streams, samples or stops on strings.

HTTP (FastAPI + uvicorn): `POST /v1/chat/completions` and `/v1/completions` take the extension field
`cartridges: [{"id": "..."}]` (ids are file names in the cartridge dir: `<id>.safetensors` or
`<id>/cartridge.safetensors`) and stream over SSE with `stream: true`. `GET /v1/models`, `/v1/cartridges`,
`/health`. Requests that arrive while a batch runs wait in a queue; a background worker groups them by
cartridge set and runs each group as one batch.
"""

import argparse
import asyncio
import json
import logging
import re
import struct
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cartridges.corpus import left_pad

log = logging.getLogger(__name__)

# Model types whose attention modules call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` with the
# current keys and values `[B, H, T, D]` and pass the forward's extra keyword arguments through to it.
SHARED_PREFIX_MODEL_TYPES = ("llama",)
ATTENTION_NAME_PREFIX = "cartridges_cascade_"
# Ids are file names inside the cartridge dir: no separators, no leading dot, nothing that resolves elsewhere.
CARTRIDGE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FILE_SUFFIX = ".safetensors"


class ServeError(ValueError):
    """A request cannot be served as asked; `status` is the HTTP status that reports it."""

    status = 400
    kind = "invalid_request_error"


class CartridgeNotFound(ServeError):
    status = 404
    kind = "not_found_error"


# --------------------------------------------------------------------------------------------------------------
# Cascade attention over a shared prefix and per-request suffixes


def cascade_attention(
    query: torch.Tensor,
    prefix_keys: torch.Tensor | None,
    prefix_values: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """softmax(q·[Kp; Ks]ᵀ)·[Vp; Vs] without repeating the shared prefix per request.

    query `[B, Hq, T, D]`; prefix keys/values `[Hkv, p, D]` shared by the batch (None: no prefix); keys/values
    `[B, Hkv, S, D]` of each request; mask `[B, 1, T, S]` bool, True where a query may see a suffix key (every
    query sees the whole prefix). Grouped-query attention: Hq = G·Hkv. Returns `[B, T, Hq, D]`.

    Each part yields unnormalised outputs o, row maxima m and sums l; the merge rescales both to the common
    maximum, which equals one softmax over the concatenated keys. A query that sees nothing gives zeros.
    """
    return _cascade(query, prefix_keys, prefix_values, keys, values, ~mask[:, :, None], scaling)


def _cascade(query, prefix_keys, prefix_values, keys, values, blocked, scaling: float) -> torch.Tensor:
    """`cascade_attention` with the mask already inverted and shaped `[B, 1, 1, T, S]` (done once per step for
    every layer)."""
    batch, q_heads, steps, dim = query.shape
    kv_heads, size = keys.shape[1], keys.shape[2]
    groups = q_heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * steps, dim)  # [B, Hkv, G·T, D]

    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling  # [B, Hkv, G·T, S]
    scores = scores.view(batch, kv_heads, groups, steps, size).masked_fill(blocked, float("-inf"))
    m_s = scores.amax(-1, keepdim=True)  # [B, Hkv, G, T, 1]
    # a query that sees no suffix key has m_s = -inf: subtract 0 instead, so its weights are exp(-inf) = 0
    weights = torch.exp(scores - m_s.nan_to_num(neginf=0.0))
    l_s = weights.sum(-1, keepdim=True)
    o_s = torch.matmul(weights.view(batch, kv_heads, groups * steps, size).to(values.dtype), values)
    o_s = o_s.float().view(batch, kv_heads, groups, steps, dim)  # [B, Hkv, G, T, D]

    if prefix_keys is None:
        out = o_s / l_s.clamp_min(torch.finfo(torch.float32).tiny)
    else:
        # The whole batch's queries as rows of one matrix per KV head: the prefix is read once, never expanded.
        rows = q.permute(1, 0, 2, 3).reshape(kv_heads, batch * groups * steps, dim)  # [Hkv, B·G·T, D]
        p_scores = torch.bmm(rows, prefix_keys.transpose(1, 2)).float() * scaling  # [Hkv, B·G·T, p]
        m_p = p_scores.amax(-1, keepdim=True)
        p_weights = torch.exp(p_scores - m_p)
        l_p = p_weights.sum(-1, keepdim=True)
        o_p = torch.bmm(p_weights.to(prefix_values.dtype), prefix_values).float()  # [Hkv, B·G·T, D]

        def unfold(t):  # [Hkv, B·G·T, X] -> [B, Hkv, G, T, X]
            return t.view(kv_heads, batch, groups, steps, -1).permute(1, 0, 2, 3, 4)

        m_p, l_p, o_p = unfold(m_p), unfold(l_p), unfold(o_p)
        m = torch.maximum(m_p, m_s)
        a, b = torch.exp(m_p - m), torch.exp(m_s - m)  # b is 0 where the suffix is fully masked
        out = (o_p * a + o_s * b) / (l_p * a + l_s * b)
    out = out.reshape(batch, q_heads, steps, dim)  # [B, Hq, T, D]
    return out.transpose(1, 2).to(query.dtype)  # [B, T, Hq, D]


class SharedPrefixCache:
    """A batch's KV: the prefix once per layer (shared by every request) and a suffix per request.

    prefix keys/values `[L, H, p, D]` (or None); the suffix buffers are `[L, B, H, capacity, D]`, written in place.
    Column c of a request holds its token c of the left-padded prompt, then its generated tokens; `valid[b, c]`
    is False at padding and at columns not written yet. Every step attends over all `capacity` columns (masked),
    and the next column to write lives on the device (`column`), so a decode step has fixed shapes and reads no
    host state: it can be captured as a CUDA graph and replayed.

    A step: `begin(valid_new)` (writes the new columns' flags, builds the mask; advances nothing), the model's
    forward (each layer calls `attend`), then `advance(T)` outside any captured region.
    """

    def __init__(
        self,
        prefix_keys: torch.Tensor | None,
        prefix_values: torch.Tensor | None,
        batch_size: int,
        capacity: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values
        shape = (num_layers, batch_size, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views, taken once: indexing the buffers in every layer of every step costs host time
        self._layer_keys, self._layer_values = self.keys.unbind(0), self.values.unbind(0)  # [B, H, capacity, D]
        self._prefix_keys = None if prefix_keys is None else prefix_keys.unbind(0)  # [H, p, D]
        self._prefix_values = None if prefix_values is None else prefix_values.unbind(0)
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # next column to write, [1]
        self.length = 0  # host copy of `column`, for bounds checks
        self._all_columns = torch.arange(capacity, device=device)
        self._new_columns: torch.Tensor | None = None  # [T] during a step
        self._blocked: torch.Tensor | None = None  # [B, 1, 1, T, capacity] during a step
        self.mask: torch.Tensor | None = None  # [B, 1, T, capacity] during a step

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def prefix_length(self) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[2]

    def memory_bytes(self) -> int:
        """Bytes of KV held: the prefix once plus every request's suffix buffer."""
        prefix = 0 if self.prefix_keys is None else 2 * self.prefix_keys.numel() * self.prefix_keys.element_size()
        return prefix + 2 * self.keys.numel() * self.keys.element_size()

    def reset(self) -> None:
        """Empty the suffix for a new batch of the same shape (stale keys stay, masked: no memset)."""
        self.valid.zero_()
        self.column.zero_()
        self.length = 0

    def begin(self, valid_new: torch.Tensor) -> torch.Tensor:
        """Open a step of T new columns (`valid_new` `[B, T]`); returns the mask `[B, 1, T, capacity]`."""
        steps = valid_new.shape[1]
        if self.length + steps > self.capacity:
            raise ServeError(f"the batch needs more than its {self.capacity} preallocated positions")
        cols = self.column + torch.arange(steps, device=self.column.device)  # [T]
        self.valid.index_copy_(1, cols, valid_new)
        causal = self._all_columns[None, :] <= cols[:, None]  # [T, capacity]
        self.mask = causal[None, None] & self.valid[:, None, None, :]  # [B, 1, T, capacity]
        self._blocked = ~self.mask[:, :, None]
        self._new_columns = cols
        return self.mask

    def advance(self, steps: int) -> None:
        """Close a step of `steps` columns (not part of a captured step: replays must not move the counter)."""
        self.column += steps
        self.length += steps

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """Write this step's key/value `[B, H, T, D]` for `layer`, then attend to the prefix and the suffix."""
        keys, values = self._layer_keys[layer], self._layer_values[layer]  # [B, H, capacity, D]
        keys.index_copy_(2, self._new_columns, key)
        values.index_copy_(2, self._new_columns, value)
        prefix_k = None if self._prefix_keys is None else self._prefix_keys[layer]
        prefix_v = None if self._prefix_values is None else self._prefix_values[layer]
        return _cascade(query, prefix_k, prefix_v, keys, values, self._blocked, scaling)


def _attention_function(original: str) -> Callable:
    """The registered attention: cascade attention when the forward carries a `SharedPrefixCache`, else the
    model's original implementation (so the model keeps working for everything else)."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, shared_prefix=None, **kw):
        if shared_prefix is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return shared_prefix.attend(module.layer_idx, query, key, value, scale), None
        from transformers import AttentionInterface

        interface = AttentionInterface()
        if original in interface:
            fn = interface[original]
        else:  # eager lives in the model's own file
            fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if fn is None:
                raise ServeError(f"cannot find the {original!r} attention of {type(module).__name__}")
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)

    return attention


def enable_shared_prefix(model) -> None:
    """Route `model`'s attention through cascade attention when a forward passes `shared_prefix=<cache>`.

    Registers `cartridges_cascade_<original>` with transformers' attention and mask interfaces (the mask
    function stays the original's) and switches the model's config to it. Calls without `shared_prefix` behave
    exactly as before. Idempotent.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = model.config
    current = config._attn_implementation or "eager"
    if current.startswith(ATTENTION_NAME_PREFIX):
        return
    if config.model_type not in SHARED_PREFIX_MODEL_TYPES or getattr(config, "sliding_window", None):
        raise ServeError(f"shared-prefix attention supports {SHARED_PREFIX_MODEL_TYPES} without sliding windows")
    name = ATTENTION_NAME_PREFIX + current
    AttentionInterface.register(name, _attention_function(current))
    if current in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    config._attn_implementation = name


def supports_shared_prefix(model) -> bool:
    config = model.config
    return config.model_type in SHARED_PREFIX_MODEL_TYPES and not getattr(config, "sliding_window", None)


# --------------------------------------------------------------------------------------------------------------
# Cartridges on disk and in memory


@dataclass
class _Entry:
    cartridge: Any
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values [L, H, p, D] in the serving dtype
    nbytes: int = 0


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CartridgeStore:
    """Cartridge files of one directory, loaded on first use and kept in an LRU bounded by bytes.

    An id names `<dir>/<id>.safetensors` or `<dir>/<id>/cartridge.safetensors` (the output of
    `cartridges-distill`). A composition (several ids) is built once with the first cartridge's `concat` and
    cached under the tuple of ids. The bytes of an entry are the cartridge's `memory_bytes()` plus the
    serving-dtype copy of its keys and values that the shared-prefix path prepares.
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
        self._entries: OrderedDict[tuple[str, ...], _Entry] = OrderedDict()
        self._lock = threading.RLock()

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def cached_ids(self) -> list[tuple[str, ...]]:
        with self._lock:
            return list(self._entries)

    def check(self, cartridge_id: str) -> None:
        """Raise as `path` does for an id that cannot be served; a loaded id passes without touching the disk
        (a batch of thousands of requests would otherwise stat the file thousands of times)."""
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
        """Every servable id with its file size and, from the file header only, its kind and token count."""
        found = {}
        for path in sorted(self.directory.glob(f"*{FILE_SUFFIX}")):
            found.setdefault(path.name[: -len(FILE_SUFFIX)], path)
        for path in sorted(self.directory.glob(f"*/cartridge{FILE_SUFFIX}")):
            found.setdefault(path.parent.name, path)
        out = []
        loaded = {ids[0] for ids in self.cached_ids() if len(ids) == 1}
        for cid, path in sorted(found.items()):
            if not CARTRIDGE_ID.fullmatch(cid) or not path.resolve().is_relative_to(self.root):
                continue
            meta = _read_metadata(path)
            out.append(
                {
                    "id": cid,
                    "object": "cartridge",
                    "kind": meta.get("kind", "kv"),
                    "num_tokens": meta.get("num_tokens"),
                    "file_bytes": path.stat().st_size,
                    "loaded": cid in loaded,
                }
            )
        return out

    def get(self, ids: Sequence[str]) -> _Entry | None:
        """The entry for a cartridge or a composition (None for no cartridge), loading what is missing."""
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
                cartridge = type(parts[0]).concat(parts)
            entry = _Entry(cartridge)
            entry.nbytes = cartridge.memory_bytes()
            self._entries[key] = entry
            self._evict(keep=key)
            return entry

    def prefix(self, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
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
        from cartridges.cache import CartridgeError, load_cartridge

        path = self.path(cartridge_id)
        try:
            cartridge = load_cartridge(path, self.model)
        except CartridgeError as e:
            raise ServeError(f"cartridge {cartridge_id!r} cannot be used: {str(e).splitlines()[0]}") from None
        cartridge.requires_grad_(False)
        self.loads += 1
        log.info("loaded cartridge %s (%d tokens) from %s", cartridge_id, cartridge.num_tokens, path)
        return cartridge

    def _evict(self, keep) -> None:
        while len(self._entries) > 1 and sum(e.nbytes for e in self._entries.values()) > self.max_bytes:
            oldest = next(k for k in self._entries if k != keep)
            log.info("evicting cartridge %s from the cache", "+".join(oldest))
            del self._entries[oldest]


def _read_metadata(path: Path) -> dict[str, Any]:
    """The cartridge metadata from a safetensors header, without reading or checking the tensors."""
    from cartridges.cache import METADATA_KEY

    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                return {}
            header = json.loads(f.read(size))
        return json.loads(header["__metadata__"][METADATA_KEY])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return {}


# --------------------------------------------------------------------------------------------------------------
# The Python API


@dataclass
class GenerationRequest:
    """One completion. `prompt` is text (needs the server's tokenizer) or token ids; `messages` (chat) is
    rendered with the tokenizer's chat template, after the cartridge as the documents of self-study were."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    cartridges: Sequence[str] = ()
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop: Sequence[str] = ()
    seed: int | None = None
    ignore_eos: bool = False


@dataclass
class Completion:
    token_ids: list[int]  # generated, without the end-of-sequence token
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    prompt_tokens: int
    cartridge_tokens: int = 0


@dataclass
class _Prepared:
    request: GenerationRequest
    prompt_ids: list[int]
    key: tuple[str, ...]
    stream: bool = False  # text deltas wanted as tokens arrive


# on_event(index, text_delta, completion_or_None): called as tokens arrive; the completion when one finishes
EventCallback = Callable[[int, str, Completion | None], None]


class _Row:
    """Decoding state of one request: its tokens, stop handling and the text already streamed."""

    def __init__(self, prepared: _Prepared, tokenizer, eos_ids: set[int], streaming: bool, prefix_tokens: int):
        self.req, self.prompt_ids = prepared.request, prepared.prompt_ids
        self.tokenizer, self.eos_ids, self.streaming = tokenizer, eos_ids, streaming
        self.prefix_tokens = prefix_tokens
        self.ids: list[int] = []
        self.text, self.sent = "", ""
        self.finish: str | None = None
        self.generator: torch.Generator | None = None
        # text is decoded after every token only for streaming and stop strings; otherwise once, at the end
        self.needs_text = tokenizer is not None and (streaming or bool(self.req.stop))

    def extend(self, tokens: list[int]) -> str:
        """Take several generated tokens in order; the same outcome as `push` of each, faster without text."""
        if self.needs_text:
            return "".join([self.push(t) for t in tokens])
        if self.finish is not None:
            return ""
        room = self.req.max_tokens - len(self.ids)
        if not self.req.ignore_eos and self.eos_ids:
            stop_at = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
            if stop_at is not None and stop_at < room:
                self.ids.extend(tokens[:stop_at])
                self.finish = "stop"
                return self._flush()
        self.ids.extend(tokens[:room])
        if len(self.ids) >= self.req.max_tokens:
            self.finish = "length"
            return self._flush()
        return ""

    def push(self, token: int) -> str:
        """Take one generated token; returns the text that may be streamed now."""
        if self.finish is not None:
            return ""
        if token in self.eos_ids and not self.req.ignore_eos:
            self.finish = "stop"
            return self._flush()
        self.ids.append(token)
        needs_text = self.needs_text
        if needs_text:
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            cut = min((i for i in (self.text.find(s) for s in self.req.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish = "stop"
                return self._flush(decode=False)
        if len(self.ids) >= self.req.max_tokens:
            self.finish = "length"
            return self._flush()
        if not self.streaming or not needs_text:
            return ""
        # hold back a possible start of a stop string and an incomplete UTF-8 character
        safe = self.text[: len(self.text) - _stop_overlap(self.text, self.req.stop)].rstrip("\ufffd")
        if not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def _flush(self, decode: bool = True) -> str:
        if decode and self.tokenizer is not None:
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = self.text[len(self.sent) :] if self.text.startswith(self.sent) else ""
        self.sent = self.text
        return delta

    def completion(self) -> Completion:
        return Completion(list(self.ids), self.text, self.finish or "length", len(self.prompt_ids), self.prefix_tokens)


def _stop_overlap(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins one of `stops`."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _sample(logits: torch.Tensor, rows: list[_Row], greedy: bool) -> torch.Tensor:
    """Next token per row `[B]` from logits `[B, V]`: argmax at temperature 0, else nucleus sampling.
    `greedy`: every row has temperature 0 (checked once per batch, not per step)."""
    tokens = logits.argmax(-1)
    if greedy:
        return tokens
    for b, row in enumerate(rows):
        if row.req.temperature <= 0 or row.finish is not None:
            continue
        probs = torch.softmax(logits[b].float() / row.req.temperature, -1)
        if row.req.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (the most likely token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= row.req.top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        tokens[b] = torch.multinomial(probs, 1, generator=row.generator)[0]
    return tokens


# Host syncs in the decode loop: with no row that streams, samples or has stop strings, the generated tokens are
# read back every SYNC_EVERY steps (one `.tolist()` of a [B, k] block), so the host queues steps ahead of the
# device; a batch whose rows all stop early decodes at most SYNC_EVERY - 1 extra steps.
SYNC_EVERY = 8
# Suffix capacities are rounded up to this many columns, so batches of similar lengths reuse a captured graph.
CAPACITY_QUANTUM = 16


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


class _GraphCheckError(RuntimeError):
    """A captured decode step disagreed with the same step run eagerly."""


class _SharedDecoder:
    """Decoding over a SharedPrefixCache with fixed shapes: static input buffers (`tokens`, `positions`) and one
    step function, `_step`, run eagerly or captured once as a CUDA graph and replayed.

    `_step` reads only device buffers (the cache, `tokens`, `positions`) and advances no counter; `step` fills
    the inputs, runs it (eagerly or by replay), then advances the cache column and the positions.
    """

    def __init__(self, model, cache: SharedPrefixCache, batch_size: int, device: torch.device):
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # [B, 1]
        self.positions = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # [B, 1]
        self.ones = torch.ones(batch_size, 1, dtype=torch.bool, device=device)  # [B, 1]
        self.graph = None  # torch.cuda.CUDAGraph once captured
        self.logits: torch.Tensor | None = None  # the graph's output buffer [B, V]
        self.use_graph = False  # capture at the first decode step
        self.graph_required = False  # a failed capture raises instead of falling back to eager steps
        self.captured = False  # a capture happened since the server last looked
        self.capture_error: Exception | None = None

    def _forward(self, ids, positions, valid) -> torch.Tensor:
        mask = self.cache.begin(valid)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,  # 4D: transformers passes it through untouched
            shared_prefix=self.cache,
            use_cache=False,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()  # [B, V]

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Run the left-padded prompts `ids` `[B, W]` (`valid` False at padding); logits of each last token."""
        cache = self.cache
        cache.reset()
        p = cache.prefix_length
        positions = p + (valid.cumsum(1) - 1).clamp_min(0)  # [B, W]
        logits = self._forward(ids, positions, valid)
        cache.advance(ids.shape[1])
        self.positions.copy_(p + valid.sum(1, keepdim=True))  # [B, 1]: the first generated token's position
        return logits

    def _step(self) -> torch.Tensor:
        return self._forward(self.tokens, self.positions, self.ones)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed `tokens` `[B]`; logits of the next token `[B, V]` (the graph's buffer when captured: read it before
        the next step)."""
        if self.cache.length + 1 > self.cache.capacity:
            raise ServeError(f"the batch needs more than its {self.cache.capacity} preallocated positions")
        self.tokens.copy_(tokens[:, None])
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        elif self.use_graph:
            self.use_graph = False
            try:
                logits = self.capture()
                self.captured = True
            except Exception as e:
                # out of memory is the batch's problem, not the graph's: it must not turn graphs off for good
                if self.graph_required or isinstance(e, torch.OutOfMemoryError):
                    raise
                log.warning("CUDA graph capture failed, decoding eagerly from now on: %s", str(e).splitlines()[0])
                self.capture_error = e
                logits = self._step()
        else:
            logits = self._step()
        self.cache.advance(1)
        self.positions += 1
        return logits

    def capture(self) -> torch.Tensor:
        """Capture `_step` as a CUDA graph at the current state; returns this step's logits (from a replay).

        The step is first run eagerly on a side stream (the warm-up that capture needs); a replay then computes
        the same step again and must agree with it, else `_GraphCheckError`. Neither moves a counter, so the
        cache ends as one eager step would leave it.
        """
        device = self.tokens.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            eager = self._step().clone()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._step()
        graph.replay()
        # the same kernels on the same inputs: equal up to library-level nondeterminism
        tolerance = 1e-3 * float(eager.abs().max()) + 1e-5
        diff = float((logits - eager).abs().max())
        if not diff <= tolerance:
            raise _GraphCheckError(f"the replayed decode step differs from eager by {diff:.3g} (> {tolerance:.3g})")
        self.graph, self.logits = graph, logits
        return logits


class _PlainDecoder:
    """Decoding over the cartridge's own cache (`as_cache`) and the model's attention: prompts of equal length,
    no padding; shapes grow every step, so it is never captured."""

    def __init__(self, model, cache, extra: dict):
        from cartridges.cache import cache_kwargs

        self.model, self.cache, self.extra = model, cache, extra
        self._kwargs = cache_kwargs

    def _forward(self, ids) -> torch.Tensor:
        kwargs = {} if self.cache is None else self._kwargs(self.model, self.cache)
        out = self.model(input_ids=ids, use_cache=True, **kwargs, **self.extra)
        if self.cache is None:
            self.cache = out["cache"] if "cache" in out else out["past_key_values"]
        return out.logits[:, -1].float()  # [B, V]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(ids)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens[:, None])


class Server:
    """Batched generation from cartridges with a frozen causal LM.

    model: a transformers causal LM (frozen); cartridge_dir: where cartridge files live; tokenizer: needed for
    text prompts, chat messages and stop strings. shared_prefix: None picks the shared-prefix path when the model
    supports it (Llama family), False forces the plain `as_cache` path. max_cache_bytes bounds the LRU of
    loaded cartridges; max_batch_size bounds one forward.

    cuda_graphs: on the shared-prefix path, capture the decode step of a batch as a CUDA graph and replay it
    (one launch per token instead of a few thousand). None (default) turns it on for CUDA models: a capture
    that fails, or whose replay disagrees with the eager step, then logs a warning and the server decodes
    eagerly from there on. True insists (raises instead; needs CUDA); False never captures. The last
    `max_graphs` captured decoders (their suffix buffers and graphs) are kept for batches of the same size and
    capacity; `release()` frees them.

    `stats` counts batches, requests and graph captures / failures; `last_cache` is the SharedPrefixCache of the
    latest shared-prefix batch (for inspection and benchmarks).
    """

    def __init__(
        self,
        model,
        cartridge_dir,
        tokenizer=None,
        *,
        max_cache_bytes: int = 4 << 30,
        max_batch_size: int = 256,
        shared_prefix: bool | None = None,
        cuda_graphs: bool | None = None,
        max_graphs: int = 1,
    ):
        import inspect

        if max_batch_size < 1:
            raise ServeError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = model.dtype
        self.store = CartridgeStore(cartridge_dir, model, max_bytes=max_cache_bytes, dtype=self.dtype)
        self.max_batch_size = max_batch_size
        if shared_prefix is None:
            shared_prefix = supports_shared_prefix(model)
        if shared_prefix:
            enable_shared_prefix(model)
        self.shared_prefix = bool(shared_prefix)
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else None
        self.config = config or model.config
        self.max_positions = getattr(self.config, "max_position_embeddings", None)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self._lock = threading.Lock()  # one batch at a time on the model
        if cuda_graphs and self.device.type != "cuda":
            raise ServeError(f"cuda_graphs=True needs a model on a CUDA device, not {self.device}")
        # captured decoding exists on the shared-prefix path only (the plain path's caches grow every step)
        self.cuda_graphs = bool(
            self.shared_prefix and (self.device.type == "cuda" if cuda_graphs is None else cuda_graphs)
        )
        self._graphs_required = bool(cuda_graphs)
        self.max_graphs = max_graphs
        self._decoders: OrderedDict[tuple, _SharedDecoder] = OrderedDict()
        params = inspect.signature(model.forward).parameters
        self._plain_extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.stats = {
            "batches": 0,
            "requests": 0,
            "largest_batch": 0,
            "graph_captures": 0,
            "graph_replays": 0,
            "graph_failures": 0,
        }
        self.last_cache: SharedPrefixCache | None = None

    def release(self) -> None:
        """Drop the kept decoders (suffix buffers and captured graphs)."""
        self._decoders.clear()
        self.last_cache = None

    # ---- requests

    def prepare(self, request: GenerationRequest) -> _Prepared:
        """Check a request and tokenize its prompt; raises ServeError (or CartridgeNotFound) on bad input."""
        if request.max_tokens < 1:
            raise ServeError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if request.temperature < 0 or not 0 < request.top_p <= 1:
            raise ServeError("temperature must be >= 0 and top_p in (0, 1]")
        key = tuple(request.cartridges)
        for cid in key:
            self.store.check(cid)
        if request.stop and self.tokenizer is None:
            raise ServeError("stop strings need a tokenizer")
        if request.messages is not None:
            ids = self._chat_ids(request.messages, with_cartridge=bool(key))
        elif isinstance(request.prompt, str):
            if self.tokenizer is None:
                raise ServeError("text prompts need a tokenizer; pass token ids")
            ids = list(self.tokenizer.encode(request.prompt, add_special_tokens=not key))
        elif request.prompt is not None:
            ids = [int(t) for t in request.prompt]
        else:
            raise ServeError("a request needs a prompt or messages")
        if not ids:
            raise ServeError("the prompt is empty")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ServeError(f"prompt token ids must be in [0, {vocab})")
        if self.max_positions and len(ids) + request.max_tokens > self.max_positions:
            raise ServeError(
                f"prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the model's "
                f"{self.max_positions} positions"
            )
        return _Prepared(request, ids, key)

    def _chat_ids(self, messages, with_cartridge: bool) -> list[int]:
        from cartridges.corpus import CorpusError, render, turn_ids

        if self.tokenizer is None:
            raise ServeError("chat messages need a tokenizer")
        try:
            if with_cartridge:
                # the cartridge stands where the document's system message stood in self-study
                return turn_ids(self.tokenizer, messages, add_generation_prompt=True)
            return render(self.tokenizer, messages, add_generation_prompt=True)
        except (CorpusError, ValueError, TypeError, KeyError) as e:
            raise ServeError(f"cannot render the messages with the chat template: {e}") from None

    # ---- generation

    def generate(
        self,
        requests: Sequence[GenerationRequest | _Prepared],
        on_event: EventCallback | None = None,
        return_exceptions: bool = False,
    ) -> list[Completion | Exception]:
        """Completions for `requests`, in order. Requests with the same cartridges run as one batch (up to
        max_batch_size) over one shared copy of the cartridge.

        on_event streams text deltas; with return_exceptions a failing group yields its exception in its
        requests' places instead of raising.
        """
        results: list[Completion | Exception | None] = [None] * len(requests)
        prepared = []
        for i, r in enumerate(requests):
            try:
                prepared.append((i, r if isinstance(r, _Prepared) else self.prepare(r)))
            except ServeError as e:
                if not return_exceptions:
                    raise
                results[i] = e
        for batch in self._plan(prepared):
            try:
                with self._lock:
                    done = self._run_batch([p for _, p in batch], on_event, [i for i, _ in batch])
                for (i, _), c in zip(batch, done):
                    results[i] = c
            except Exception as e:
                if not return_exceptions:
                    raise
                if isinstance(e, torch.OutOfMemoryError):
                    torch.cuda.empty_cache()
                log.warning("a batch of %d requests failed: %s", len(batch), e)
                for i, _ in batch:
                    results[i] = e
        return results

    def _plan(self, prepared: list[tuple[int, _Prepared]]) -> list[list[tuple[int, _Prepared]]]:
        groups: dict[tuple, list] = {}
        for i, p in prepared:
            # the plain path pads nothing: its batches hold prompts of one length
            key = (p.key, None if self.shared_prefix else len(p.prompt_ids))
            groups.setdefault(key, []).append((i, p))
        out = []
        for members in groups.values():
            for start in range(0, len(members), self.max_batch_size):
                out.append(members[start : start + self.max_batch_size])
        return out

    @torch.no_grad()
    def _run_batch(self, batch: list[_Prepared], on_event, indices: list[int]) -> list[Completion]:
        entry = self.store.get(batch[0].key)
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
        shared = self.shared_prefix and (entry is None or callable(getattr(entry.cartridge, "keys", None)))
        prefix_tokens = 0 if entry is None else entry.cartridge.num_tokens
        rows = [_Row(p, self.tokenizer, self.eos_ids, on_event is not None and p.stream, prefix_tokens) for p in batch]
        for row in rows:
            if row.req.seed is not None:
                row.generator = torch.Generator(device=self.device).manual_seed(row.req.seed)
        steps = max(r.req.max_tokens for r in rows)
        greedy = all(r.req.temperature <= 0 for r in rows)
        # rows that stream, stop on strings or sample need each token on the host before the next step
        per_token = not greedy or any(r.streaming or r.req.stop for r in rows)
        interval = 1 if per_token else SYNC_EVERY
        try:
            decoder, logits = self._start(entry, batch, steps, shared)
            pending: list[torch.Tensor] = []  # sampled tokens [B] not yet read back
            for step in range(steps):
                tokens = _sample(logits, rows, greedy)
                pending.append(tokens)
                last = step == steps - 1
                if len(pending) == interval or last:
                    block = torch.stack(pending, 1).tolist()  # [B, k]: the one host sync of these k steps
                    pending = []
                    for b, (row, new) in enumerate(zip(rows, block)):
                        if row.finish is not None:
                            continue
                        delta = row.extend(new)
                        if on_event is not None and (delta or row.finish is not None):
                            on_event(indices[b], delta, row.completion() if row.finish is not None else None)
                    if all(r.finish is not None for r in rows):
                        break
                if last:
                    break
                logits = decoder.step(tokens)
                if isinstance(decoder, _SharedDecoder) and decoder.graph is not None:
                    self.stats["graph_replays"] += 1
        except BaseException:
            self._decoders.clear()  # a failed batch (OOM included) keeps no buffers or graphs alive
            raise
        if isinstance(decoder, _SharedDecoder):
            self._note_capture(decoder)
        return [r.completion() for r in rows]

    def _note_capture(self, decoder: _SharedDecoder) -> None:
        if decoder.captured:
            self.stats["graph_captures"] += 1
            decoder.captured = False
        if decoder.capture_error is not None:
            self.stats["graph_failures"] += 1
            self.cuda_graphs = False
            self._decoders.clear()

    def _start(self, entry, batch: list[_Prepared], steps: int, shared: bool):
        """A decoder for the batch and the logits `[B, V]` after its prompts (left-padded on the shared path)."""
        if not shared:
            # the plain path's batches hold prompts of one length (see `_plan`): no padding
            ids = torch.tensor([x.prompt_ids for x in batch], dtype=torch.long, device=self.device)
            cache = (
                None
                if entry is None
                else entry.cartridge.as_cache(len(batch), dtype=self.dtype, config=self.model.config)
            )
            decoder = _PlainDecoder(self.model, cache, self._plain_extra)
            return decoder, decoder.prefill(ids)
        prefix = None if entry is None else self.store.prefix(entry)
        ids, mask = left_pad([x.prompt_ids for x in batch], self.pad_id)
        size, width = ids.shape
        valid = mask.bool()  # [B, W]
        decoder = self._shared_decoder(prefix, size, _round_up(width + steps, CAPACITY_QUANTUM))
        self.last_cache = decoder.cache
        return decoder, decoder.prefill(ids.to(self.device), valid.to(self.device))

    def _shared_decoder(self, prefix, batch_size: int, capacity: int) -> _SharedDecoder:
        """A decoder with suffix room for `capacity` columns: a kept one of this shape when graphs are on."""
        prefix_keys = None if prefix is None else prefix[0]
        key = (None if prefix_keys is None else prefix_keys.data_ptr(), batch_size, capacity)
        if self.cuda_graphs:
            kept = self._decoders.get(key)
            if kept is not None and kept.cache.prefix_keys is prefix_keys:
                self._decoders.move_to_end(key)
                return kept
            while self._decoders and len(self._decoders) >= self.max_graphs:
                self._decoders.popitem(last=False)  # free the old buffers before allocating new ones
        cache = SharedPrefixCache(
            prefix_keys,
            None if prefix is None else prefix[1],
            batch_size,
            capacity,
            self.config.num_hidden_layers,
            *_kv_shape(self.config),
            dtype=self.dtype,
            device=self.device,
        )
        decoder = _SharedDecoder(self.model, cache, batch_size, self.device)
        decoder.use_graph, decoder.graph_required = self.cuda_graphs, self._graphs_required
        if self.cuda_graphs and self.max_graphs > 0:
            self._decoders[key] = decoder
        return decoder


def _kv_shape(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or heads, getattr(config, "head_dim", None) or (
        config.hidden_size // heads
    )


def _eos_ids(model, tokenizer) -> set[int]:
    out = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            out.add(value)
        elif isinstance(value, (list, tuple)):
            out.update(int(v) for v in value)
    return out


# --------------------------------------------------------------------------------------------------------------
# The HTTP server


class _Batcher:
    """Requests wait in an asyncio queue; one worker drains it, groups by cartridges and runs the batch in a
    thread, so the event loop keeps accepting requests (which join the next batch) while the model works."""

    def __init__(self, server: Server, window_s: float = 0.005, max_pending: int = 4096):
        self.server, self.window_s, self.max_pending = server, window_s, max_pending
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._work())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass

    def submit(self, prepared: _Prepared) -> asyncio.Queue:
        """Queue a request; events ("delta", text), ("done", Completion) or ("error", exception) arrive on the
        returned queue."""
        events: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait((prepared, events))
        return events

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            await asyncio.sleep(self.window_s)
            while not self.queue.empty() and len(items) < self.max_pending:
                items.append(self.queue.get_nowait())

            def on_event(i, delta, completion, items=items):
                if delta:
                    loop.call_soon_threadsafe(items[i][1].put_nowait, ("delta", delta))

            try:
                results = await asyncio.to_thread(
                    self.server.generate, [p for p, _ in items], on_event, return_exceptions=True
                )
            except Exception as e:  # a failure outside any batch: answer everyone, keep serving
                results = [e] * len(items)
            for (_, events), result in zip(items, results):
                events.put_nowait(("error", result) if isinstance(result, Exception) else ("done", result))


def _schemas():
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class CartridgeRef(Strict):
        id: str

    class StreamOptions(Strict):
        include_usage: bool = False

    class Common(Strict):
        model: str | None = None
        cartridges: list[CartridgeRef] = Field(default_factory=list, max_length=16)
        max_tokens: int | None = Field(None, ge=1)
        temperature: float = Field(1.0, ge=0.0, le=2.0)
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        n: Literal[1] = 1
        stop: str | list[str] | None = Field(None)
        seed: int | None = None
        stream: bool = False
        stream_options: StreamOptions | None = None
        user: str | None = None
        presence_penalty: Literal[0] = 0
        frequency_penalty: Literal[0] = 0
        logprobs: Literal[False] | None = None
        ignore_eos: bool = False  # extensions: decode exactly max_tokens, and return the generated ids
        return_token_ids: bool = False

    class TextPart(Strict):
        type: Literal["text"]
        text: str

    class Message(Strict):
        role: Literal["system", "user", "assistant"]
        content: str | list[TextPart]
        name: str | None = None

    class Chat(Common):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)

    class Text(Common):
        prompt: str | list[int] | list[str] | list[list[int]]
        echo: Literal[False] = False

    return Chat, Text


def build_app(
    server: Server,
    model_name: str,
    *,
    max_body_bytes: int = 1 << 20,
    max_tokens_limit: int = 2048,
    default_max_tokens: int = 256,
    batch_window_s: float = 0.005,
):
    """The FastAPI app serving `server` under the OpenAI API names, with `model_name` as the model id."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import ValidationError

    Chat, Text = _schemas()
    batcher = _Batcher(server, window_s=batch_window_s)

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="cartridges-serve", lifespan=lifespan)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    class HTTPError(Exception):
        def __init__(self, status, message, kind="invalid_request_error"):
            super().__init__(message)
            self.status, self.kind = status, kind

    @app.exception_handler(HTTPError)
    async def _http_error(request, exc: HTTPError):
        return error(exc.status, str(exc), exc.kind)

    @app.exception_handler(ServeError)
    async def _serve_error(request, exc: ServeError):
        return error(exc.status, str(exc), exc.kind)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("internal error")
        return error(500, f"internal error: {type(exc).__name__}", "server_error")

    async def read_json(request: Request, schema):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise HTTPError(413, f"request body over {max_body_bytes} bytes", "request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise HTTPError(413, f"request body over {max_body_bytes} bytes", "request_too_large")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "the body must be a JSON object")
        try:
            payload = schema.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "body"
            raise HTTPError(400, f"{where}: {first['msg']} ({e.error_count()} problem(s))") from None
        if payload.model is not None and payload.model != model_name:
            raise HTTPError(
                404, f"model {payload.model!r} not found (this server has {model_name!r})", "not_found_error"
            )
        return payload

    def to_request(payload, max_tokens, **prompt) -> _Prepared:
        if max_tokens > max_tokens_limit:
            raise HTTPError(400, f"max_tokens must be <= {max_tokens_limit}")
        stop = [payload.stop] if isinstance(payload.stop, str) else list(payload.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise HTTPError(400, "stop takes at most 4 non-empty strings")
        request = GenerationRequest(
            cartridges=[c.id for c in payload.cartridges],
            max_tokens=max_tokens,
            temperature=payload.temperature,
            top_p=payload.top_p,
            stop=stop,
            seed=payload.seed,
            ignore_eos=payload.ignore_eos,
            **prompt,
        )
        prepared = server.prepare(request)
        prepared.stream = payload.stream
        return prepared

    async def respond(payload, prepared: _Prepared, kind: str):
        events = batcher.submit(prepared)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def usage(c: Completion) -> dict:
            total = c.prompt_tokens + len(c.token_ids)
            return {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids), "total_tokens": total}

        def choice(text: str, finish, c: Completion | None, stream: bool) -> dict:
            out: dict[str, Any] = {"index": 0}
            if kind == "chat":
                out["delta" if stream else "message"] = (
                    ({"content": text} if text else {}) if stream else {"role": "assistant", "content": text}
                )
            else:
                out["text"] = text
                out["logprobs"] = None
            out["finish_reason"] = finish
            if c is not None and payload.return_token_ids:
                out["token_ids"] = c.token_ids
            return out

        if not payload.stream:
            tag, value = await events.get()
            while tag == "delta":
                tag, value = await events.get()
            if tag == "error":
                raise value
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model_name,
                "choices": [choice(value.text, value.finish_reason, value, False)],
                "usage": usage(value),
            }

        def chunk(choices, extra=None) -> str:
            data = {"id": rid, "object": obj + ("" if kind == "text" else ".chunk"), "created": created}
            data.update({"model": model_name, "choices": choices, **(extra or {})})
            return f"data: {json.dumps(data)}\n\n"

        async def stream():
            if kind == "chat":
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            while True:
                tag, value = await events.get()
                if tag == "delta":
                    yield chunk([choice(value, None, None, True)])
                elif tag == "error":
                    status = value.status if isinstance(value, ServeError) else 500
                    message = str(value) if isinstance(value, ServeError) else f"internal error: {type(value).__name__}"
                    yield f"data: {json.dumps({'error': {'message': message, 'code': status}})}\n\n"
                    break
                else:
                    # the text arrived as deltas; the last chunk carries the finish reason
                    yield chunk([choice("", value.finish_reason, value, True)])
                    if payload.stream_options is not None and payload.stream_options.include_usage:
                        yield chunk([], {"usage": usage(value)})
                    break
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        payload = await read_json(request, Chat)
        messages = [
            {
                "role": m.role,
                "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
            }
            for m in payload.messages
        ]
        max_tokens = payload.max_completion_tokens or payload.max_tokens or default_max_tokens
        return await respond(payload, to_request(payload, max_tokens, messages=messages), "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        payload = await read_json(request, Text)
        prompt = payload.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise HTTPError(400, "prompt: one prompt per request (batch by sending concurrent requests)")
            prompt = prompt[0]
        return await respond(payload, to_request(payload, payload.max_tokens or 16, prompt=prompt), "text")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "zoo"}]}

    @app.get("/v1/cartridges")
    async def cartridges():
        return {"object": "list", "data": await asyncio.to_thread(server.store.available)}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "cached_cartridge_bytes": server.store.cached_bytes}

    return app


USAGE_EPILOG = """examples:
  cartridges-serve --model smollm2-135m-instruct --cartridges runs/serve_cartridges --port 8000
  curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Hi"}], "cartridges": [{"id": "quellmere"}]}'"""


def main(argv: list[str] | None = None) -> None:
    from zoo.cli import version_line

    parser = argparse.ArgumentParser(
        prog="cartridges-serve",
        description="Serve cartridges over an OpenAI-compatible HTTP API.",
        epilog=USAGE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="known name (smollm2-135m-instruct), .gguf, HF dir, tiny-llama")
    parser.add_argument(
        "--cartridges", required=True, help="directory of <id>.safetensors or <id>/cartridge.safetensors"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"], help="auto: bf16 on CUDA")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA (default: graphs)")
    parser.add_argument("--cache-bytes", type=int, default=4 << 30, help="LRU budget of loaded cartridges")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-tokens-limit", type=int, default=2048)
    parser.add_argument("--served-name", default="", help="model id in the API (default: --model)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: the cores available)")
    parser.add_argument("--version", action="version", version=version_line("cartridges-serve"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        import uvicorn

        from zoo.device import resolve_device, set_threads
        from zoo.pretrained import load_model, parse_dtype

        if not Path(args.cartridges).is_dir():
            raise ServeError(f"--cartridges {args.cartridges} is not a directory")
        set_threads(args.threads)
        device = resolve_device(args.device)
        bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
        model, tokenizer = load_model(args.model, dtype=parse_dtype("bf16" if bf16 else "fp32"), device=device)
        server = Server(
            model,
            args.cartridges,
            tokenizer,
            max_cache_bytes=args.cache_bytes,
            max_batch_size=args.max_batch_size,
            cuda_graphs=False if args.no_cuda_graphs else None,
        )
    except (ValueError, ImportError) as e:
        print(f"cartridges-serve: error: {str(e).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
    app = build_app(
        server,
        args.served_name or args.model,
        max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit,
    )
    log.info("serving %s with cartridges from %s on http://%s:%d", args.model, args.cartridges, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
