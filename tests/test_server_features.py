"""What the server returns, checked exactly: max_tokens, stop strings (applied during generation, counted as
returned), several prompts, infilling (streamed too, and clamped to what a canvas holds), streamed text equal
to the answer in one piece, and the real clients people use (openai, langchain-openai, litellm)."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from live_server import KEY  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
FAST = {"max_denoising_steps": 3}


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "hello"}])
    return client.chat.completions.create(model="tiny", **kw)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 20])
def test_max_tokens_is_exact(client, n):
    r = _chat(client, max_tokens=n, seed=0, extra_body={**FAST, "ignore_eos": True})
    assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
    c = client.completions.create(
        model="tiny", prompt="a", max_tokens=n, seed=0, extra_body={**FAST, "ignore_eos": True}
    )
    assert c.usage.completion_tokens == n


def _tokens_generated(server) -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    return float(
        next(line.split()[1] for line in text.splitlines() if line.startswith("dgemma_tokens_generated_total"))
    )


def test_stop_strings_end_generation_and_usage_counts_what_is_returned(server, client):
    body = {**FAST, "ignore_eos": True}
    full = _chat(client, max_tokens=40, seed=5, extra_body=body).choices[0].message.content
    stop = full[3:5]  # a string the same seed writes again, early in the first canvas of 8 tokens
    assert stop and full.find(stop) >= 1
    before = _tokens_generated(server)
    r = _chat(client, max_tokens=40, seed=5, stop=[stop], extra_body=body)
    generated = _tokens_generated(server) - before
    assert r.choices[0].message.content == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"
    assert generated <= 8  # the engine stopped after the canvas that held the stop string (40 otherwise)
    assert 1 <= r.usage.completion_tokens <= 8
    streamed = [
        c.choices[0].delta.content or ""
        for c in _chat(
            client, max_tokens=40, seed=5, stop=stop, stream=True, extra_body={**body, "early_commit": False}
        )
        if c.choices
    ]
    assert "".join(streamed) == full[: full.find(stop)]


def test_streamed_text_equals_the_answer_in_one_piece(client):
    kw = dict(max_tokens=19, seed=11, extra_body={**FAST, "early_commit": False, "ignore_eos": True})
    whole = _chat(client, **kw)
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 19
    pieces = list(client.completions.create(model="tiny", prompt="x = ", stream=True, **kw))
    one = client.completions.create(model="tiny", prompt="x = ", **kw)
    assert "".join(p.choices[0].text for p in pieces if p.choices) == one.choices[0].text


def test_completions_take_several_prompts_and_report_usage_when_streaming(client):
    r = client.completions.create(
        model="tiny", prompt=["one", "two", [5, 6, 7]], n=2, max_tokens=3, seed=0, extra_body=FAST
    )
    assert [c.index for c in r.choices] == list(range(6))
    same = client.completions.create(model="tiny", prompt="two", n=2, max_tokens=3, seed=0, extra_body=FAST)
    assert [c.text for c in r.choices[2:4]] == [c.text for c in same.choices]  # prompt j has choices j*n ...
    chunks = list(
        client.completions.create(
            model="tiny", prompt="a", max_tokens=5, stream=True, stream_options={"include_usage": True}, extra_body=FAST
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5


def test_infilling_returns_the_middle_and_streams(server, client):
    kw = dict(model="tiny", prompt="def f(x):", suffix="return y", seed=0, extra_body=FAST)
    r = client.completions.create(max_tokens=3, **kw)
    middle = r.choices[0].text
    assert r.usage.completion_tokens <= 3 and "return y" not in middle
    streamed = list(client.completions.create(max_tokens=3, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == middle
    # editors send 128-256 tokens: the middle is clamped to what a canvas holds beside the suffix, and says so
    raw = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "a", "suffix": "b", "max_tokens": 256, **FAST},
        headers=AUTH,
        timeout=60,
    ).json()
    assert raw["dgemma"]["middle_length"] < 8 and raw["usage"]["completion_tokens"] <= raw["dgemma"]["middle_length"]
    # a long suffix keeps half of the canvas of 8: the middle still sees it
    raw = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "a", "suffix": "b = c\n" * 20, "max_tokens": 256, **FAST},
        headers=AUTH,
        timeout=60,
    ).json()
    assert raw["dgemma"]["middle_length"] == 4


def test_infilling_without_max_tokens_chooses_the_length_as_dgemma_infill_does(server, model_dir):
    """No max_tokens: the middle's length is chosen among 2, 4, ... by the model's score, on the engine, by
    the very code dgemma.infill runs: the same middle, length and scores as the Python API."""
    from helpers import load_quiet

    import dgemma

    tok = dgemma.Tokenizer.from_dir(model_dir)
    prompt, suffix = "def f(x):", "return y"
    model = load_quiet(model_dir)
    api, second = (
        dgemma.infill(model, tok.encode(prompt), tok.encode(suffix, add_special_tokens=False), seed=s, **FAST)
        for s in (4, 5)  # choice i of a request runs at seed + i
    )
    assert len(api.scores) > 1  # several lengths were tried
    body = {"prompt": prompt, "suffix": suffix, "seed": 4, **FAST}
    raw = httpx.post(server.url + "/v1/completions", json={**body, "n": 2}, headers=AUTH, timeout=60).json()
    assert raw["choices"][0]["text"] == tok.decode(api.middle)
    assert raw["dgemma"]["middle_length"] is None  # chosen per choice, not given
    first = raw["dgemma"]["choices"][0]
    assert first["middle_length"] == api.middle_length
    assert first["middle_scores"] == {str(n): round(v, 4) for n, v in api.scores.items()}
    assert len(raw["dgemma"]["choices"]) == 2 and all("middle_scores" in c for c in raw["dgemma"]["choices"])
    assert raw["choices"][1]["text"] == tok.decode(second.middle)
    assert raw["dgemma"]["choices"][1]["middle_length"] == second.middle_length
    assert raw["usage"]["completion_tokens"] == len(api.middle) + len(second.middle)
    # streamed: the same middle, and its end chunk says the length chosen
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == raw["choices"][0]["text"]
    assert events[-1]["dgemma"]["middle_length"] == api.middle_length


def test_too_long_prompts_name_the_right_field(server, model_dir):
    context = json.loads((model_dir / "config.json").read_text())["text_config"]["max_position_embeddings"]

    def post(path, body):
        return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60).json()["error"]

    assert post("/v1/completions", {"prompt": [5] * (context - 4)})["param"] == "prompt"  # no room for a canvas of 8
    err = post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": context})
    room = (context - 3) // 8 * 8  # whole canvases of 8 after a 3-token prompt
    assert err["param"] == "max_tokens" and f"at most {room} tokens" in err["message"], err
    err = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * context}]})
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"


# -- the clients people use -----------------------------------------------------------------------------------


def test_langchain_openai_chat_and_completions(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(
        model="tiny", base_url=server.url + "/v1", api_key=KEY, max_tokens=6, extra_body=FAST, max_retries=0
    )
    assert isinstance(chat.invoke("hi").content, str)
    assert "".join(c.content for c in chat.stream("hi")) is not None
    llm = langchain_openai.OpenAI(
        model="tiny", base_url=server.url + "/v1", api_key=KEY, max_tokens=4, extra_body=FAST, max_retries=0
    )
    assert isinstance(llm.invoke("a = "), str)  # langchain sends a list of prompts
    assert len(llm.generate(["a", "b"]).generations) == 2


def test_litellm_chat_and_streaming(server):
    litellm = pytest.importorskip("litellm")
    kw = dict(model="openai/tiny", api_base=server.url + "/v1", api_key=KEY, max_tokens=5, extra_body=FAST)
    r = litellm.completion(messages=[{"role": "user", "content": "hi"}], **kw)
    assert isinstance(r.choices[0].message.content, str) and r.usage.completion_tokens <= 5
    pieces = [
        c.choices[0].delta.content or ""
        for c in litellm.completion(messages=[{"role": "user", "content": "hi"}], stream=True, **kw)
    ]
    assert isinstance("".join(pieces), str)


def test_curl_raw_sse(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True, **FAST}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = [x for x in r.iter_lines() if x]
    assert all(x.startswith("data: ") for x in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
