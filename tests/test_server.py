"""The HTTP server, live on loopback, driven by the official `openai` client and by raw HTTP."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from helpers import load_quiet

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from live_server import KEY, LiveServer  # noqa: E402


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


FAST = {"max_denoising_steps": 3}


def test_models_health_and_playground(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "dgemma playground" in page.text


def test_chat_completion_exact_length(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=11,
        seed=1,
        extra_body={**FAST, "stop": None},
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert r.usage.completion_tokens <= 11 and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=11, seed=1, extra_body=FAST
    )
    assert again.choices[0].message.content == choice.message.content  # the seed decides


def test_n_choices_and_completion_with_suffix(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=3, seed=0, extra_body=FAST
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    c = client.completions.create(
        model="tiny", prompt="def f(x):", suffix="return y", max_tokens=6, seed=0, extra_body=FAST
    )
    assert c.choices[0].finish_reason == "length" and isinstance(c.choices[0].text, str)


def test_streaming_chat_token_by_token(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=20,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"max_denoising_steps": 12, "early_commit_steps": 1},
    )
    deltas, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    assert finish in ("stop", "length") and usage is not None and usage.completion_tokens <= 20
    assert len(deltas) >= 1


def test_streaming_drafts_extension(server):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8,
        "stream": True,
        "include_drafts": True,
        **FAST,
    }
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    drafts = [json.loads(line[6:]) for line in lines if "dgemma_draft" in line]
    assert drafts and drafts[0]["dgemma_draft"]["step"] == 1 and lines[-1] == "data: [DONE]"


def test_streaming_completion(client):
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="a = ", max_tokens=9, stream=True, seed=0, extra_body=FAST
        )
    ]
    assert pieces and all(isinstance(p, str) for p in pieces)


def test_auth(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _post(server, path, body, raw=None):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    return httpx.post(
        server.url + path, content=raw if raw is not None else json.dumps(body), headers=headers, timeout=60
    )


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 99}, 400, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, "model"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages.0.content",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "t_min": 0.9, "t_max": 0.5}, 400, None),
        ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),
    ],
)
def test_bad_chat_requests(server, body, status, param):
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)


def test_malformed_json_and_bad_completions(server):
    r = _post(server, "/v1/chat/completions", None, raw=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"prompt": [1, 2, 99999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = _post(server, "/v1/completions", {"prompt": "x", "suffix": "y", "max_tokens": 10**7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_metrics_count_work(server, client):
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "m"}], max_tokens=4, extra_body=FAST
    )
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = dict(line.split() for line in text.splitlines() if line and not line.startswith("#") and "{" not in line)
    assert float(values["dgemma_requests_finished_total"]) >= 1
    assert float(values["dgemma_denoising_steps_total"]) >= 1 and float(values["dgemma_tokens_per_forward"]) > 0
    assert "dgemma_queue_depth" in values and 'dgemma_http_requests_total{route="/v1/chat/completions"' in text


def test_full_queue_answers_429_and_disconnect_cancels(model_dir):
    from dgemma.checkpoints.tokenizer import Tokenizer
    from dgemma.server.app import create_app

    app = create_app(load_quiet(model_dir), Tokenizer.from_dir(model_dir), model_name="tiny", max_batch=1, max_queue=0)
    slow = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 400,
        "max_denoising_steps": 200,
        "confidence_threshold": 1e-9,
        "stream": True,
        "ignore_eos": True,
    }
    with LiveServer(app) as live:
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=slow, timeout=60) as first:
            lines = first.iter_lines()  # keep the iterator: dropping it closes the stream, which cancels
            next(lines)  # the first request is running
            r = httpx.post(live.url + "/v1/chat/completions", json=slow, timeout=60)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
        # leaving the stream early cancels the work
        for _ in range(100):
            metrics = httpx.get(live.url + "/metrics").text
            if "dgemma_requests_cancelled_total 1" in metrics:
                break
            time.sleep(0.1)
        assert "dgemma_requests_cancelled_total 1" in metrics
        assert httpx.get(live.url + "/health").json()["active"] == 0


def test_reasoning_and_tool_call_parsing():
    from dgemma.server.output import StreamText, openai_call, split_reasoning
    from dgemma.tool_calls import parse_tool_calls

    thought, answer = split_reasoning("<|channel>thought\nlet me think<channel|>The answer is 4.")
    assert (thought, answer) == ("let me think", "The answer is 4.")
    assert split_reasoning("plain") == (None, "plain")
    found, rest = parse_tool_calls('Sure. <|tool_call>call:get_weather{location:<|"|>Paris<|"|>}<tool_call|>')
    calls = [openai_call(name, arguments) for name, arguments in found]
    assert rest == "Sure." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"location": "Paris"}
    s = StreamText(["STOP"], reasoning=True)
    text = "<|channel>thought\nhmm<channel|>Hello STOP ignored"
    pieces = []
    for end in range(1, len(text) + 1):
        pieces += s.feed(text[:end])
    pieces += s.feed(text, final=True)
    assert "".join(t for k, t in pieces if k == "reasoning") == "hmm"
    assert "".join(t for k, t in pieces if k == "content") == "Hello " and s.stopped
    quiet = StreamText(None, reasoning=False)
    assert quiet.feed("<|channel>thought\n<channel|>Hi", final=True) == [("content", "Hi")]
    # a character whose bytes are split across canvases decodes as U+FFFD until its last token arrives
    split = StreamText(None, reasoning=False)
    assert split.feed("ab\ufffd") == [("content", "ab")]
    assert split.feed("ab\u0127c") + split.feed("ab\u0127c", final=True) == [("content", "\u0127c")]
    assert StreamText(None, reasoning=False).feed("x\ufffd", final=True) == [("content", "x\ufffd")]
