"""Serving: cascade attention equals plain attention, the Server equals `cartridges.generate`, and the real
uvicorn server on a loopback port answers completions, streams, composes cartridges, batches 64 concurrent
clients and refuses bad input without going down."""

import asyncio
import json

import pytest
import torch

pytest.importorskip("fastapi", reason="the [serve] extra (fastapi, uvicorn) is not installed")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from cartridges.cache import Cartridge, cache_kwargs, generate  # noqa: E402
from cartridges.engine import (  # noqa: E402
    CartridgeNotFound,
    CartridgeStore,
    GenerationRequest,
    Prepared,
    ServeError,
    Server,
    SharedPrefixCache,
    cascade_attention,
)
from cartridges.engine.decoders import SharedDecoder  # noqa: E402
from cartridges.engine.requests import Row  # noqa: E402
from cartridges.http import build_app, main  # noqa: E402
from zoo.pretrained import ByteTokenizer, tiny_llama  # noqa: E402

DOC, MAX_TOKENS, EOS = 24, 8, 2
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def cartridge_dir(model, tmp_path_factory):
    """doc.safetensors and other/cartridge.safetensors (the distill layout), a corrupted file, and a valid
    cartridge outside the directory that no id may reach."""
    root = tmp_path_factory.mktemp("serve")
    directory = root / "cartridges"
    directory.mkdir()
    gen = torch.Generator().manual_seed(1)
    doc = torch.randint(3, 259, (1, DOC), generator=gen)
    Cartridge.from_prefix(model, doc).save(directory / "doc.safetensors")
    (directory / "other").mkdir()
    Cartridge.from_prefix(model, torch.randint(3, 259, (1, 16), generator=gen)).save(
        directory / "other" / "cartridge.safetensors"
    )
    (directory / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a cartridge!")
    Cartridge.from_prefix(model, doc).save(root / "outside.safetensors")
    return directory


def reference(model, cartridge, prompt, max_new_tokens=MAX_TOKENS):
    """Greedy ids from `cartridges.generate` (or plain `generate` without a cartridge), cut at EOS."""
    ids = torch.tensor([prompt])
    if cartridge is None:
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, len(prompt) :]
    else:
        out = generate(model, cartridge, ids, max_new_tokens=max_new_tokens, do_sample=False)[0, len(prompt) :]
    out = out.tolist()
    return out[: out.index(EOS)] if EOS in out else out


def drain(units):
    """Run a generator of units to its end; its return value."""
    while True:
        try:
            next(units)
        except StopIteration as done:
            return done.value


def prompts(n, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (int(k),), generator=gen).tolist() for k in torch.randint(2, 12, (n,), generator=gen)]


# ---- cascade attention and the Python API


