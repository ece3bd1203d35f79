"""The HTTP front against the real uvicorn server on a loopback port: a bad request fails alone (400 beside a
good request's 200, checked before batching), a client that leaves stops its generation, oversize bodies get a
413 (Content-Length and chunked), damaged cartridges are a 400 and listed as unreadable, long prompts do not
stall others, and the server checks Host, API key, content type and slow connections."""

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi", reason="the [serve] extra (fastapi, uvicorn) is not installed")
httpx = pytest.importorskip("httpx")

from cartridges.cache import Cartridge, generate  # noqa: E402
from cartridges.engine import Server  # noqa: E402
from cartridges.http import build_app, default_allowed_hosts  # noqa: E402
from zoo.pretrained import ByteTokenizer, tiny_llama  # noqa: E402

DOC, EOS = 24, 2
JSON = {"content-type": "application/json"}
STEP_S = 0.02  # the slow model's time per forward


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def cartridge_dir(model, tmp_path_factory):
    """doc (valid), nan (all values NaN, checksum right), broken (a header whose tensor entry is an int)."""
    directory = tmp_path_factory.mktemp("http") / "cartridges"
    directory.mkdir()
    ids = torch.randint(3, 259, (1, DOC), generator=torch.Generator().manual_seed(1))
    Cartridge.from_prefix(model, ids).save(directory / "doc.safetensors")
    nan = Cartridge.random(model, num_tokens=4, num_frozen=0)
    with torch.no_grad():
        nan.trainable_keys.fill_(float("nan"))
    nan.save(directory / "nan.safetensors")
    header = json.dumps({"__metadata__": {"zoo.cartridge": "{}"}, "layers.0.keys": 7}).encode()
    header += b" " * (-len(header) % 8)
    (directory / "broken.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return directory


@pytest.fixture(scope="module")
def url(model, cartridge_dir, serve_app):
    server = Server(model, cartridge_dir, ByteTokenizer(), max_batch_size=64)
    with serve_app(build_app(server, "tiny", max_body_bytes=64 << 10, body_timeout_s=1.0), header_timeout_s=1.0) as u:
        yield u


@pytest.fixture(scope="module")
def slow(cartridge_dir, serve_app):
    """A server whose model sleeps STEP_S per forward (prefill chunks of 8 columns): generations take seconds."""
    slow_model = tiny_llama(seed=0)
    slow_model.register_forward_pre_hook(lambda module, args: time.sleep(STEP_S))
    server = Server(slow_model, cartridge_dir, ByteTokenizer(), prefill_chunk=8)
    with serve_app(build_app(server, "tiny")) as u:
        yield u, server


def body(**extra):
    return {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "cartridges": [{"id": "doc"}], **extra}


async def send(client, url, payload, path="/v1/completions"):
    if isinstance(payload, bytes):
        return await client.post(f"{url}{path}", content=payload, headers=JSON)
    return await client.post(f"{url}{path}", json=payload)


def concurrently(url, *payloads):
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(send(client, url, p) for p in payloads))

    return asyncio.run(run())


def expected_ids(model, cartridge_dir, prompt, max_tokens):
    doc = Cartridge.load(cartridge_dir / "doc.safetensors", model)
    out = generate(model, doc, torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)[0, len(prompt) :]
    out = out.tolist()
    return out[: out.index(EOS)] if EOS in out else out


DEEP = b"[" * 20_000 + b"]" * 20_000  # deeper than Python's recursion limit, under the body limit
BAD = {
    "seed-2^70": body(seed=2**70, temperature=1.0),
    "seed-2^64": body(seed=2**64),
    "temperature-huge": body(temperature=1e300),
    "stream-yes": body(stream="yes"),
    "stream-with-seed-2^70": body(stream=True, seed=2**70),
    "max_tokens-true": body(max_tokens=True),
    "max_tokens-zero": body(max_tokens=0),
    "temperature-NaN": b'{"prompt": [5, 6], "temperature": NaN}',
    "lone-surrogate": b'{"prompt": "abc\\ud800def"}',
    "deep-json": b'{"prompt": ' + DEEP + b"}",
    "broken-cartridge": body(cartridges=[{"id": "broken"}]),
    "nan-cartridge": body(cartridges=[{"id": "nan"}]),
    "prompt-over-the-context": body(prompt=[5] * 2100),
    "cartridge-over-the-context": body(prompt=[5] * (2048 - DOC - 5), max_tokens=6),
}


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
def test_a_bad_request_fails_alone_beside_a_good_one(url, model, cartridge_dir, bad):
    bad_reply, good_reply = concurrently(url, bad, body(return_token_ids=True))
    assert bad_reply.status_code == 400, bad_reply.text
    assert bad_reply.json()["error"]["message"]
    assert good_reply.status_code == 200, good_reply.text
    assert good_reply.json()["choices"][0]["token_ids"] == expected_ids(model, cartridge_dir, [5, 6, 7, 8], 6)


def test_a_chat_request_with_a_bad_seed_fails_alone(url):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 2**70, "temperature": 1e-50}
    good = {**chat, "seed": 1}

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            path = "/v1/chat/completions"
            return await asyncio.gather(send(client, url, chat, path), send(client, url, good, path))

    bad_reply, good_reply = asyncio.run(run())
    assert (bad_reply.status_code, good_reply.status_code) == (400, 200), (bad_reply.text, good_reply.text)


