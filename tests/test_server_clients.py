"""What real clients send and expect, against a live server (issue 40): openai's `parse()` and
`models.retrieve`, langchain's `with_structured_output`, JSON answers that say they stopped, nulls where
OpenAI's spec allows them, content parts in every role, HEAD probes, 405s with Allow, the bearer scheme in
any case, an offline /docs, a strict Host check."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from live_server import KEY, LiveServer  # noqa: E402
from pydantic import BaseModel  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
FAST = {"max_denoising_steps": 3}
CHAT = "/v1/chat/completions"


class CalendarEvent(BaseModel):
    """OpenAI's structured-output example, as a client writes it."""

    name: str
    date: str
    participants: list[str]


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(server, path: str, body: dict, headers=None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={**AUTH, **(headers or {})}, timeout=120)


def _user(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


# -- structured output through the SDKs: a finished answer says "stop" ----------------------------------------


def test_openai_parse_returns_the_model(client):
    for seed in range(2):
        r = client.chat.completions.parse(
            model="tiny",
            messages=_user("Alice and Bob meet on Friday."),
            response_format=CalendarEvent,
            seed=seed,
            extra_body=FAST,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, CalendarEvent)


def test_openai_parse_with_the_schemas_pydantic_writes(client):
    """Nested models, Optional, Enum, Literal, a list of models, a union, a recursive model, dates and UUIDs:
    openai's parse() sends them in its strict form ($defs + $ref, anyOf with null, every key required)."""
    from test_schemas_pydantic import Node, Order, Stamped

    for model_class in (Order, Node, Stamped):
        r = client.chat.completions.parse(
            model="tiny", messages=_user("An order, please."), response_format=model_class, seed=0, extra_body=FAST
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model_class), model_class


def test_a_streamed_json_answer_ends_with_stop(server):
    schema = CalendarEvent.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "event", "schema": schema}}
    body = {"messages": _user(), "response_format": fmt, "stream": True, "seed": 0, **FAST}
    with httpx.stream("POST", server.url + CHAT, json=body, headers=AUTH, timeout=120) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    CalendarEvent.model_validate_json(text)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    small = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": small}}
    answer = _post(server, CHAT, {"messages": _user(), "response_format": fmt, "seed": 0, **FAST}).json()
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    assert isinstance(json.loads(answer["choices"][0]["message"]["content"])["a"], int)


def test_langchain_with_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(
        model="tiny", base_url=server.url + "/v1", api_key=KEY, extra_body=FAST, max_retries=0, seed=0
    )
    for method in ("json_schema", "function_calling"):
        event = chat.with_structured_output(CalendarEvent, method=method).invoke("Alice meets Bob on Friday.")
        assert isinstance(event, CalendarEvent), method


# -- the routes clients and load balancers call ---------------------------------------------------------------


def test_models_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("google/other-model")
    assert e.value.body["code"] == "model_not_found"


def test_head_probes_and_405s_that_say_what_is_allowed(server):
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200 and head.content == b""
    assert httpx.head(server.url + "/v1/models", headers=AUTH).status_code == 200
    wrong = httpx.post(server.url + "/health", headers=AUTH)
    assert wrong.status_code == 405 and "GET" in wrong.headers["allow"]
    assert wrong.json()["error"]["message"]
    assert "POST" in httpx.get(server.url + CHAT, headers=AUTH).headers["allow"]


@pytest.mark.parametrize("header, status", [("bearer", 200), ("BEARER", 200), ("Bearer ", 200), ("Basic", 401)])
def test_the_bearer_scheme_is_case_insensitive(server, header, status):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{header} {KEY}"})
    assert r.status_code == status


def test_docs_load_nothing_from_outside(server):
    page = httpx.get(server.url + "/docs", headers=AUTH)
    assert page.status_code == 200 and "/docs/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text.replace("https://fastapi", "")
    script = httpx.get(server.url + "/docs/swagger-ui-bundle.js", headers=AUTH)
    assert script.status_code == 200 and "SwaggerUIBundle" in script.text
    assert httpx.get(server.url + "/docs/../openapi.json", headers=AUTH).status_code in (200, 404)
    assert httpx.get(server.url + "/docs/secret.txt", headers=AUTH).status_code == 404


