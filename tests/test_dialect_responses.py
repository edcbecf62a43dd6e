"""OpenAI's Responses API (POST /v1/responses) against a live server, with the clients that speak it: the
`openai` SDK (`responses.create`, `.stream`, `.parse`, a function tool round trip) and the `openai-agents` SDK
(an Agent with one function tool run to its final output). The route's hostile bodies are tests/hostile.py's
DIALECTS, replayed by test_server_fuzz.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from live_server import KEY  # noqa: E402
from pydantic import BaseModel  # noqa: E402

PATH = "/v1/responses"
FAST = {"dgemma": {"max_denoising_steps": 3}}
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


class CalendarEvent(BaseModel):
    name: str
    date: str
    participants: list[str]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _create(client, **kw):
    return client.responses.create(model="tiny", extra_body=FAST, **{"input": "Hello", **kw})


def _check_usage(r) -> None:
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens >= 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens and u.output_tokens_details.reasoning_tokens == 0


# -- answers -----------------------------------------------------------------------------------------------------


def test_a_string_input_gives_a_message(client):
    r = _create(client, max_output_tokens=8)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status in ("completed", "incomplete") and [o.type for o in r.output] == ["message"]
    (message,) = r.output
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert isinstance(r.output_text, str) and message.content[0].annotations == []
    assert r.tool_choice == "auto" and r.tools == [] and r.parallel_tool_calls is True
    _check_usage(r)


def test_items_instructions_and_replayed_answers_are_a_conversation(client):
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello!", "annotations": []}],
        },
        {"role": "user", "content": "And now?"},
    ]
    r = _create(client, input=items, max_output_tokens=8)
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    r = _create(client, input=items[1:], instructions="Be brief.", max_output_tokens=8)
    assert r.instructions == "Be brief." and r.output[0].type == "message"


def test_a_cut_answer_is_incomplete_for_max_output_tokens(client):
    r = client.responses.create(
        model="tiny",
        input="Count.",
        max_output_tokens=2,
        extra_body={"dgemma": {"max_denoising_steps": 3, "ignore_eos": True}},
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 2


def test_parse_gives_the_pydantic_model(client):
    for seed in range(2):
        r = client.responses.parse(
            model="tiny",
            input="Alice and Bob meet on Friday.",
            text_format=CalendarEvent,
            extra_body={"dgemma": {"max_denoising_steps": 3, "seed": seed}},
        )
        assert r.status == "completed" and isinstance(r.output_parsed, CalendarEvent)
        assert r.text.format.type == "json_schema"


def test_a_json_object_format_gives_an_object_or_a_422(client):
    for seed in range(3):
        try:
            r = client.responses.create(
                model="tiny",
                input="A JSON object, please.",
                text={"format": {"type": "json_object"}},
                max_output_tokens=16,
                extra_body={"dgemma": {"max_denoising_steps": 3, "seed": seed, "retries": 0}},
            )
        except openai.UnprocessableEntityError as e:  # no valid object in its attempts: named in this dialect
            assert e.body["param"] == "text.format", e.body
        else:
            assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


# -- streams -----------------------------------------------------------------------------------------------------


def test_a_stream_is_the_responses_event_sequence(client):
    events = list(_create(client, max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(d.delta for d in deltas) == done.text == events[-1].response.output_text
    assert all(d.item_id == done.item_id and d.output_index == 0 and d.content_index == 0 for d in deltas)
    _check_usage(events[-1].response)


def test_the_stream_helper_gives_the_final_response(client):
    with client.responses.stream(
        model="tiny", input="Alice meets Bob.", text_format=CalendarEvent, extra_body=FAST
    ) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, CalendarEvent)
    assert "".join(texts) == final.output_text


def test_a_streamed_call_arrives_as_function_call_events(client):
    with client.responses.stream(
        model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", extra_body=FAST
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]


def test_every_event_and_answer_validates_as_the_sdks_types(server):
    """Each event of a text stream and of a call stream, and the answers, are what openai's own pydantic
    types (openai.types.responses) validate: every required field, every literal."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    events = TypeAdapter(ResponseStreamEvent)
    bodies = [
        {"input": "Hi", "max_output_tokens": 8},
        {"input": "Weather?", "tools": [WEATHER], "tool_choice": "required"},
        {
            "input": [{"role": "user", "content": "Hi"}],
            "text": {"format": {"type": "json_schema", "name": "e", "schema": CalendarEvent.model_json_schema()}},
        },
    ]
    for body in bodies:
        body = {**body, **FAST}
        answer = httpx.post(server.url + PATH, json=body, headers=AUTH, timeout=120).json()
        Response.model_validate(answer)
        with httpx.stream("POST", server.url + PATH, json={**body, "stream": True}, headers=AUTH, timeout=120) as r:
            lines = list(r.iter_lines())
        names = [line[7:] for line in lines if line.startswith("event: ")]
        data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert names == [d["type"] for d in data] and len(data) > 4
        for d in data:
            events.validate_python(d)
        assert [o["type"] for o in data[-1]["response"]["output"]] == [o["type"] for o in answer["output"]]