def test_cascade_attention_equals_softmax_over_the_concatenation():
    gen = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, steps, size, p, dim = 3, 6, 2, 5, 7, 11, 8
    query = torch.randn(batch, q_heads, steps, dim, generator=gen)
    prefix_k, prefix_v = torch.randn(2, kv_heads, p, dim, generator=gen)
    keys, values = torch.randn(2, batch, kv_heads, size, dim, generator=gen)
    mask = torch.rand(batch, 1, steps, size, generator=gen) > 0.4
    mask[0, 0, 1] = False  # a query that sees no suffix key at all
    out = cascade_attention(query, prefix_k, prefix_v, keys, values, mask, 0.3)  # [B, T, Hq, D]

    all_k = torch.cat([prefix_k.expand(batch, -1, -1, -1), keys], 2).repeat_interleave(3, 1)  # [B, Hq, p+S, D]
    all_v = torch.cat([prefix_v.expand(batch, -1, -1, -1), values], 2).repeat_interleave(3, 1)
    full_mask = torch.cat([torch.ones(batch, 1, steps, p, dtype=torch.bool), mask], -1)
    scores = (query @ all_k.transpose(-1, -2) * 0.3).masked_fill(~full_mask, float("-inf"))
    expected = (scores.softmax(-1) @ all_v).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

    # without a prefix: attention over the suffix alone, zeros where a query sees nothing
    out = cascade_attention(query, None, None, keys, values, mask, 0.3)
    scores = (query @ keys.repeat_interleave(3, 1).transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    expected = (scores.softmax(-1).nan_to_num(0.0) @ values.repeat_interleave(3, 1)).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_shared_prefix_forward_equals_the_plain_cache(model, cartridge_dir):
    """Logits of a left-padded batch through the cascade path equal each prompt alone on the cartridge's
    DynamicCache, and the batch's cache holds the prefix once, as the stored tensor itself."""
    server = Server(model, cartridge_dir)
    batch = [server.prepare(GenerationRequest(prompt=p, cartridges=["doc"], max_tokens=3)) for p in prompts(4)]
    entry = server.store.get(("doc",))
    decoder, prefill = server._start(entry, batch, steps=3, shared=True)
    logits = drain(prefill)  # [B, V]
    cache = server.last_cache
    assert cache.prefix_keys.data_ptr() == server.store.prefix(entry)[0].data_ptr()
    width = max(len(x.prompt_ids) for x in batch)
    assert width + 3 <= cache.keys.shape[3] < width + 3 + 16  # the suffix holds no prefix tokens
    next_logits = decoder.step(logits.argmax(-1))
    for b, x in enumerate(batch):
        ids = torch.tensor([x.prompt_ids + [int(logits[b].argmax())]])
        plain = model(input_ids=ids, **cache_kwargs(model, entry.cartridge.as_cache(1, config=model.config))).logits
        torch.testing.assert_close(logits[b], plain[0, -2], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(next_logits[b], plain[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["shared-prefix", "plain-cache"])
def test_server_greedy_equals_cartridges_generate(model, cartridge_dir, shared_prefix):
    server = Server(model, cartridge_dir, shared_prefix=shared_prefix)
    doc = server.store.get(("doc",)).cartridge
    both = Cartridge.concat([doc, server.store.get(("other",)).cartridge])
    ps = prompts(6)
    cases = [(p, ["doc"], doc) for p in ps[:3]] + [(p, ["doc", "other"], both) for p in ps[3:5]] + [(ps[5], [], None)]
    out = server.generate([GenerationRequest(prompt=p, cartridges=ids, max_tokens=16) for p, ids, _ in cases])
    for (p, _, cartridge), completion in zip(cases, out):
        assert completion.token_ids == reference(model, cartridge, p, 16)


def test_extending_a_row_by_blocks_equals_pushing_token_by_token():
    """The loop reads tokens back in blocks (one host sync per block); a row's outcome must not change."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        max_tokens, ignore_eos = int(torch.randint(1, 12, (1,), generator=gen)), trial % 3 == 0
        tokens = torch.randint(0, 6, (16,), generator=gen).tolist()  # EOS (2) appears at random places
        request = GenerationRequest(prompt=[5], max_tokens=max_tokens, ignore_eos=ignore_eos)
        one, blocks = (Row(Prepared(request, [5], ()), None, {EOS}, False, 0) for _ in range(2))
        for t in tokens:
            one.push(t)
        block = int(torch.randint(1, 9, (1,), generator=gen))
        for start in range(0, len(tokens), block):
            blocks.extend(tokens[start : start + block])
        assert (blocks.ids, blocks.finish) == (one.ids, one.finish), (tokens, max_tokens, ignore_eos, block)


def stand_in_capture(self):
    """`SharedDecoder.capture` without CUDA: the warm-up, then a 'graph' whose replay reruns the same step into
    the same output buffer. What it checks is what a real capture relies on: the step moves no counter, so
    running it twice gives the same logits and leaves the cache as once."""
    length, column = self.cache.length, self.cache.column.clone()
    eager = self._step().clone()
    logits = self._step()
    assert torch.equal(logits, eager) and self.cache.length == length and torch.equal(self.cache.column, column)

    class Replay:  # called as a zoo.graphs.StaticGraph is: replay, return the output buffer
        def __call__(_):
            logits.copy_(self._step())
            return logits

    self.graph, self.logits = Replay(), logits
    return logits


def test_kept_decoders_are_reset_and_replayed(model, cartridge_dir, monkeypatch):
    """With graphs on, a batch's decoder (suffix buffers, graph) is kept and reused by the next batch of the same
    size and capacity: its output still equals `cartridges.generate`."""
    monkeypatch.setattr(SharedDecoder, "capture", stand_in_capture)
    server = Server(model, cartridge_dir)
    server.cuda_graphs = True  # on CPU, with the stand-in capture
    doc = server.store.get(("doc",)).cartridge
    for seed in (2, 3, 4):  # three batches of 3 prompts (2..11 tokens + 16 steps: capacity 32)
        ps = prompts(3, seed=seed)
        out = server.generate([GenerationRequest(prompt=p, cartridges=["doc"], max_tokens=16) for p in ps])
        for p, completion in zip(ps, out):
            assert completion.token_ids == reference(model, doc, p, 16)
    assert server.stats["graph_captures"] == 1 and server.stats["graph_failures"] == 0
    assert server.stats["graph_replays"] >= 3 * 8  # reads back every SYNC_EVERY steps: no early stop before 8
    assert len(server._decoders) == 1
    server.release()
    assert not server._decoders


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_decoding_equals_eager(cartridge_dir, dtype):
    """The captured decode step gives the eager step's greedy tokens, batch after batch (the graph is reused)."""
    gpu_model = tiny_llama(seed=0).to("cuda", dtype)
    graphed = Server(gpu_model, cartridge_dir, cuda_graphs=True)
    eager = Server(gpu_model, cartridge_dir, cuda_graphs=False)
    for seed in (2, 3):
        ps = prompts(5, seed=seed)
        requests = [GenerationRequest(prompt=p, cartridges=["doc"], max_tokens=24, ignore_eos=True) for p in ps]
        requests += [GenerationRequest(prompt=ps[0], cartridges=["doc", "other"], max_tokens=24)]
        got, expected = graphed.generate(requests), eager.generate(requests)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert graphed.stats["graph_failures"] == 0 and graphed.stats["graph_captures"] >= 2  # doc, doc+other
    assert graphed.stats["graph_replays"] > 0 and eager.stats["graph_captures"] == 0


def test_cartridges_load_once_and_the_lru_evicts_by_bytes(model, cartridge_dir):
    store = CartridgeStore(cartridge_dir, model, max_bytes=10**9)
    first = store.get(("doc",))
    assert store.get(("doc",)) is first and store.loads == 1
    size = first.cartridge.memory_bytes()
    small = CartridgeStore(cartridge_dir, model, max_bytes=size + 1)
    small.get(("doc",))
    small.get(("other",))
    assert small.cached_ids() == [("other",)] and small.cached_bytes <= size + 1
    small.get(("doc",))
    assert small.loads == 3


def test_ids_that_leave_the_directory_are_refused(model, cartridge_dir):
    store = CartridgeStore(cartridge_dir, model)
    for bad in ("../outside", "..", "a/b", "a\\b", "/etc/passwd", ".hidden", "doc/../doc", "", "x" * 200):
        with pytest.raises(ServeError) as err:
            store.path(bad)
        assert not isinstance(err.value, CartridgeNotFound), bad
    with pytest.raises(CartridgeNotFound):
        store.path("missing")
    assert store.path("other").name == "cartridge.safetensors"
    assert {c["id"] for c in store.available()} == {"doc", "other", "broken"}


BAD_FIELDS = {
    "seed-2^70": dict(seed=2**70),
    "seed-2^64": dict(seed=2**64),
    "seed-negative": dict(seed=-1),
    "temperature-nan": dict(temperature=float("nan")),
    "temperature-inf": dict(temperature=float("inf")),
    "temperature-huge": dict(temperature=1e300),
    "temperature-negative": dict(temperature=-0.5),
    "top_p-zero": dict(top_p=0.0),
    "max_tokens-bool": dict(max_tokens=True),
    "max_tokens-zero": dict(max_tokens=0),
    "ignore_eos-a-string": dict(ignore_eos="yes"),
    "stop-empty": dict(stop=[""]),
    "prompt-lone-surrogate": dict(prompt="abc\ud800"),
    "prompt-float-ids": dict(prompt=[5.5, 6]),
    "message-lone-surrogate": dict(prompt=None, messages=[{"role": "user", "content": "\udfff"}]),
}


@pytest.mark.parametrize("fields", list(BAD_FIELDS.values()), ids=list(BAD_FIELDS))
def test_prepare_refuses_a_bad_field_before_batching(model, cartridge_dir, fields):
    server = Server(model, cartridge_dir, ByteTokenizer())
    with pytest.raises(ServeError):
        server.prepare(GenerationRequest(**{"prompt": [5, 6, 7], "cartridges": ["doc"], **fields}))
    # with return_exceptions the bad request fails alone; the good one beside it is served
    good = GenerationRequest(prompt=[5, 6, 7], cartridges=["doc"], max_tokens=4)
    bad = GenerationRequest(**{"prompt": [5, 6, 7], "cartridges": ["doc"], **fields})
    out = server.generate([bad, good], return_exceptions=True)
    assert isinstance(out[0], ServeError) and len(out[1].token_ids) >= 1


def test_a_tiny_temperature_samples_the_greedy_token(model, cartridge_dir):
    server = Server(model, cartridge_dir)
    p = prompts(1, seed=4)[0]
    greedy, tiny = server.generate(
        [
            GenerationRequest(prompt=p, cartridges=["doc"], max_tokens=8, ignore_eos=True),
            GenerationRequest(prompt=p, cartridges=["doc"], max_tokens=8, ignore_eos=True, temperature=1e-50, seed=3),
        ]
    )
    assert tiny.token_ids == greedy.token_ids


def test_the_prompt_limits_count_the_cartridge(model, cartridge_dir):
    server = Server(model, cartridge_dir, max_prompt_tokens=100)
    with pytest.raises(ServeError, match="more than the 100 allowed"):
        server.prepare(GenerationRequest(prompt=[5] * 101))
    server = Server(model, cartridge_dir)  # the model's 2048 positions
    fits = 2048 - DOC - 8
    server.prepare(GenerationRequest(prompt=[5] * fits, cartridges=["doc"], max_tokens=8))
    server.prepare(GenerationRequest(prompt=[5] * (fits + 1), max_tokens=8))  # fits without the cartridge
    with pytest.raises(ServeError, match=f"cartridges \\({DOC} tokens\\)"):
        server.prepare(GenerationRequest(prompt=[5] * (fits + 1), cartridges=["doc"], max_tokens=8))


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["shared-prefix", "plain-cache"])
def test_chunked_prefill_equals_cartridges_generate(model, cartridge_dir, shared_prefix):
    server = Server(model, cartridge_dir, shared_prefix=shared_prefix, prefill_chunk=3)
    doc = server.store.get(("doc",)).cartridge
    ps = prompts(4, seed=8)
    out = server.generate([GenerationRequest(prompt=p, cartridges=["doc"], max_tokens=8) for p in ps])
    for p, completion in zip(ps, out):
        assert completion.token_ids == reference(model, doc, p, 8)


def test_a_cancelled_request_stops_at_the_next_step(model, cartridge_dir):
    from cartridges.engine import BatchRun

    server = Server(model, cartridge_dir)
    batch = [
        server.prepare(GenerationRequest(prompt=p, cartridges=["doc"], max_tokens=64, ignore_eos=True))
        for p in prompts(2, seed=9)
    ]
    run = BatchRun(server, batch, None, [0, 1])
    for _ in range(4):
        assert not run.advance()
    batch[0].cancel()
    units = 0
    while not run.advance():
        units += 1
    gone, kept = run.results
    assert gone.finish_reason == "cancelled" and len(gone.token_ids) < 16
    assert kept.finish_reason == "length" and len(kept.token_ids) == 64
    run = BatchRun(server, batch[:1], None, [0])  # every request gone: the batch ends at its first unit
    assert run.advance() and run.results[0].finish_reason == "cancelled"
    assert server.stats["cancelled"] == 2


def test_shared_prefix_cache_counts_the_prefix_once():
    prefix = torch.zeros(2, 2, 100, 8)
    cache = SharedPrefixCache(prefix, prefix, 64, 10, 2, 2, 8, torch.float32, torch.device("cpu"))
    assert cache.memory_bytes() == 2 * prefix.numel() * 4 + 2 * 2 * 64 * 2 * 10 * 8 * 4


# ---- the HTTP server


url_servers: dict[str, Server] = {}


@pytest.fixture(scope="module")
def url(model, cartridge_dir, serve_app):
    """The real uvicorn server in a thread on a free loopback port."""
    server = Server(model, cartridge_dir, ByteTokenizer(), max_batch_size=64)
    with serve_app(build_app(server, "tiny", max_body_bytes=4096)) as url:
        url_servers[url] = server
        yield url


def completion(url, prompt, cartridges=("doc",), **extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    body["cartridges"] = [{"id": c} for c in cartridges]
    return httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=30)


def test_completion_with_a_cartridge_equals_python(url, model, cartridge_dir):
    doc = Cartridge.load(cartridge_dir / "doc.safetensors", model)
    p = prompts(1, seed=5)[0]
    r = completion(url, p)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    expected = reference(model, doc, p)
    assert choice["token_ids"] == expected
    assert choice["text"] == ByteTokenizer().decode(expected)
    assert choice["finish_reason"] == ("length" if len(expected) == MAX_TOKENS else "stop")
    assert body["usage"] == {
        "prompt_tokens": len(p),
        "completion_tokens": len(expected),
        "total_tokens": len(p) + len(expected),
    }


def test_chat_completion_and_streaming(url, model, cartridge_dir):
    body = {
        "messages": [{"role": "user", "content": "Where is Quellmere?"}],
        "cartridges": [{"id": "doc"}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "assistant"
    tok = ByteTokenizer()
    from cartridges.corpus import turn_ids

    doc = Cartridge.load(cartridge_dir / "doc.safetensors", model)
    ids = torch.tensor([turn_ids(tok, body["messages"], add_generation_prompt=True)])
    expected = generate(model, doc, ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, ids.shape[1] :]
    assert message["content"] == tok.decode(expected)

    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line:
                assert line.startswith("data: ")
                chunks.append(line[len("data: ") :])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len(events) > 3  # the text arrived in pieces
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == message["content"]


def test_stop_strings_seed_and_top_p(url):
    p = prompts(1, seed=6)[0]
    full = completion(url, p, max_tokens=16, ignore_eos=True).json()["choices"][0]
    stop = full["text"][3:5]
    cut = completion(url, p, max_tokens=16, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][: full["text"].find(stop)]
    sampled = [completion(url, p, temperature=1.5, seed=s, ignore_eos=True).json()["choices"][0] for s in (7, 7, 8)]
    assert sampled[0]["token_ids"] == sampled[1]["token_ids"] != sampled[2]["token_ids"]
    nucleus = completion(url, p, temperature=1.5, top_p=1e-6, seed=9, ignore_eos=True).json()["choices"][0]
    assert nucleus["token_ids"] == completion(url, p, ignore_eos=True).json()["choices"][0]["token_ids"]


def test_listing_endpoints(url):
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny"]
    assert httpx.get(f"{url}/v1/models/tiny").json() == httpx.get(f"{url}/v1/models").json()["data"][0]
    listed = {c["id"]: c for c in httpx.get(f"{url}/v1/cartridges").json()["data"]}
    assert set(listed) == {"doc", "other", "broken"}
    assert listed["doc"]["num_tokens"] == DOC and listed["doc"]["kind"] == "kv"


@pytest.mark.parametrize(
    "method, path, status",
    [("get", "/v1/models/other", 404), ("get", "/v1/nothing", 404), ("get", "/v1/completions", 405)],
    ids=["unknown-model", "unknown-path", "wrong-method"],
)
def test_errors_have_the_openai_shape(url, method, path, status):
    reply = getattr(httpx, method)(f"{url}{path}")
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["code"] == status and error["type"]
    assert path.rsplit("/", 1)[-1] in error["message"]  # it names what was not found


def test_bad_input_is_refused_and_the_server_stays_up(url):
    post = lambda path, **kw: httpx.post(f"{url}{path}", timeout=30, **kw)  # noqa: E731
    ok = {"prompt": [5, 6, 7], "max_tokens": 2, "cartridges": [{"id": "doc"}]}
    cases = [
        ("/v1/completions", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 400),
        ("/v1/completions", {"content": b"[1, 2]", "headers": JSON}, 400),
        ("/v1/completions", {"json": {"max_tokens": 2}}, 400),  # no prompt
        ("/v1/completions", {"json": {**ok, "max_tokens": -1}}, 400),
        ("/v1/completions", {"json": {**ok, "temperature": "hot"}}, 400),
        ("/v1/completions", {"json": {**ok, "cartridge": [{"id": "doc"}]}}, 400),  # misspelt field
        ("/v1/completions", {"json": {**ok, "n": 2}}, 400),
        ("/v1/completions", {"json": {**ok, "prompt": [5, 999]}}, 400),  # outside the vocabulary
        ("/v1/chat/completions", {"json": {"messages": []}}, 400),
        ("/v1/chat/completions", {"json": {"messages": [{"role": "robot", "content": "hi"}]}}, 400),
        ("/v1/completions", {"json": {**ok, "cartridges": [{"id": "nope"}]}}, 404),
        ("/v1/completions", {"json": {**ok, "model": "gpt-5"}}, 404),
        ("/v1/completions", {"json": {**ok, "cartridges": [{"id": "broken"}]}}, 400),  # unreadable file
        ("/v1/completions", {"content": b'{"prompt": "' + b"x" * 5000 + b'"}', "headers": JSON}, 413),
        ("/v1/completions", {"content": iter([b'{"prompt": "', b"x" * 6000, b'"}']), "headers": JSON}, 413),  # chunked
    ]
    for bad in ("../outside", "..", "sub/../doc", "/etc/passwd", "..\\outside", "%2e%2e/outside"):
        cases.append(("/v1/completions", {"json": {**ok, "cartridges": [{"id": bad}]}}, 400))
    for path, kwargs, status in cases:
        r = post(path, **kwargs)
        assert r.status_code == status, (kwargs, r.status_code, r.text)
        assert r.json()["error"]["message"], r.text
    assert post("/v1/completions", json=ok).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_64_concurrent_clients_are_batched_and_answered(url, model, cartridge_dir):
    doc = Cartridge.load(cartridge_dir / "doc.safetensors", model)
    both = Cartridge.concat([doc, Cartridge.load(cartridge_dir / "other" / "cartridge.safetensors", model)])
    ps = prompts(64, seed=11)
    sets = [("doc",) if i % 2 else ("doc", "other") for i in range(64)]

    async def ask(client, p, ids):
        body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
        r = await client.post(f"{url}/v1/completions", json={**body, "cartridges": [{"id": i} for i in ids]})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def everyone():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(ask(client, p, ids) for p, ids in zip(ps, sets)))

    before = dict(url_servers[url].stats)
    answers = asyncio.run(everyone())
    stats = url_servers[url].stats
    assert stats["requests"] - before["requests"] == 64
    assert stats["batches"] - before["batches"] < 16 and stats["largest_batch"] >= 8  # batched, not one by one
    for p, ids, got in zip(ps, sets, answers):
        assert got == reference(model, doc if ids == ("doc",) else both, p)


def test_cli_refuses_a_missing_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "tiny-llama", "--cartridges", str(tmp_path / "none"), "--port", "0"])
    assert exit_info.value.code == 2 and "not a directory" in capsys.readouterr().err


def test_state_cartridges_take_the_plain_path(tmp_path):
    """A recurrent Zoo model's state cartridge serves through `as_cache`, equal to the corpus in context."""
    from cartridges.state import StateCartridge
    from zoo.models.hf import ZooConfig, ZooForCausalLM

    config = ZooConfig(
        n_layers=2,
        pattern=["base_conv", "based"],
        mixers={"based": {"feature_dim": 4, "num_heads": 2, "chunk_size": 16}},
        d_model=32,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    zoo_model = ZooForCausalLM(config).eval().requires_grad_(False)
    corpus = torch.randint(3, 512, (20,), generator=torch.Generator().manual_seed(1))
    StateCartridge.from_prefix(zoo_model, corpus).save(tmp_path / "state.safetensors")
    server = Server(zoo_model, tmp_path)
    assert not server.shared_prefix
    ps = [[5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]  # two lengths: two batches
    out = server.generate([GenerationRequest(prompt=p, cartridges=["state"], max_tokens=5) for p in ps])
    for p, completion in zip(ps, out):
        full = zoo_model.generate(torch.tensor([corpus.tolist() + p]), max_new_tokens=5, do_sample=False)
        expected = full[0, len(corpus) + len(p) :].tolist()
        assert completion.token_ids == (expected[: expected.index(EOS)] if EOS in expected else expected)
    assert server.stats["batches"] == 2
