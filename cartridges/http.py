"""The OpenAI-compatible HTTP front of the serving engine (FastAPI + uvicorn) and the `cartridges-serve` CLI.

`POST /v1/chat/completions` and `/v1/completions` take the extension field `cartridges: [{"id": "..."}]` (ids
are file names in the cartridge dir: `<id>.safetensors` or `<id>/cartridge.safetensors`) and stream over SSE
with `stream: true`. `GET /v1/models` (and `/v1/models/<id>`), `/v1/cartridges` (every file; unreadable ones
marked with the reason), `/health`. Every error, an unknown path or method included, is OpenAI's
`{"error": {"message", "type", "code"}}`. The engine (`cartridges.engine`) does the work; this module parses,
checks and answers.

Before a request reaches the engine (`Guard`, then the schema): the `Host` header is checked against an allowlist
(default: the loopback names when bound to loopback, against DNS rebinding) → 400; the API key when set
(`Authorization: Bearer`) → 401; POST bodies must be `application/json` (no "simple" cross-site POST) → 415; the
body is read whole, up to `max_body_bytes` (Content-Length or chunked), a longer one drained up to `drain_bytes`
and answered 413 (a client that writes it all before reading gets the 413, not a reset), one slower than
`body_timeout_s` → 408; the JSON must be strict (no NaN, at most `MAX_JSON_DEPTH` deep, no lone surrogates) and
fit a strict schema → 400 (OpenAI fields the server does not implement, the penalties, logprobs, logit_bias,
response_format, tools, best_of and suffix, pass at the no-op values clients send by default, and fail
otherwise); then `Server.prepare` checks the request alone → 400/404. A client that disconnects cancels its
request (it stops at the engine's next decode step); idle connections and connections that send no headers in
time are closed (`uvicorn_config`).
"""

import asyncio
import hmac
import json
import logging
import sys
from pathlib import Path

