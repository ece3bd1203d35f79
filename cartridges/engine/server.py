"""The Server: checked requests, grouped by cartridge set into batches, each batch run as a `BatchRun`.

`Server(model, cartridge_dir).generate(requests)` groups requests by the cartridges they use and runs each group
as one batch. A cartridge is loaded once (`cartridges.engine.store`) and kept in an LRU bounded by bytes; a
request may compose several (`Cartridge.concat`). KV cartridges on Llama-family models take the shared-prefix
path (cascade attention over one copy of the cartridge, `cartridges.engine.attention`); other kinds and models
take the plain path (`cartridge.as_cache` and the model's own cache, batching only prompts of equal length).

Every request is checked alone before it joins a batch (`prepare`): field ranges, its text, its cartridges (loaded
then, so a bad file fails only the requests naming it) and its length (the prompt against `max_prompt_tokens`,
and cartridge + prompt + max_tokens against the model's positions). A batch is a generator of units (a prefill
chunk or a decode step, `BatchRun.advance`), so a scheduler can interleave batches; a cancelled request
(`Prepared.cancel`) stops at the next unit, and a batch whose requests are all gone ends there.
"""

import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from cartridges.clients import stop_ids
from cartridges.corpus import left_pad
from cartridges.engine.attention import SharedPrefixCache, enable_shared_prefix, supports_shared_prefix
from cartridges.engine.decoders import CAPACITY_QUANTUM, SYNC_EVERY, PlainDecoder, SharedDecoder, round_up
from cartridges.engine.errors import ServeError
from cartridges.engine.requests import (
    Completion,
    EventCallback,
    GenerationRequest,
    Prepared,
    Row,
    check_request,
    sample,
)
from cartridges.engine.store import CartridgeStore

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt columns per prefill forward: the unit other batches' decode steps interleave with


class BatchRun:
    """One batch from its prefill to its last token, advanced one unit (a prefill chunk or a decode step) per
    `advance()` call; `results` holds the completions once `advance` returned True."""

    def __init__(self, server: "Server", batch: list[Prepared], on_event: EventCallback | None, indices: list[int]):
        self.server, self.batch = server, batch
        self.results: list[Completion] | None = None
        self._units = server._run_batch(batch, on_event, indices)

    def advance(self) -> bool:
        """Run one unit; True once the batch is done. Raises what the batch raised (it is then over)."""
        with self.server._lock, torch.no_grad():
            try:
                next(self._units)
            except StopIteration as done:
                self.results = done.value
                return True
        return False

    def close(self) -> None:
        self._units.close()