def test_a_long_message_is_not_cut_by_the_part_bound():
    from dgemma.server.dialects.responses import MessageItem

    assert len(MessageItem.model_validate({"role": "user", "content": "a" * 5000}).content) == 5000


def test_an_error_mid_stream_is_an_error_event_then_failed():
    """A choice that ends in an error (a timeout, a shutdown) after some text: the `error` event, then
    response.failed carrying it; openai's stream types validate both."""
    from types import SimpleNamespace

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from dgemma.server.dialects import Renames
    from dgemma.server.dialects.responses import ResponsesRequest, _events, _Response
    from dgemma.server.protocol import ApiError
    from dgemma.server.runs import Piece

    async def pieces():
        yield Piece(0, "content", "Hel")
        yield Piece(0, "end", error=ApiError(504, "the request timed out", kind="timeout_error", code="timeout"))

    async def collect(response):
        return [e async for e in _events(response, pieces())]

    started = SimpleNamespace(choices=[], prompt_tokens=3)
    body = ResponsesRequest.model_validate({"input": "x"})
    response = _Response(SimpleNamespace(name="tiny"), body, started, Renames({}))
    events = asyncio.run(collect(response))
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2]["code"] == "timeout" and events[-1]["response"]["error"]["message"] == "the request timed out"
    assert events[-1]["response"]["status"] == "failed" and response.error.status == 504
    for e in events:
        TypeAdapter(ResponseStreamEvent).validate_python(json.loads(json.dumps(e)))