from cartridges.engine import GenerationRequest, Prepared, Scheduler, ServeError, Server
from cartridges.replies import Reply, chat_messages, last_event, sse
from cartridges.serve_args import serve_parser

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 32
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _schemas():
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)

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
        seed: int | None = Field(None, ge=0, lt=1 << 64)
        stream: bool = False
        stream_options: StreamOptions | None = None
        user: str | None = None
        # OpenAI fields this server does not implement: accepted at their no-op values, which clients send by
        # default, and refused otherwise (a 400 naming the field), never silently ignored
        presence_penalty: Literal[0] = 0
        frequency_penalty: Literal[0] = 0
        logprobs: Literal[False] | None = None
        logit_bias: dict[str, float] | None = Field(None, max_length=0)
        ignore_eos: bool = False  # extensions: decode exactly max_tokens, and return the generated ids
        return_token_ids: bool = False

    class TextPart(Strict):
        type: Literal["text"]
        text: str

    class Message(Strict):
        role: Literal["system", "developer", "user", "assistant"]
        content: str | list[TextPart]
        name: str | None = None

    class ResponseFormat(Strict):
        type: Literal["text"]

    class Chat(Common):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        top_logprobs: Literal[0] | None = None
        response_format: ResponseFormat | None = None
        tools: list[dict] | None = Field(None, max_length=0)
        tool_choice: Literal["none"] | None = None

    class Text(Common):
        prompt: str | list[int] | list[str] | list[list[int]]
        echo: Literal[False] = False
        best_of: Literal[1] | None = None
        suffix: Literal[""] | None = None

    return Chat, Text


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def _error_body(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes):
    """The JSON object of a request body; HTTPError 400 for anything else (see the module docstring)."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise HTTPError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the body must be a JSON object")
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise HTTPError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
            stack.extend((k, depth) for k in value)
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise HTTPError(400, "the body holds a string that is not valid Unicode (a lone surrogate)") from None
    return data


class Guard:
    """ASGI middleware that checks Host, API key and Content-Type, and reads the whole body (bounded) before the
    app sees the request; the app then reads the body from memory, and later `receive` calls (the disconnect)
    go to the server."""

    def __init__(
        self,
        app,
        *,
        allowed_hosts: set[str] | None,
        api_key: str | None,
        max_body_bytes: int,
        drain_bytes: int,
        body_timeout_s: float,
    ):
        self.app, self.allowed_hosts, self.api_key = app, allowed_hosts, api_key
        self.max_body_bytes, self.drain_bytes, self.body_timeout_s = max_body_bytes, drain_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem = self._check(scope, headers)
        if problem is not None:
            status, message, kind, extra = problem
            await self._drain(receive)
            return await self._reply(send, status, message, kind, extra)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive, headers), self.body_timeout_s)
        except asyncio.TimeoutError:
            return await self._reply(send, 408, f"the body did not arrive within {self.body_timeout_s:g} s", close=True)
        except HTTPError as e:
            return await self._reply(send, e.status, str(e), e.kind, close=True)
        if body is None:  # the client went away
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _check(self, scope, headers: dict[str, str]):
        if self.allowed_hosts is not None:
            host = headers.get("host", "")
            name = host[1:].split("]")[0] if host.startswith("[") else host.rsplit(":", 1)[0]
            if name.lower() not in self.allowed_hosts:
                return 400, f"host {host[:80]!r} is not allowed (see --allowed-hosts)", "invalid_request_error", {}
        if self.api_key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                extra = {"www-authenticate": "Bearer"}
                return 401, "a valid API key is required (Authorization: Bearer <key>)", "authentication_error", extra
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return 415, "the body must be sent as Content-Type: application/json", "invalid_request_error", {}
        return None

    async def _read(self, receive, headers: dict[str, str]) -> bytes | None:
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._drain(receive)
            raise HTTPError(413, f"request body over {self.max_body_bytes} bytes", "request_too_large")
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, len(body))
                raise HTTPError(413, f"request body over {self.max_body_bytes} bytes", "request_too_large")
            if not message.get("more_body", False):
                return bytes(body)

    async def _drain(self, receive, seen: int = 0) -> None:
        """Read and drop the rest of the body, up to `drain_bytes` in all, so the answer reaches a client that
        writes its whole body before it reads."""

        async def drop(seen: int) -> None:
            while seen <= self.drain_bytes:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return
                seen += len(message.get("body", b""))

        try:
            await asyncio.wait_for(drop(seen), self.body_timeout_s)
        except asyncio.TimeoutError:
            return

    @staticmethod
    async def _reply(send, status, message, kind="invalid_request_error", extra=None, close=False):
        headers = [(b"content-type", b"application/json")]
        headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": _error_body(status, message, kind)})


def build_app(
    server: Server,
    model_name: str,
    *,
    max_body_bytes: int = 1 << 20,
    drain_bytes: int = 64 << 20,
    body_timeout_s: float = 30.0,
    max_tokens_limit: int = 2048,
    default_max_tokens: int = 256,
    batch_window_s: float = 0.005,
    api_key: str | None = None,
    allowed_hosts: set[str] | None = None,
):
    """The ASGI app serving `server` under the OpenAI API names, with `model_name` as the model id.

    allowed_hosts: Host names accepted (None: any); api_key: required as a Bearer token except on /health."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    Chat, Text = _schemas()
    scheduler = Scheduler(server, window_s=batch_window_s)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="cartridges-serve", lifespan=lifespan)

    def error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                            headers=headers)

    @app.exception_handler(HTTPError)
    async def _http_error(request, exc: HTTPError):
        return error(exc.status, str(exc), exc.kind)

    @app.exception_handler(ServeError)
    async def _serve_error(request, exc: ServeError):
        return error(exc.status, str(exc), exc.kind)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request, exc: StarletteHTTPException):
        # unknown paths and methods answer in the OpenAI error shape that clients parse, not FastAPI's {"detail"}
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind, exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("internal error")
        return error(500, f"internal error: {type(exc).__name__}", "server_error")

    async def read_json(request: Request, schema):
        data = parse_json(await request.body())
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

    async def to_request(payload, max_tokens, **prompt) -> Prepared:
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
        # tokenizing and loading cartridges happen off the event loop
        prepared = await asyncio.to_thread(server.prepare, request)
        prepared.stream = payload.stream
        return prepared

    async def respond(request: Request, payload, prepared: Prepared, kind: str):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        scheduler.submit(prepared, lambda tag, value: loop.call_soon_threadsafe(events.put_nowait, (tag, value)))
        reply = Reply(kind, model_name, token_ids=payload.return_token_ids)
        if payload.stream:
            usage = payload.stream_options is not None and payload.stream_options.include_usage
            chunks = sse(reply, events, request.receive, prepared, usage)
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        event = await last_event(events, request.receive, prepared)
        if event is None:
            return error(499, "the client closed the request")
        tag, value = event
        if tag == "error":
            raise value
        return reply.whole(value)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        payload = await read_json(request, Chat)
        messages = chat_messages(payload.messages)
        max_tokens = payload.max_completion_tokens or payload.max_tokens or default_max_tokens
        return await respond(request, payload, await to_request(payload, max_tokens, messages=messages), "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        payload = await read_json(request, Text)
        prompt = payload.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise HTTPError(400, "prompt: one prompt per request (batch by sending concurrent requests)")
            prompt = prompt[0]
        prepared = await to_request(payload, payload.max_tokens or 16, prompt=prompt)
        return await respond(request, payload, prepared, "text")

    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "zoo"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise HTTPError(404, f"model {model_id!r} not found (this server has {model_name!r})", "not_found_error")
        return model_card

    @app.get("/v1/cartridges")
    async def cartridges():
        return {"object": "list", "data": await asyncio.to_thread(server.store.available)}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "cached_cartridge_bytes": server.store.cached_bytes}

    guarded = Guard(
        app,
        allowed_hosts=None if allowed_hosts is None else {h.lower().strip("[]") for h in allowed_hosts},
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        drain_bytes=drain_bytes,
        body_timeout_s=body_timeout_s,
    )
    guarded.state = app.state  # what tests and tools reach through the app
    return guarded