class Server:
    """Batched generation from cartridges with a frozen causal LM.

    model: a transformers causal LM (frozen); cartridge_dir: where cartridge files live; tokenizer: needed for
    text prompts, chat messages and stop strings. shared_prefix: None picks the shared-prefix path when the model
    supports it (Llama family), False forces the plain `as_cache` path. max_cache_bytes bounds the LRU of
    loaded cartridges; max_batch_size bounds one forward. max_prompt_tokens bounds a prompt (default: the
    model's positions); prefill_chunk is the columns of one prefill forward.

    cuda_graphs: on the shared-prefix path, capture the decode step of a batch as a CUDA graph and replay it
    (one launch per token instead of a few thousand). None (default) turns it on for CUDA models: a capture
    that fails, or whose replay disagrees with the eager step, then logs a warning and the server decodes
    eagerly from there on. True insists (raises instead; needs CUDA); False never captures. The last
    `max_graphs` captured decoders (their suffix buffers and graphs) are kept for batches of the same size and
    capacity; `release()` frees them.

    `stats` counts batches, requests, cancelled requests and graph captures / failures; `last_cache` is the
    SharedPrefixCache of the latest shared-prefix batch (for inspection and benchmarks).
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
        max_prompt_tokens: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ):
        if max_batch_size < 1:
            raise ServeError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefill_chunk < 1:
            raise ServeError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = model.dtype
        self.store = CartridgeStore(cartridge_dir, model, max_bytes=max_cache_bytes, dtype=self.dtype)
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        if shared_prefix is None:
            shared_prefix = supports_shared_prefix(model)
        if shared_prefix:
            enable_shared_prefix(model)
        self.shared_prefix = bool(shared_prefix)
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else None
        self.config = config or model.config
        self.max_positions = getattr(self.config, "max_position_embeddings", None)
        self.max_prompt_tokens = max_prompt_tokens or self.max_positions
        self.eos_ids = stop_ids(tokenizer, model)
        self.pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self._lock = threading.RLock()  # one unit at a time on the model
        if cuda_graphs and self.device.type != "cuda":
            raise ServeError(f"cuda_graphs=True needs a model on a CUDA device, not {self.device}")
        # captured decoding exists on the shared-prefix path only (the plain path's caches grow every step)
        self.cuda_graphs = bool(
            self.shared_prefix and (self.device.type == "cuda" if cuda_graphs is None else cuda_graphs)
        )
        self._graphs_required = bool(cuda_graphs)
        self.max_graphs = max_graphs
        self._decoders: OrderedDict[tuple, SharedDecoder] = OrderedDict()
        params = inspect.signature(model.forward).parameters
        self._plain_extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.stats = {
            "batches": 0,
            "requests": 0,
            "largest_batch": 0,
            "graph_captures": 0,
            "graph_replays": 0,
            "graph_failures": 0,
            "cancelled": 0,  # requests stopped because their client went away
        }
        self.last_cache: SharedPrefixCache | None = None

    def release(self) -> None:
        """Drop the kept decoders (suffix buffers and captured graphs)."""
        self._decoders.clear()
        self.last_cache = None

    # ---- requests

    def prepare(self, request: GenerationRequest) -> Prepared:
        """Check a request alone and tokenize its prompt; raises ServeError (or CartridgeNotFound) on bad input.

        The request's cartridges are loaded here (a file that cannot be served fails this request only)."""
        check_request(request)
        key = tuple(request.cartridges)
        for cid in key:
            self.store.check(cid)
        entry = self.store.peek(key)
        if entry is None and key:
            with self._lock:  # loading touches the device: never during a batch's unit (a graph capture)
                entry = self.store.get(key)
        cartridge_tokens = 0 if entry is None else int(entry.cartridge.num_tokens)
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
        if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
            raise ServeError(f"the prompt has {len(ids)} tokens, more than the {self.max_prompt_tokens} allowed")
        if self.max_positions and cartridge_tokens + len(ids) + request.max_tokens > self.max_positions:
            raise ServeError(
                f"cartridges ({cartridge_tokens} tokens) + prompt ({len(ids)} tokens) + max_tokens "
                f"({request.max_tokens}) exceeds the model's {self.max_positions} positions"
            )
        return Prepared(request, ids, key, cartridge_tokens=cartridge_tokens)

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
        requests: Sequence[GenerationRequest | Prepared],
        on_event: EventCallback | None = None,
        return_exceptions: bool = False,
    ) -> list[Completion | Exception]:
        """Completions for `requests`, in order. Requests with the same cartridges run as one batch (up to
        max_batch_size) over one shared copy of the cartridge; batches run one after the other.

        on_event streams text deltas; with return_exceptions a request that fails its checks, or a failing
        group, yields its exception in its requests' places instead of raising.
        """
        results: list[Completion | Exception | None] = [None] * len(requests)
        prepared = []
        for i, r in enumerate(requests):
            try:
                prepared.append((i, r if isinstance(r, Prepared) else self.prepare(r)))
            except ServeError as e:
                if not return_exceptions:
                    raise
                results[i] = e
        for batch in self.plan(prepared):
            try:
                run = BatchRun(self, [p for _, p in batch], on_event, [i for i, _ in batch])
                while not run.advance():
                    pass
                for (i, _), c in zip(batch, run.results):
                    results[i] = c
            except Exception as e:
                if not return_exceptions:
                    raise
                self.failed(e, len(batch))
                for i, _ in batch:
                    results[i] = e
        return results

    def failed(self, error: Exception, size: int) -> None:
        """Note a failed batch of `size` requests (out of memory frees the allocator's cache)."""
        if isinstance(error, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
        log.warning("a batch of %d requests failed: %s", size, error)

    def plan(self, prepared: list[tuple[int, Prepared]]) -> list[list[tuple[int, Prepared]]]:
        """Batches of (index, request): one cartridge set each, at most max_batch_size long."""
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

    def _run_batch(self, batch: list[Prepared], on_event, indices: list[int]):
        """The units of one batch (a generator: it yields after each prefill chunk and each decode step) and, as
        its return value, the completions."""
        entry = self.store.get(batch[0].key)
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
        shared = self.shared_prefix and (entry is None or callable(getattr(entry.cartridge, "keys", None)))
        prefix_tokens = 0 if entry is None else entry.cartridge.num_tokens
        rows = [Row(p, self.tokenizer, self.eos_ids, on_event is not None and p.stream, prefix_tokens) for p in batch]
        for row in rows:
            if row.req.seed is not None:
                row.generator = torch.Generator(device=self.device).manual_seed(row.req.seed)
        steps = max(r.req.max_tokens for r in rows)
        greedy = all(r.req.temperature <= 0 for r in rows)
        # rows that stream, stop on strings or sample need each token on the host before the next step
        per_token = not greedy or any(r.streaming or r.req.stop for r in rows)
        interval = 1 if per_token else SYNC_EVERY
        decoder = None
        try:
            decoder, prefill = self._start(entry, batch, steps, shared)
            while True:
                try:
                    next(prefill)
                except StopIteration as done:
                    logits = done.value
                    break
                if _all_gone(rows):
                    return self._completions(rows)
                yield
            pending: list[torch.Tensor] = []  # sampled tokens [B] not yet read back
            for step in range(steps):
                if _all_gone(rows):
                    break
                tokens = sample(logits, rows, greedy)
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
                if isinstance(decoder, SharedDecoder) and decoder.graph is not None:
                    self.stats["graph_replays"] += 1
                yield
        except Exception:
            self._decoders.clear()  # a failed batch (OOM included) keeps no buffers or graphs alive
            raise
        finally:
            if isinstance(decoder, SharedDecoder):
                decoder.busy = False
        if isinstance(decoder, SharedDecoder):
            self._note_capture(decoder)
        return self._completions(rows)

    def _completions(self, rows: list[Row]) -> list[Completion]:
        self.stats["cancelled"] += sum(r.finish == "cancelled" for r in rows)
        return [r.completion() for r in rows]

    def _note_capture(self, decoder: SharedDecoder) -> None:
        if decoder.captured:
            self.stats["graph_captures"] += 1
            decoder.captured = False
        if decoder.capture_error is not None:
            self.stats["graph_failures"] += 1
            self.cuda_graphs = False
            self._decoders.clear()

    def _start(self, entry, batch: list[Prepared], steps: int, shared: bool):
        """A decoder for the batch and its prefill (a generator of chunks returning the logits `[B, V]` after the
        prompts, left-padded on the shared path)."""
        if not shared:
            # the plain path's batches hold prompts of one length (see `plan`): no padding
            ids = torch.tensor([x.prompt_ids for x in batch], dtype=torch.long, device=self.device)
            cache = (
                None
                if entry is None
                else entry.cartridge.as_cache(len(batch), dtype=self.dtype, config=self.model.config)
            )
            decoder = PlainDecoder(self.model, cache, self._plain_extra)
            return decoder, decoder.prefill(ids, self.prefill_chunk)
        prefix = None if entry is None else self.store.prefix(entry)
        ids, mask = left_pad([x.prompt_ids for x in batch], self.pad_id)
        size, width = ids.shape
        valid = mask.bool()  # [B, W]
        decoder = self._shared_decoder(prefix, size, round_up(width + steps, CAPACITY_QUANTUM))
        decoder.busy = True
        self.last_cache = decoder.cache
        return decoder, decoder.prefill(ids.to(self.device), valid.to(self.device), self.prefill_chunk)

    def _shared_decoder(self, prefix, batch_size: int, capacity: int) -> SharedDecoder:
        """A decoder with suffix room for `capacity` columns: a kept one of this shape when graphs are on (and no
        other running batch holds it)."""
        prefix_keys = None if prefix is None else prefix[0]
        key = (None if prefix_keys is None else prefix_keys.data_ptr(), batch_size, capacity)
        keep = self.cuda_graphs
        if keep:
            kept = self._decoders.get(key)
            if kept is not None and kept.busy:
                keep = False  # a batch of the same shape runs now: this one decodes with its own buffers
            elif kept is not None and kept.cache.prefix_keys is prefix_keys:
                self._decoders.move_to_end(key)
                return kept
            else:
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
        decoder = SharedDecoder(self.model, cache, batch_size, self.device)
        decoder.use_graph, decoder.graph_required = keep, self._graphs_required and keep
        if keep and self.max_graphs > 0:
            self._decoders[key] = decoder
        return decoder


def _all_gone(rows: list[Row]) -> bool:
    """Finish the rows whose requests were cancelled; True when no row is left to decode."""
    for row in rows:
        if row.finish is None and row.cancelled:
            row.finish = "cancelled"
    return all(row.finish is not None for row in rows)


def _kv_shape(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or heads, getattr(config, "head_dim", None) or (
        config.hidden_size // heads
    )
