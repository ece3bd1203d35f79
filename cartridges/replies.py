"""The OpenAI response objects of cartridges-serve, and the waiting and streaming of a request's engine events.

`Reply` builds one request's bodies and server-sent-event chunks; `last_event` waits out a request that does not
stream, `sse` streams one that does. Both cancel the request when its client disconnects. `chat_messages` turns
validated chat messages into what a chat template reads. cartridges/http.py routes requests to them.
"""

import asyncio
import json
import time
import uuid
from typing import Any

from cartridges.engine import Completion, Prepared, ServeError


async def _next_event(events: asyncio.Queue, gone: asyncio.Future):
    """The next engine event, or None once the client is gone."""
    get = asyncio.ensure_future(events.get())
    done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    return None


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def chat_messages(messages) -> list[dict[str, str]]:
    """Validated chat messages -> the chat template's {"role", "content"} dicts: text parts joined, and OpenAI's
    "developer" role (the system role of its newer models) given as "system", the role chat templates know."""
    return [{"role": "system" if m.role == "developer" else m.role,
             "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
            for m in messages]


class Reply:
    """The OpenAI response objects of one request: its id and object names, and its choices, as one body or as
    server-sent-event chunks. `kind` is "chat" or "text"; `token_ids` adds each choice's generated token ids
    (the `return_token_ids` extension)."""

    def __init__(self, kind: str, model_name: str, token_ids: bool = False) -> None:
        self.kind = kind
        self.model = model_name
        self.token_ids = token_ids
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    @staticmethod
    def usage(c: Completion) -> dict:
        total = c.prompt_tokens + len(c.token_ids)
        return {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids), "total_tokens": total}

    def choice(self, text: str, finish: str | None, c: Completion | None, stream: bool) -> dict:
        """One choice: chat's message (whole) or delta (streamed), or a completion's text."""
        out: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            out["delta" if stream else "message"] = (
                ({"content": text} if text else {}) if stream else {"role": "assistant", "content": text}
            )
        else:
            out["text"] = text
            out["logprobs"] = None
        out["finish_reason"] = finish
        if c is not None and self.token_ids:
            out["token_ids"] = c.token_ids
        return out

    def whole(self, c: Completion) -> dict:
        """The response body of a request that did not stream."""
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self.choice(c.text, c.finish_reason, c, False)], "usage": self.usage(c)}

    def chunk(self, choices: list[dict], extra: dict | None = None) -> str:
        """One server-sent event: chat's chunks are "chat.completion.chunk"; text completions keep their name."""
        data = {"id": self.id, "object": self.object + ("" if self.kind == "text" else ".chunk"),
                "created": self.created, "model": self.model, "choices": choices, **(extra or {})}
        return f"data: {json.dumps(data)}\n\n"

    def opening(self) -> list[str]:
        """The chunks before the first token: chat announces the assistant's role."""
        if self.kind != "chat":
            return []
        return [self.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]

    def ending(self, c: Completion, usage: bool) -> list[str]:
        """The chunks after the last token: the finish reason, then the usage when the client asked for it."""
        out = [self.chunk([self.choice("", c.finish_reason, c, True)])]
        if usage:
            out.append(self.chunk([], {"usage": self.usage(c)}))
        return out

    @staticmethod
    def error_chunk(err: BaseException) -> str:
        """An error once streaming has begun (the status line has gone): a ServeError's own message and status,
        anything else as an internal error that names only its type."""
        known = isinstance(err, ServeError)
        status = err.status if known else 500
        text = str(err) if known else f"internal error: {type(err).__name__}"
        return f"data: {json.dumps({'error': {'message': text, 'code': status}})}\n\n"


async def last_event(events: asyncio.Queue, receive, prepared: Prepared):
    """Wait out a request's deltas; its last event ("done" or "error"), or None once the client left."""
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        while (event := await _next_event(events, gone)) is not None and event[0] == "delta":
            pass
    finally:
        gone.cancel()
        prepared.cancel()  # no-op once it finished; stops the generation of a client that left
    return event


async def sse(reply: Reply, events: asyncio.Queue, receive, prepared: Prepared, usage: bool):
    """A request's events as server-sent events, ending with [DONE]; a client that leaves cancels the request."""
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        for chunk in reply.opening():
            yield chunk
        while (event := await _next_event(events, gone)) is not None:
            tag, value = event
            if tag == "delta":
                yield reply.chunk([reply.choice(value, None, None, True)])
                continue
            for chunk in [reply.error_chunk(value)] if tag == "error" else reply.ending(value, usage):
                yield chunk
            break
        if event is not None:
            yield "data: [DONE]\n\n"
    finally:
        gone.cancel()
        prepared.cancel()