def default_allowed_hosts(host: str) -> set[str] | None:
    """The Host names to accept when bound to `host`: the loopback names on loopback, any name elsewhere."""
    return set(LOOPBACK_NAMES) if host in LOOPBACK_NAMES or host.startswith("127.") else None


def uvicorn_config(app, *, header_timeout_s: float = 10.0, timeout_keep_alive: int = 5, **kwargs):
    """A uvicorn.Config whose connections close when idle for `timeout_keep_alive` seconds or when a request's
    headers have not arrived `header_timeout_s` after its first bytes (or after the connection opened)."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc):
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._expire, self.cycle)

        def _expire(self, cycle) -> None:
            self._header_timer = None
            if self.cycle is cycle and (cycle is None or cycle.response_complete):  # no new request began
                self.transport.close()

    return uvicorn.Config(app, http=Protocol, timeout_keep_alive=timeout_keep_alive, **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = serve_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.allowed_hosts is None:
        allowed = default_allowed_hosts(args.host)
    else:
        allowed = None if args.allowed_hosts.strip() == "*" else {h.strip() for h in args.allowed_hosts.split(",")}
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
            max_prompt_tokens=args.max_prompt_tokens,
        )
    except (ValueError, ImportError) as e:
        print(f"cartridges-serve: error: {str(e).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
    app = build_app(
        server,
        args.served_name or args.model,
        max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit,
        body_timeout_s=args.body_timeout,
        api_key=args.api_key,
        allowed_hosts=allowed,
    )
    log.info("serving %s with cartridges from %s on http://%s:%d", args.model, args.cartridges, args.host, args.port)
    timeouts = dict(header_timeout_s=args.header_timeout, timeout_keep_alive=args.timeout_keep_alive)
    config = uvicorn_config(app, **timeouts, host=args.host, port=args.port, log_level="info")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
