"""The request schemas of the HTTP front (`cartridges.http`): OpenAI fields the server does not implement are
accepted at the no-op values clients send by default, and refused at any other value, never ignored."""

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra (fastapi, uvicorn) is not installed")
from pydantic import ValidationError  # noqa: E402

from cartridges.http import _schemas  # noqa: E402
from cartridges.replies import chat_messages  # noqa: E402

Chat, Text = _schemas()
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TEXT = {"prompt": "hi"}

NO_OPS = {
    "chat-presence_penalty": (Chat, {"presence_penalty": 0.0}),
    "chat-logit_bias-empty": (Chat, {"logit_bias": {}}),
    "chat-logit_bias-null": (Chat, {"logit_bias": None}),
    "chat-response_format-text": (Chat, {"response_format": {"type": "text"}}),
    "chat-tools-empty": (Chat, {"tools": []}),
    "chat-tool_choice-none": (Chat, {"tool_choice": "none"}),
    "chat-top_logprobs-0": (Chat, {"top_logprobs": 0}),
    "text-best_of-1": (Text, {"best_of": 1}),
    "text-suffix-empty": (Text, {"suffix": ""}),
    "text-logit_bias-empty": (Text, {"logit_bias": {}}),
}

REFUSED = {
    "chat-logit_bias": (Chat, {"logit_bias": {"42": 5.0}}, "logit_bias"),
    "chat-response_format-json": (Chat, {"response_format": {"type": "json_object"}}, "response_format"),
    "chat-tools": (Chat, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    "chat-tool_choice-auto": (Chat, {"tool_choice": "auto"}, "tool_choice"),
    "chat-top_logprobs-5": (Chat, {"top_logprobs": 5}, "top_logprobs"),
    "text-best_of-2": (Text, {"best_of": 2}, "best_of"),
    "text-suffix": (Text, {"suffix": "end"}, "suffix"),
    "chat-unknown-field": (Chat, {"temprature": 0.5}, "temprature"),
}


@pytest.mark.parametrize("case", NO_OPS, ids=list(NO_OPS))
def test_a_no_op_value_of_an_unimplemented_field_is_accepted(case):
    schema, extra = NO_OPS[case]
    schema.model_validate((CHAT if schema is Chat else TEXT) | extra)


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_any_other_value_is_refused_naming_the_field(case):
    schema, extra, field = REFUSED[case]
    with pytest.raises(ValidationError) as err:
        schema.model_validate((CHAT if schema is Chat else TEXT) | extra)
    assert err.value.errors()[0]["loc"][0] == field


def test_chat_messages_join_text_parts_and_give_the_developer_role_as_system():
    chat = Chat.model_validate({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Who is "}, {"type": "text", "text": "Merrow?"}]},
    ]})
    assert chat_messages(chat.messages) == [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Who is Merrow?"}]