def test_the_host_check_takes_only_a_host_and_a_port(model_dir):
    from helpers import load_quiet

    from dgemma.checkpoints.tokenizer import Tokenizer
    from dgemma.server.app import create_app

    app = create_app(load_quiet(model_dir), Tokenizer.from_dir(model_dir), model_name="tiny", check_host=True)
    with LiveServer(app) as live:
        for host in ("localhost", "127.0.0.1:8000", "[::1]", f"[::1]:{live.port}", "LOCALHOST"):
            assert httpx.get(live.url + "/health", headers={"Host": host}).status_code == 200, host
        for host in ("[::1]evil.example", "[::1]:80evil", "localhost:abc", "localhost.evil.example", "a@localhost"):
            r = httpx.get(live.url + "/health", headers={"Host": host})
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host


# -- what a request may leave null, and content parts in every role --------------------------------------------


def test_null_means_not_sent(server):
    nulls = {"n": None, "stream": None, "stop": None, "seed": None, "temperature": None, "top_p": None}
    nulls |= {"logit_bias": None, "presence_penalty": None, "frequency_penalty": None, "stream_options": None}
    nulls |= {"user": None, "response_format": None, "max_completion_tokens": None, "logprobs": None}
    nulls |= {"store": None, "metadata": None, "service_tier": None, "modalities": None, "parallel_tool_calls": None}
    nulls |= {"tools": None, "tool_choice": None, "top_logprobs": None, "reasoning_effort": None}
    r = _post(server, CHAT, {"messages": _user(), "max_tokens": 3, **FAST, **nulls})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    for key in ("echo", "suffix", "best_of", "logprobs", "n", "stream", "seed", "stop"):
        body = {"prompt": "a", "max_tokens": 3, key: None, **FAST}
        assert _post(server, "/v1/completions", body).status_code == 200, key
    message = {"role": "user", "content": "hi", "name": None, "tool_calls": None, "refusal": None}
    assert _post(server, CHAT, {"messages": [message], "max_tokens": 3, **FAST}).status_code == 200
    assert _post(server, CHAT, {"messages": _user(), "store": True, "max_tokens": 3}).status_code == 400


def _prompt_tokens(server, messages: list[dict]) -> int:
    r = _post(server, CHAT, {"messages": messages, "max_tokens": 2, **FAST})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def _parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def test_content_parts_reach_every_role_as_text(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    for role in ("system", "developer"):
        as_text = _prompt_tokens(server, [{"role": role, "content": "Be brief.\nAnswer."}, *_user()])
        as_parts = _prompt_tokens(server, [{"role": role, "content": _parts("Be brief.", "Answer.")}, *_user()])
        assert as_parts == as_text, role
    replay = [*_user(), {"role": "assistant", "content": None, "tool_calls": [call]}]
    as_text = _prompt_tokens(server, [*replay, {"role": "tool", "tool_call_id": "c1", "content": "42"}])
    as_parts = _prompt_tokens(server, [*replay, {"role": "tool", "tool_call_id": "c1", "content": _parts("42")}])
    assert as_parts == as_text
    assistant = [*_user(), {"role": "assistant", "content": _parts("Hello.")}, *_user()]
    assert _prompt_tokens(server, assistant) == _prompt_tokens(
        server, [*_user(), {"role": "assistant", "content": "Hello."}, *_user()]
    )


def test_the_library_renders_parts_as_text_too(model_dir):
    from dgemma.checkpoints.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    parts = [{"role": "system", "content": _parts("A", "B")}, *_user()]
    assert tok.render_chat(parts) == tok.render_chat([{"role": "system", "content": "A\nB"}, *_user()])
    with pytest.raises(ValueError, match="text parts only"):
        tok.render_chat([{"role": "system", "content": [{"type": "image", "image": None}]}, *_user()])


def test_temperature_zero_is_greedy_and_repeatable(server):
    """temperature 0: the argmax at each accepted position, from seed 0 unless a seed is given, so the same
    request gives the same answer (a canvas starts from random tokens); other temperatures still draw."""
    body = {"messages": _user(), "max_tokens": 12, "temperature": 0, **FAST}
    texts = [_post(server, CHAT, body).json()["choices"][0]["message"]["content"] for _ in range(2)]
    same = _post(server, CHAT, {**body, "temperature": None, "greedy": True, "seed": 0}).json()
    assert texts[0] == texts[1] == same["choices"][0]["message"]["content"]
    exact = _post(server, CHAT, {**body, "mode": "exact"})
    assert exact.status_code == 400 and "greedy" in exact.json()["error"]["message"]