def test_errors_name_a_cartridge_by_id_and_the_listing_marks_unreadable_files(url, cartridge_dir):
    message = httpx.post(f"{url}/v1/completions", json=body(cartridges=[{"id": "broken"}])).json()["error"]["message"]
    assert "'broken'" in message and str(cartridge_dir) not in message
    listing = httpx.get(f"{url}/v1/cartridges")
    assert listing.status_code == 200
    rows = {row["id"]: row for row in listing.json()["data"]}
    assert rows["doc"]["readable"] and rows["doc"]["num_tokens"] == DOC
    assert not rows["broken"]["readable"] and "broken" in rows["broken"]["error"]
    assert str(cartridge_dir) not in json.dumps(rows)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversize_body_gets_413_even_when_sent_whole_before_reading(url, framing):
    """urllib writes the whole body before it reads the answer: the server must read it (bounded) and answer."""
    payload = b'{"prompt": "' + b"x" * (8 << 20) + b'"}'
    data = (
        payload
        if framing == "content-length"
        else iter([payload[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)])
    )
    request = urllib.request.Request(f"{url}/v1/completions", data=data, headers=JSON, method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 413
    assert "over" in json.loads(info.value.read())["error"]["message"]


def time_short_request(url) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body(max_tokens=2, ignore_eos=True), timeout=60)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def leave_early(url, streaming: bool) -> None:
    """Ask for 150 tokens (3 s on the slow model), then close the connection after 0.5 s or two chunks."""
    long = json.dumps(body(max_tokens=150, ignore_eos=True, stream=streaming)).encode()
    if streaming:
        with httpx.stream("POST", f"{url}/v1/completions", content=long, headers=JSON, timeout=60) as s:
            lines = s.iter_lines()
            for _ in range(2):
                while not next(lines):
                    pass
        return
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(head.encode() + f"Content-Length: {len(long)}\r\n\r\n".encode() + long)
        time.sleep(0.5)


@pytest.mark.parametrize("streaming", [False, True], ids=["non-streaming", "streaming"])
def test_a_client_that_leaves_stops_its_generation(slow, streaming):
    url, server = slow
    before = server.stats["cancelled"]
    leave_early(url, streaming)
    seconds = time_short_request(url)
    # the gone request's remaining ~140 steps would take ~3 s; a short request needs a prefill and 2 steps
    assert seconds < 1.5, seconds
    deadline = time.time() + 5
    while server.stats["cancelled"] == before:
        assert time.time() < deadline, "the gone request was never cancelled"
        time.sleep(0.05)


def test_a_long_prompt_does_not_stall_a_short_request(slow):
    """A 480-token prompt prefills in 60 chunks (over 1 s); a short request sent meanwhile finishes first."""
    url, _ = slow
    done = {}

    def ask(name, payload):
        r = httpx.post(f"{url}/v1/completions", json=payload, timeout=60)
        done[name] = (time.perf_counter(), r.status_code)

    long = threading.Thread(target=ask, args=("long", body(prompt=[5] * 480, max_tokens=2)))
    long.start()
    time.sleep(0.2)
    start = time.perf_counter()
    ask("short", body(max_tokens=2))
    long.join()
    assert done["short"][1] == done["long"][1] == 200
    assert done["short"][0] < done["long"][0] and done["short"][0] - start < 0.8


@pytest.fixture(scope="module")
def guarded(model, cartridge_dir, serve_app):
    server = Server(model, cartridge_dir, ByteTokenizer())
    app = build_app(server, "tiny", api_key="s3cret", allowed_hosts=default_allowed_hosts("127.0.0.1"))
    with serve_app(app, header_timeout_s=0.5, timeout_keep_alive=1) as u:
        yield u


KEY = {"authorization": "Bearer s3cret"}
GUARD_CASES = {
    "no-key": ({}, JSON, 401),
    "wrong-key": ({"authorization": "Bearer nope"}, JSON, 401),
    "right-key": (KEY, JSON, 200),
    "foreign-host": ({**KEY, "host": "attacker.example"}, JSON, 400),
    "localhost-host": ({**KEY, "host": "localhost:8000"}, JSON, 200),
    "text-plain": (KEY, {"content-type": "text/plain"}, 415),
    "no-content-type": (KEY, {}, 415),
}


@pytest.mark.parametrize("case", list(GUARD_CASES), ids=list(GUARD_CASES))
def test_host_api_key_and_content_type_are_checked(guarded, case):
    headers, content_type, status = GUARD_CASES[case]
    r = httpx.post(
        f"{guarded}/v1/completions", content=json.dumps(body()).encode(), headers={**headers, **content_type}
    )
    assert r.status_code == status, r.text
    assert httpx.get(f"{guarded}/health").status_code == 200  # health checks need no key


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"], ids=["idle", "slow-headers"]
)
def test_idle_and_slow_connections_are_closed(guarded, sent):
    host, port = guarded.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(sent)
        assert closed_within(sock, 3.0)


def test_a_slow_body_gets_408(url):
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
        sock.sendall(b'Content-Length: 100\r\n\r\n{"prompt": ')
        sock.settimeout(5)
        assert b" 408 " in sock.recv(4096).split(b"\r\n")[0]
