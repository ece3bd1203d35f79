"""Requests and their checks, the decoding state of one request (`Row`) and sampling.

`check_request` refuses, with a `ServeError`, every value that could fail later inside a batch (where it would
fail the requests batched with it): a request is checked alone, before it joins a batch.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cartridges.engine.errors import ServeError

SEED_LIMIT = 1 << 64  # torch.Generator seeds are unsigned 64-bit
MAX_TEMPERATURE = 100.0
MAX_CARTRIDGES = 16


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
    finish_reason: str  # "stop" (EOS or a stop string) | "length" | "cancelled" (its client went away)
    prompt_tokens: int
    cartridge_tokens: int = 0


@dataclass
class Prepared:
    """A checked request: its prompt ids and cartridge key. `cancel()` (any thread) stops its generation at the
    next decode step; a cancelled request still queued never starts."""

    request: GenerationRequest
    prompt_ids: list[int]
    key: tuple[str, ...]
    stream: bool = False  # text deltas wanted as tokens arrive
    cartridge_tokens: int = 0
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


# on_event(index, text_delta, completion_or_None): called as tokens arrive; the completion when one finishes
EventCallback = Callable[[int, str, Completion | None], None]


class Row:
    """Decoding state of one request: its tokens, stop handling and the text already streamed."""

    def __init__(self, prepared: Prepared, tokenizer, eos_ids: set[int], streaming: bool, prefix_tokens: int):
        self.prepared, self.req, self.prompt_ids = prepared, prepared.request, prepared.prompt_ids
        self.tokenizer, self.eos_ids, self.streaming = tokenizer, eos_ids, streaming
        self.prefix_tokens = prefix_tokens
        self.ids: list[int] = []
        self.text, self.sent = "", ""
        self.finish: str | None = None
        self.generator: torch.Generator | None = None
        # text is decoded after every token only for streaming and stop strings; otherwise once, at the end
        self.needs_text = tokenizer is not None and (streaming or bool(self.req.stop))

    @property
    def cancelled(self) -> bool:
        return self.prepared.cancelled

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
        safe = self.text[: len(self.text) - stop_overlap(self.text, self.req.stop)].rstrip("\ufffd")
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


def stop_overlap(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins one of `stops`."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def sample(logits: torch.Tensor, rows: list[Row], greedy: bool) -> torch.Tensor:
    """Next token per row `[B]` from logits `[B, V]`: argmax at temperature 0, else nucleus sampling.
    `greedy`: every row has temperature 0 (checked once per batch, not per step)."""
    tokens = logits.argmax(-1)
    if greedy:
        return tokens
    for b, row in enumerate(rows):
        if row.req.temperature <= 0 or row.finish is not None:
            continue
        row_logits = logits[b].float()
        # shifted to a maximum of 0 and divided by at least float32's smallest normal number: any positive
        # temperature, however small, gives finite probabilities (the most likely tokens, at the limit)
        temperature = max(row.req.temperature, torch.finfo(torch.float32).tiny)
        probs = torch.softmax((row_logits - row_logits.max()) / temperature, -1)
        if row.req.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (the most likely token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= row.req.top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        tokens[b] = torch.multinomial(probs, 1, generator=row.generator)[0]
    return tokens


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_text(text, where: str) -> str:
    """`text` if it is a string that encodes as UTF-8 (no lone surrogates); else ServeError."""
    if not isinstance(text, str):
        raise ServeError(f"{where} must be a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ServeError(f"{where} is not valid Unicode text (a lone surrogate?)") from None
    return text


def check_request(request: GenerationRequest) -> None:
    """Raise ServeError for any field a batch could not run with (types, ranges, text that cannot be encoded)."""
    if not _is_int(request.max_tokens) or request.max_tokens < 1:
        raise ServeError(f"max_tokens must be an integer >= 1, got {request.max_tokens!r}")
    if not _is_real(request.temperature) or not 0 <= request.temperature <= MAX_TEMPERATURE:
        raise ServeError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {request.temperature!r}")
    if not _is_real(request.top_p) or not 0 < request.top_p <= 1:
        raise ServeError(f"top_p must be a number in (0, 1], got {request.top_p!r}")
    if request.seed is not None and (not _is_int(request.seed) or not 0 <= request.seed < SEED_LIMIT):
        raise ServeError(f"seed must be an integer in [0, 2^64), got {str(request.seed)[:40]}")
    if not isinstance(request.ignore_eos, bool):
        raise ServeError("ignore_eos must be true or false")
    if isinstance(request.stop, str) or any(not isinstance(s, str) or not s for s in request.stop):
        raise ServeError("stop must be a list of non-empty strings")
    for i, s in enumerate(request.stop):
        check_text(s, f"stop[{i}]")
    if isinstance(request.cartridges, str) or len(request.cartridges) > MAX_CARTRIDGES:
        raise ServeError(f"cartridges must be a list of at most {MAX_CARTRIDGES} ids")
    if isinstance(request.prompt, str):
        check_text(request.prompt, "prompt")
    elif request.prompt is not None and any(not _is_int(t) for t in request.prompt):
        raise ServeError("a prompt of token ids must hold integers only")
    for i, message in enumerate(request.messages or ()):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ServeError(f"messages[{i}] must have a string content")
        check_text(message["content"], f"messages[{i}].content")
