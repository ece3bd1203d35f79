"""The OpenAI response objects that the HTTP front builds (`cartridges.replies.Reply`): bodies, stream chunks and
stream errors, without a server."""

import json

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra (fastapi, uvicorn) is not installed")

from cartridges.engine import Completion, ServeError  # noqa: E402
from cartridges.replies import Reply  # noqa: E402

DONE = Completion(token_ids=[5, 6, 7], text="abc", finish_reason="length", prompt_tokens=4)


def event(chunk: str) -> dict:
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    return json.loads(chunk[len("data: "):])


@pytest.mark.parametrize("kind, obj, key",
                         [("chat", "chat.completion", "message"), ("text", "text_completion", "text")])
def test_a_whole_body_has_the_openai_names_and_usage(kind, obj, key):
    body = Reply(kind, "tiny").whole(DONE)
    assert body["object"] == obj and body["model"] == "tiny"
    assert body["id"].startswith("chatcmpl-" if kind == "chat" else "cmpl-")
    (choice,) = body["choices"]
    assert key in choice and choice["finish_reason"] == "length" and "token_ids" not in choice
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_token_ids_are_added_only_when_asked():
    (choice,) = Reply("text", "tiny", token_ids=True).whole(DONE)["choices"]
    assert choice["token_ids"] == [5, 6, 7]


@pytest.mark.parametrize("kind, obj, opening", [("chat", "chat.completion.chunk", 1), ("text", "text_completion", 0)])
def test_stream_chunks_are_named_per_kind_and_chat_opens_with_the_role(kind, obj, opening):
    reply = Reply(kind, "tiny")
    chunks = [event(c) for c in reply.opening() + [reply.chunk([reply.choice("ab", None, None, True)])]]
    assert len(chunks) == opening + 1 and all(c["object"] == obj and c["id"] == reply.id for c in chunks)
    if kind == "chat":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[1]["choices"][0]["delta"] == {"content": "ab"}
    else:
        assert chunks[0]["choices"][0]["text"] == "ab"


@pytest.mark.parametrize("usage", [False, True], ids=["without-usage", "with-usage"])
def test_the_stream_ends_with_the_finish_reason_then_the_usage_when_asked(usage):
    chunks = [event(c) for c in Reply("chat", "tiny").ending(DONE, usage)]
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) == 1 + usage
    if usage:
        assert chunks[1]["choices"] == [] and chunks[1]["usage"]["total_tokens"] == 7


@pytest.mark.parametrize("err, message, code", [(ServeError("prompt too long"), "prompt too long", 400),
                                                (KeyError("secret"), "internal error: KeyError", 500)],
                         ids=["serve-error", "internal-error"])
def test_a_stream_error_says_what_a_client_may_know(err, message, code):
    assert event(Reply.error_chunk(err)) == {"error": {"message": message, "code": code}}
