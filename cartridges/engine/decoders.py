"""Decoders: the model's forward over a batch cache, for a chunked prefill and then one token per step.

Decoding without host overhead. A small model's decode step is a few thousand kernel launches, so eager PyTorch
is bound by the host, not the GPU. The shared-prefix decode step (`SharedDecoder`) therefore has fixed shapes
for a batch: it attends over the whole preallocated suffix (masked), reads the next column and the positions
from device tensors, and takes its inputs from static buffers; on CUDA it is captured once as a CUDA graph and
replayed per token. The eager and the captured path run the same step function. `PlainDecoder` runs the
cartridge's own cache (`as_cache`) through the model's attention; its shapes grow every step.

Prefill runs in chunks (generators that yield between chunks), so the engine can interleave one batch's long
prompts with other batches' decode steps.
"""

import logging

import torch

from cartridges.cache import cache_kwargs
from cartridges.engine.attention import SharedPrefixCache
from cartridges.engine.errors import ServeError
from zoo.graphs import StaticGraph

log = logging.getLogger(__name__)

# Host syncs in the decode loop: with no row that streams, samples or has stop strings, the generated tokens are
# read back every SYNC_EVERY steps (one `.tolist()` of a [B, k] block), so the host queues steps ahead of the
# device; a batch whose rows all stop early decodes at most SYNC_EVERY - 1 extra steps.
SYNC_EVERY = 8
# Suffix capacities are rounded up to this many columns, so batches of similar lengths reuse a captured graph.
CAPACITY_QUANTUM = 16


def round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


class SharedDecoder:
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
        self.graph = None  # a zoo.graphs.StaticGraph once captured
        self.logits: torch.Tensor | None = None  # the graph's output buffer [B, V]
        self.use_graph = False  # capture at the first decode step
        self.graph_required = False  # a failed capture raises instead of falling back to eager steps
        self.captured = False  # a capture happened since the server last looked
        self.capture_error: Exception | None = None
        self.busy = False  # held by a running batch (a kept decoder serves one batch at a time)

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

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, chunk: int):
        """Run the left-padded prompts `ids` `[B, W]` (`valid` False at padding) in chunks of `chunk` columns.

        A generator: it yields after every chunk but the last (the caller may run other work there) and returns
        the logits of each prompt's last token `[B, V]`.
        """
        cache = self.cache
        cache.reset()
        p = cache.prefix_length
        positions = p + (valid.cumsum(1) - 1).clamp_min(0)  # [B, W]
        width = ids.shape[1]
        for start in range(0, width, chunk):
            end = min(start + chunk, width)
            logits = self._forward(ids[:, start:end], positions[:, start:end], valid[:, start:end])
            cache.advance(end - start)
            if end < width:
                yield
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
            logits = self.graph()
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

        The step is first run eagerly on a side stream (the warm-up that capture needs); the helper's eager check
        then replays the same step and must find the same logits, else `zoo.graphs.GraphCheckError`; that replay's
        logits are returned. No run of the step moves a counter, so the cache ends as one eager step would leave it.
        """
        graph = StaticGraph(self._step, (), warmup=1, device=self.tokens.device, capture_error_mode="thread_local",
                            name="the shared-prefix decode step", check=True)
        logits = graph.outputs  # the check's replay computed this step: another replay would repeat it
        self.graph, self.logits = graph, logits
        return logits


class PlainDecoder:
    """Decoding over the cartridge's own cache (`as_cache`) and the model's attention: prompts of equal length,
    no padding; shapes grow every step, so it is never captured."""

    def __init__(self, model, cache, extra: dict):
        self.model, self.cache, self.extra = model, cache, extra
        self._kwargs = cache_kwargs  # the cache keyword of this transformers version

    def _forward(self, ids) -> torch.Tensor:
        kwargs = {} if self.cache is None else self._kwargs(self.model, self.cache)
        out = self.model(input_ids=ids, use_cache=True, **kwargs, **self.extra)
        if self.cache is None:
            self.cache = out["cache"] if "cache" in out else out["past_key_values"]
        return out.logits[:, -1].float()  # [B, V]

    def prefill(self, ids: torch.Tensor, chunk: int):
        """The prompts `ids` `[B, W]` in chunks of `chunk` tokens; a generator as `SharedDecoder.prefill`."""
        width = ids.shape[1]
        for start in range(0, width, chunk):
            logits = self._forward(ids[:, start : start + chunk])
            if start + chunk < width:
                yield
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens[:, None])
