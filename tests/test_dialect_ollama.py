"""The Ollama API against a live server, through the `ollama` package and langchain-ollama: chat and generate
(fill-in-the-middle by `suffix`), streamed as NDJSON and not, `format` with a schema, a conversation that
replays a tool call, the model routes (list, show, ps, version) and the load pings. Its hostile bodies, each a
4xx in Ollama's error shape ({"error": "<field>: ..."}), are tests/hostile.py's DIALECTS (test_server_fuzz.py)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import jsonschema
import pytest

ollama = pytest.importorskip("ollama")
pytest.importorskip("uvicorn")
from live_server import KEY  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from dgemma.server.protocol import ApiError  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT, GENERATE, SHOW = "/api/chat", "/api/generate", "/api/show"
FAST = {"max_denoising_steps": 3}  # dgemma settings: under `dgemma`, or in `options` (what clients pass on)
OPTIONS = {"num_predict": 8, **FAST}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class Person(BaseModel):
    name: str
    age: int


def _png() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG = _png()


@pytest.fixture()
def client(server):
    return ollama.Client(host=server.url, headers=AUTH, timeout=120)


def _post(server, path: str, body) -> httpx.Response:
    headers = {**AUTH, "content-type": "application/json"}  # (the body as it is: a lone surrogate stays one)
    return httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=120)


def _finished(r) -> None:
    """The last object of an answer: done, why, and its counts and durations (ns)."""
    assert r.done is True and r.done_reason in ("stop", "length"), r
    assert r.prompt_eval_count > 0 and r.eval_count >= 0
    assert r.total_duration >= r.eval_duration >= 0 and r.prompt_eval_duration >= 0 and r.load_duration == 0


# -- chat and generate through the ollama package ----------------------------------------------------------


def test_chat_whole_and_streamed(client):
    r = client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], options=OPTIONS)
    assert r.message.role == "assistant" and isinstance(r.message.content, str) and r.model == "tiny"
    _finished(r)
    parts = list(
        client.chat(model="tiny:latest", messages=[{"role": "user", "content": "hi"}], stream=True, options=OPTIONS)
    )
    assert all(p.done is False for p in parts[:-1]) and parts[-1].model == "tiny:latest"
    _finished(parts[-1])
    assert isinstance("".join(p.message.content or "" for p in parts), str)


def test_stream_is_ndjson_by_default(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": OPTIONS}
    with httpx.stream("POST", server.url + "/api/chat", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])
    assert all(line["created_at"].endswith("Z") for line in lines)


def test_generate_with_a_suffix_fills_the_middle(client):
    r = client.generate(model="tiny", prompt="def f(x):\n    return ", suffix="\n\nprint(f(2))\n", options=OPTIONS)
    assert isinstance(r.response, str)
    _finished(r)
    chosen = client.generate(model="tiny", prompt="a = ", suffix="\nb = 2\n", options=FAST)  # length by score
    _finished(chosen)
    parts = list(client.generate(model="tiny", prompt="x = ", suffix="\n", stream=True, options=OPTIONS))
    _finished(parts[-1])
    assert isinstance("".join(p.response for p in parts), str)


def test_generate_as_chat_and_raw(client):
    r = client.generate(model="tiny", prompt="Say hi", system="Be brief.", options=OPTIONS)
    _finished(r)
    raw = client.generate(model="tiny", prompt="Once upon a time", raw=True, stream=True, options=OPTIONS)
    _finished(list(raw)[-1])


def test_format_with_a_schema_is_valid_json(client):
    schema = Person.model_json_schema()
    r = client.chat(model="tiny", messages=[{"role": "user", "content": "Alice, 30"}], format=schema, options=FAST)
    jsonschema.validate(json.loads(r.message.content), schema)
    assert r.done_reason == "stop"
    try:  # "json" is any object: one that parses, or a 422 naming format when none did in its retries
        r = client.generate(model="tiny", prompt="A person, as JSON", format="json", options=FAST)
        assert isinstance(json.loads(r.response), dict)
    except ollama.ResponseError as e:
        assert e.status_code == 422 and e.error.startswith("format"), e


def test_a_conversation_replaying_a_tool_call_answers(client):
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21 C", "tool_name": "get_weather"},
    ]
    for stream in (False, True):
        r = client.chat(model="tiny", messages=messages, tools=[WEATHER], stream=stream, options=FAST)
        last = list(r)[-1] if stream else r
        _finished(last)
        for call in last.message.tool_calls or []:  # the tiny model calls a tool only by chance
            assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)


def test_think_is_reasoning(client):
    r = client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], think=True, options=OPTIONS)
    _finished(r)
    assert r.message.thinking is None or isinstance(r.message.thinking, str)


def test_the_model_routes(client, server):
    (listed,) = client.list().models
    assert listed.model == "tiny" and listed.size > 0 and len(listed.digest) == 64
    assert listed.details.family == "gemma4" and listed.details.parameter_size[-1] in "KMB"
    shown = client.show("tiny:latest")
    assert {"completion", "insert"} <= set(shown.capabilities) and ".Suffix" in shown.template
    assert "vision" not in shown.capabilities  # (a vision tower, but a tokenizer without image tokens)
    assert shown.modelinfo["general.architecture"] == "gemma4" and shown.details.format == "safetensors"
    assert _post(server, "/api/show", {"name": "tiny"}).status_code == 200  # Continue's older field
    (running,) = client.ps().models
    assert running.size_vram == 0 and running.expires_at is not None and running.context_length > 0
    assert httpx.get(server.url + "/api/version", headers=AUTH).json()["version"]
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("nope")
    assert caught.value.status_code == 404


def test_load_pings_answer_at_once(server):
    for path, body in (("/api/generate", {"model": "tiny"}), ("/api/chat", {"model": "tiny", "messages": []})):
        r = _post(server, path, body)
        assert r.status_code == 200 and r.json()["done"] is True and r.json()["done_reason"] == "load"


def test_images_reach_a_vision_model(vision_server):
    c = ollama.Client(host=vision_server.url, headers=AUTH, timeout=120)
    r = c.chat(model="tiny", messages=[{"role": "user", "content": "what?", "images": [PNG]}], options=OPTIONS)
    _finished(r)
    _finished(c.generate(model="tiny", prompt="what?", images=[PNG], options=OPTIONS))
    assert "vision" in c.show("tiny").capabilities
    images = [PNG, PNG[:24]]  # the second: a PNG's first bytes, and then nothing
    with pytest.raises(ollama.ResponseError) as caught:
        c.chat(model="tiny", messages=[{"role": "user", "images": images}], options=OPTIONS)
    assert caught.value.status_code == 400 and caught.value.error.startswith("messages.0.images.1"), caught.value
    with pytest.raises(ollama.ResponseError) as caught:
        c.generate(model="tiny", prompt="what?", system="s", images=images, options=OPTIONS)
    assert caught.value.status_code == 400 and caught.value.error.startswith("images.1"), caught.value


def test_bodies_as_continue_and_open_webui_send_them(server):
    fim = {"model": "tiny", "prompt": "def f(", "suffix": "):\n    pass\n", "raw": True, "keep_alive": 1800}
    fim["options"] = {"temperature": 0.01, "num_predict": 8, "stop": ["\n\n"], "num_ctx": 8192, **FAST}
    r = _post(server, GENERATE, {**fim, "stream": False, "template": "", "system": ""})  # Go clients send ""
    assert r.status_code == 200 and r.json()["done"] is True, r.text
    call = {"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
    ]
    chat = {"model": "tiny:latest", "messages": messages, "tools": [WEATHER], "stream": False, "num_predict": 64}
    r = _post(server, CHAT, {**chat, "keep_alive": "5m", "options": {"use_mmap": True, "num_thread": 4, **FAST}})
    assert r.status_code == 200 and r.json()["message"]["role"] == "assistant", r.text


def test_a_tool_message_without_names_answers_the_next_call_before_it():
    from dgemma.server.dialects.ollama import OllamaChatRequest, _chat_messages

    calls = [{"function": {"name": name, "arguments": {}}} for name in ("f", "g")]
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls}]
    messages += [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    body = OllamaChatRequest.model_validate({"model": "tiny", "messages": messages})
    assert [m.get("name") for m in _chat_messages(body.messages)] == [None, None, "f", "g"]


def test_an_error_mid_stream_is_a_line():
    from dgemma.server.dialects.ollama import _lines, _Run
    from dgemma.server.routes import Started
    from dgemma.server.runs import Piece

    async def pieces():
        yield Piece(0, "content", "{")
        yield Piece(0, "end", error=ApiError(422, "format: no valid JSON answer", "format"))

    async def read(run):
        return [json.loads(line) async for line in _lines(run)]

    first, last = asyncio.run(read(_Run("tiny", True, 0, Started([], pieces(), 3, [], []))))
    assert first["message"] == {"role": "assistant", "content": "{"} and first["done"] is False
    assert last == {"error": "format: no valid JSON answer"}


def test_langchain_ollama_chat_model(server):
    langchain_ollama = pytest.importorskip("langchain_ollama")
    llm = langchain_ollama.ChatOllama(model="tiny", base_url=server.url, client_kwargs={"headers": AUTH})
    assert isinstance(llm.invoke("hi", options=OPTIONS).content, str)  # (options replace the model's own)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Alice is 30.", options=FAST)
    assert isinstance(person, Person)
