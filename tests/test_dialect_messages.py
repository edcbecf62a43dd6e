"""Anthropic's Messages API on a live server, through the real `anthropic` SDK and langchain-anthropic:
text, streams, a tool_use -> tool_result round trip, structured output, count_tokens, and errors in
Anthropic's shape (issue 57). Its hostile bodies, each a 4xx in that shape naming the field, are
tests/hostile.py's DIALECTS, replayed by test_server_fuzz.py."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")
from live_server import KEY  # noqa: E402
from pydantic import BaseModel  # noqa: E402

FAST = {"dgemma": {"max_denoising_steps": 3}}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture()
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _user(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_messages_create_answers_text(client):
    m = client.messages.create(model="tiny", max_tokens=8, messages=_user(), system="Be brief.", extra_body=FAST)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert all(block.type == "text" for block in m.content)
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 8


def test_messages_stream_gives_the_events_the_sdk_assembles(client):
    with client.messages.stream(model="tiny", max_tokens=8, messages=_user(), extra_body=FAST) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    assert text == "".join(b.text for b in final.content if b.type == "text")


def test_a_stop_sequence_is_reported(client):
    m = client.messages.create(
        model="tiny", max_tokens=24, messages=_user(), stop_sequences=["e", "a", "o", "i"], extra_body=FAST
    )
    if m.stop_reason == "stop_sequence":
        assert m.stop_sequence in ("e", "a", "o", "i")
        assert not any(s in b.text for b in m.content for s in "eaoi")


def test_a_tool_use_round_trip(client):
    m = client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=_user("Weather in Paris?"),
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body=FAST,
    )
    assert m.stop_reason == "tool_use"
    call = next(b for b in m.content if b.type == "tool_use")
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    history = [
        *_user("Weather in Paris?"),
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]},
    ]
    after = client.messages.create(model="tiny", max_tokens=200, messages=history, tools=[WEATHER], extra_body=FAST)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_a_named_tool_streams_its_input_as_json_deltas(client):
    with client.messages.stream(
        model="tiny",
        max_tokens=200,
        messages=_user(),
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=FAST,
    ) as stream:
        final = stream.get_final_message()
    call = next(b for b in final.content if b.type == "tool_use")
    assert final.stop_reason == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_structured_output_by_output_config(client):
    schema = Person.model_json_schema()
    m = client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=_user("Alice, 30"),
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=FAST,
    )
    Person.model_validate_json(m.content[0].text)


def test_count_tokens_is_the_prompt_a_create_would_have(client):
    counted = client.messages.count_tokens(model="tiny", messages=_user("hello there"), system="Be brief.")
    m = client.messages.create(
        model="tiny", max_tokens=4, messages=_user("hello there"), system="Be brief.", extra_body=FAST
    )
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0  # what the cache gave


def test_an_image_block_is_chats_image_part(vision_server):
    """A base64 image block is the chat image_url part: the same tokens as chat gives, and count_tokens counts
    the image's soft tokens."""
    import base64

    from test_server_images import _png, _url

    url, settings = _url(_png(64, 48, 1)), {"seed": 3, "max_denoising_steps": 3}
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this?"}]
    chat = {"messages": [{"role": "user", "content": parts}], "max_tokens": 6, **settings}
    headers = {"x-api-key": KEY}
    expected = httpx.post(vision_server.url + "/v1/chat/completions", json=chat, headers=headers, timeout=120).json()
    data = base64.b64encode(_png(64, 48, 1)).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    body = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "what is this?"}]}]}
    answer = httpx.post(
        vision_server.url + "/v1/messages", json={**body, "max_tokens": 6, "dgemma": settings}, headers=headers
    ).json()
    assert answer["content"][0]["text"] == expected["choices"][0]["message"]["content"]
    counted = httpx.post(vision_server.url + "/v1/messages/count_tokens", json=body, headers=headers).json()
    read = answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"]  # the chat's image: cached
    assert counted["input_tokens"] == read == expected["usage"]["prompt_tokens"]


def test_langchain_anthropic_chat_model(server):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    llm = langchain_anthropic.ChatAnthropic(
        model="tiny", base_url=server.url, api_key=KEY, max_tokens=200, max_retries=0, model_kwargs={"extra_body": FAST}
    )
    reply = llm.invoke("hi")
    assert isinstance(reply.content, str | list)
    person = llm.with_structured_output(Person).invoke("Alice is 30.")
    assert isinstance(person, Person)


def test_errors_are_in_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tiny", max_tokens=10**7, messages=_user())
    assert caught.value.body["type"] == "error" and "max_tokens" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus", max_tokens=8, messages=_user())
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=8, messages=_user()
        )