def test_items_map_onto_chat_messages():
    """Consecutive calls after an answer's text are one assistant message; outputs are tool messages; each
    message knows the item it came from (what errors name)."""
    from dgemma.server.dialects.responses import ResponsesRequest, chat_fields

    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    items = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
        },
        {**call, "arguments": '{"city": "Paris"}'},
        {**call, "call_id": "c2", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "9 C"}]},
    ]
    body = ResponsesRequest.model_validate(
        {"input": items, "instructions": "Be brief.", "max_output_tokens": 9, "dgemma": {"seed": 3}}
    )
    fields, rename = chat_fields(body)
    roles = [m["role"] for m in fields["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    calls = fields["messages"][2]["tool_calls"]
    assert [c["id"] for c in calls] == ["c1", "c2"] and calls[1]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Oslo"},
    }
    assert fields["messages"][4]["content"] == [{"type": "text", "text": "9 C"}]
    assert (fields["max_tokens"], fields["seed"]) == (9, 3)
    assert rename("messages.3.content") == "input.4.content" and rename("messages.0") == "instructions"
    assert rename("max_tokens") == "max_output_tokens" and rename("seed") == "dgemma.seed"


def test_the_same_request_gives_the_same_text_as_chat(server):
    """Responses is a mapping: the same conversation and settings give chat's tokens."""
    settings = {"seed": 5, "max_denoising_steps": 3}
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 12,
            **settings,
        },
        headers=AUTH,
        timeout=120,
    ).json()
    body = {"instructions": "Be brief.", "input": "Hi", "max_output_tokens": 12, "dgemma": settings}
    answer = httpx.post(server.url + PATH, json=body, headers=AUTH, timeout=120).json()
    assert answer["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert answer["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    assert answer["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_an_input_image_is_chats_image_part(vision_server):
    """An input_image (a data: URL) is the chat image_url part: the same tokens as chat gives."""
    from test_server_images import _png, _url

    url, settings = _url(_png(64, 48, 1)), {"seed": 3, "max_denoising_steps": 3}
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this?"}]
    chat = {"messages": [{"role": "user", "content": parts}], "max_tokens": 6, **settings}
    expected = httpx.post(vision_server.url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=120).json()
    content = [
        {"type": "input_image", "image_url": url, "detail": "auto"},
        {"type": "input_text", "text": "what is this?"},
    ]
    body = {"input": [{"role": "user", "content": content}], "max_output_tokens": 6, "dgemma": settings}
    answer = httpx.post(vision_server.url + PATH, json=body, headers=AUTH, timeout=120).json()
    assert answer["output"][0]["content"][0]["text"] == expected["choices"][0]["message"]["content"]
    assert answer["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]


# -- tools -------------------------------------------------------------------------------------------------------


def test_a_function_tool_round_trip(client):
    r = _create(client, input="Weather in Paris?", tools=[WEATHER], tool_choice="required")
    (call,) = r.output
    assert r.status == "completed" and call.type == "function_call" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    # tool_choice "auto": the length must hold the shortest call (else a 400 naming max_output_tokens)
    r = _create(client, input=history, tools=[WEATHER], max_output_tokens=96)
    assert r.status in ("completed", "incomplete")
    assert all(o.type in ("message", "function_call") for o in r.output)


def test_a_named_function_is_called(client):
    r = _create(client, input="Time?", tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_time"})
    (call,) = r.output
    assert (call.name, json.loads(call.arguments)) == ("get_time", {})
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_time"


def test_none_offers_no_tools(client):
    r = _create(client, tools=[WEATHER], tool_choice="none", max_output_tokens=8)
    assert [o.type for o in r.output] == ["message"]


# -- openai-agents -----------------------------------------------------------------------------------------------


def _agent(server, calls: list, **settings):
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "18 C and sunny"

    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    settings = agents.ModelSettings(extra_body=FAST, **settings)
    model = OpenAIResponsesModel("tiny", aclient)
    return agents, agents.Agent(
        name="weather", instructions="Be brief.", tools=[get_weather], model=model, model_settings=settings
    )


def test_an_agent_runs_its_tool_to_the_final_output(server):
    """A required first call (made by construction); the tool's result is the run's final output."""
    calls: list = []
    agents, agent = _agent(server, calls, tool_choice="required")
    agent.tool_use_behavior = "stop_on_first_tool"
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
    assert calls and result.final_output == "18 C and sunny"


def test_an_agent_with_auto_tool_choice_finishes_or_has_called(server):
    """tool_choice auto: the model answers or calls; either the run ends with text, or a tool ran."""
    calls: list = []
    agents, agent = _agent(server, calls, max_tokens=96)
    try:
        result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
    except agents.exceptions.MaxTurnsExceeded:
        assert calls
    else:
        assert isinstance(result.final_output, str)


def test_a_streamed_agent_run(server):
    calls: list = []
    agents, agent = _agent(server, calls, tool_choice="required")
    agent.tool_use_behavior = "stop_on_first_tool"

    async def run():
        result = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert calls and result.final_output == "18 C and sunny" and "raw_response_event" in kinds


# -- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 3}, "max_output_tokens"),
        ({"top_p": 0.5}, "top_p"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "\\1"}}}},
            "text.format.schema",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", **extra)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_with_stop_is_refused_before_any_work(server, stream):
    body = {"input": "x", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 3, "stream": stream}
    r = httpx.post(server.url + PATH, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
