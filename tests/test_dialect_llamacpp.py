"""llama.cpp server's /infill and /completion against a live server, with the bodies llama.vscode sends (no
client package exists: httpx and llama.cpp's documented fields): the answer and stream shapes, the
cache-warming call that runs nothing, input_extra, the same tokens as /v1/completions, hostile bodies, and a
real infill of a Python function body on the shipped code model."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("uvicorn")
from live_server import KEY, LiveServer

import dgemma
from dgemma.checkpoints.tokenizer import Tokenizer

AUTH = {"Authorization": f"Bearer {KEY}"}
FAST = {"max_denoising_steps": 3}
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
# what llama.vscode's ring buffer sends as input_extra (src/extra-context.ts: text, time, filename)
CHUNKS = [
    {"text": "import os\nimport sys\n\n", "time": 1733400000000, "filename": "/src/util.py"},
    {"text": "def sub(a, b):\n    return a - b\n", "time": 1733400001234, "filename": "/src/ops.py"},
]
ANSWER_KEYS = {
    "content", "stop", "model", "tokens_predicted", "tokens_evaluated", "stop_type", "stopping_word",
    "truncated", "tokens_cached", "generation_settings", "timings",
}  # fmt: skip
TIMINGS = {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second"}


def _vscode_body(prefix: str, suffix: str, typed: str = "", n_predict: int = 16) -> dict:
    """The body of llama.vscode's FIM request (src/llama-server.ts createRequestPayload), with dgemma's
    settings for a fast test."""
    return {
        "input_prefix": prefix, "input_suffix": suffix, "input_extra": CHUNKS, "prompt": typed,
        "n_predict": n_predict, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True, "n_indent": 4, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
        "seed": 3, "dgemma": FAST,
    }  # fmt: skip


def _post(server, path: str, body: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)


def _events(server, path: str, body: dict) -> list[dict]:
    """The SSE events of a streamed answer, parsed."""
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and "data: [DONE]" not in lines
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def _submitted(server) -> float:
    """The requests the server's engine has been given (its /metrics counter)."""
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("dgemma_requests_total")))


def _check_answer(answer: dict, evaluated: int | None = None) -> None:
    assert set(answer) >= ANSWER_KEYS and set(answer["timings"]) == TIMINGS, answer
    assert answer["stop"] is True and answer["truncated"] is False and answer["tokens_cached"] == 0
    assert isinstance(answer["content"], str) and answer["stop_type"] in ("eos", "limit", "word")
    assert isinstance(answer["tokens_predicted"], int) and answer["tokens_evaluated"] > 0
    assert answer["timings"]["prompt_n"] == answer["tokens_evaluated"]
    assert answer["timings"]["predicted_n"] == answer["tokens_predicted"]
    assert all(isinstance(v, int | float) and v >= 0 for v in answer["timings"].values())
    if evaluated is not None:
        assert answer["tokens_evaluated"] == evaluated


# -- /infill -------------------------------------------------------------------------------------------------


def test_infill_as_llama_vscode_sends_it(server, model_dir):
    r = _post(server, "/infill", _vscode_body(PREFIX, SUFFIX))
    assert r.status_code == 200, r.text
    answer = r.json()
    tok = Tokenizer.from_dir(model_dir)
    _check_answer(answer, len(tok.encode("".join(c["text"] + "\n" for c in CHUNKS) + PREFIX)))
    settings = answer["generation_settings"]
    assert settings["not_applied"] == [
        "top_k", "top_p", "samplers", "cache_prompt", "n_indent", "t_max_prompt_ms", "t_max_predict_ms",
        "input_extra.time",
    ]  # fmt: skip
    assert settings["n_predict"] == 16 and settings["seed"] == 3 and settings["dgemma"] == FAST
    assert answer["model"] == "tiny" and 0 < answer["dgemma"]["middle_length"] <= 16  # at most 16
    assert answer["tokens_predicted"] <= 16


def test_infill_streamed_is_the_same_middle(server):
    body = _vscode_body(PREFIX, SUFFIX, n_predict=-1)
    whole = _post(server, "/infill", body).json()
    events = _events(server, "/infill", {**body, "stream": True})
    *pieces, last = events
    assert all(e == {"content": e["content"], "stop": False} and e["content"] for e in pieces)
    _check_answer(last)
    assert last["content"] == "" and "".join(e["content"] for e in pieces) == whole["content"]
    assert last["tokens_predicted"] == whole["tokens_predicted"] and last["stop_type"] == whole["stop_type"]
    assert last["dgemma"]["middle_length"] == whole["dgemma"]["middle_length"]


def test_the_cache_warming_call_runs_nothing(server, model_dir):
    """llama.vscode's updateExtraContext: n_predict 0, no samplers, empty prefix and suffix, the chunks."""
    body = {
        "input_prefix": "", "input_suffix": "", "input_extra": CHUNKS, "prompt": "", "n_predict": 0,
        "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1,
    }  # fmt: skip
    before = _submitted(server)
    r = _post(server, "/infill", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    tok = Tokenizer.from_dir(model_dir)
    _check_answer(answer, len(tok.encode("".join(c["text"] + "\n" for c in CHUNKS))))
    assert answer["content"] == "" and answer["tokens_predicted"] == 0
    assert answer["generation_settings"]["n_predict"] == 0
    streamed = _events(server, "/infill", {**body, "stream": True})
    assert len(streamed) == 1 and streamed[0]["stop"] is True and streamed[0]["content"] == ""
    empty = _post(server, "/completion", {"prompt": "", "n_predict": 0}).json()
    assert empty["tokens_evaluated"] == 1 and empty["content"] == ""  # the BOS token, as /v1/completions
    assert _submitted(server) == before


@pytest.mark.parametrize("n_predict", [None, 6])
def test_infill_is_v1_completions_with_a_suffix(server, n_predict):
    """The middle from /infill is /v1/completions' text with the same prompt, suffix, settings and seed:
    the chunks' texts, each then a newline, then the prefix and what the user typed, make the prompt."""
    typed = "retu"
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": CHUNKS, "prompt": typed, "seed": 9}
    body |= {"temperature": 0.7, "stop": ["\n\n\n"], "dgemma": FAST}
    if n_predict is not None:
        body["n_predict"] = n_predict
    infill = _post(server, "/infill", body).json()
    prompt = "".join(c["text"] + "\n" for c in CHUNKS) + PREFIX + typed
    same = {"prompt": prompt, "suffix": SUFFIX, "seed": 9, "temperature": 0.7, "stop": ["\n\n\n"], **FAST}
    if n_predict is not None:
        same["max_tokens"] = n_predict
    completion = _post(server, "/v1/completions", same).json()
    assert infill["content"] == completion["choices"][0]["text"]
    assert infill["tokens_evaluated"] == completion["usage"]["prompt_tokens"]
    assert infill["tokens_predicted"] == completion["usage"]["completion_tokens"]
    assert infill["dgemma"]["middle_length"] == completion["dgemma"]["choices"][0]["middle_length"]
    # a middle is whole ("eos") unless n_predict sized it and it fills that length ("limit"), or a stop word
    filled = n_predict is not None and infill["tokens_predicted"] == infill["dgemma"]["middle_length"]
    assert infill["stop_type"] in (("limit",) if filled else ("eos", "word"))


# -- /completion ---------------------------------------------------------------------------------------------


def test_completion_is_v1_completions(server):
    body = {"prompt": "def f(x):", "n_predict": 12, "seed": 4, "temperature": 0.9, "dgemma": FAST}
    r = _post(server, "/completion", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    _check_answer(answer)
    same = _post(
        server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 12, "seed": 4, "temperature": 0.9, **FAST}
    )
    choice = same.json()["choices"][0]
    assert (
        answer["content"] == choice["text"] and answer["tokens_predicted"] == same.json()["usage"]["completion_tokens"]
    )
    assert answer["stop_type"] == {"length": "limit", "stop": "eos"}[choice["finish_reason"]]
    assert answer["tokens_evaluated"] == same.json()["usage"]["prompt_tokens"]


def test_completion_streamed_and_from_token_ids(server, model_dir):
    ids = Tokenizer.from_dir(model_dir).encode("def f(x):")
    body = {"prompt": ids, "n_predict": 12, "seed": 4, "dgemma": {**FAST, "early_commit": False}}
    whole = _post(server, "/completion", body).json()
    _check_answer(whole, len(ids))
    *pieces, last = _events(server, "/completion", {**body, "stream": True})
    assert all(e["stop"] is False and isinstance(e["content"], str) for e in pieces)
    _check_answer(last, len(ids))
    assert "".join(e["content"] for e in pieces) == whole["content"] and last["content"] == ""
    assert last["tokens_predicted"] == whole["tokens_predicted"]


def test_a_stop_word_ends_the_answer_and_is_named(server):
    body = {"prompt": "def f(x):", "n_predict": 16, "seed": 2, "dgemma": FAST}
    text = _post(server, "/completion", body).json()["content"]
    assert len(text) >= 4, text
    word = text[2:4]
    answer = _post(server, "/completion", {**body, "stop": [word]}).json()
    assert answer["stop_type"] == "word" and answer["stopping_word"] == word
    assert answer["content"] == text[: text.index(word)]


def test_a_request_that_times_out_is_an_error_in_llama_cpps_shape(model_dir):
    """Whole, a 504 in llama.cpp's error shape; streamed, the 200 has begun, so the error is an event."""
    from helpers import load_quiet

    from dgemma.server.app import create_app

    app = create_app(load_quiet(model_dir), Tokenizer.from_dir(model_dir), model_name="tiny", request_timeout=0.2)
    # 50 canvases of 200 steps each (no position is sure enough to stop early): far past 0.2 s on any machine
    steps = {"max_denoising_steps": 200, "confidence_threshold": 1e-9, "ignore_eos": True, "early_commit": False}
    slow = {"prompt": "x", "n_predict": 400, "dgemma": steps}
    with LiveServer(app) as live:
        r = httpx.post(live.url + "/completion", json=slow, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == 504, r.text
        events = _events(live, "/completion", {**slow, "stream": True})
    assert events[-1] == {"error": {"code": 504, "message": events[-1]["error"]["message"], "type": "timeout_error"}}


# -- hostile bodies: each a 4xx in llama.cpp's error shape, naming its field -------------------------------------

INFILL, COMPLETION = "/infill", "/completion"
_P = {"prompt": "x"}
HOSTILE: list[tuple[str, str, object, tuple[int, ...], str | None]] = [
    ("infill body a list", INFILL, [1, 2], (400, 422), None),
    ("infill input_prefix a number", INFILL, {"input_prefix": 5}, (400,), "input_prefix"),
    ("infill input_suffix null-free list", INFILL, {"input_suffix": ["a"]}, (400,), "input_suffix"),
    ("infill input_prefix a lone surrogate", INFILL, {"input_prefix": "\ud800"}, (400,), "input_prefix"),
    ("infill prompt a list of ids", INFILL, {"prompt": [1, 2]}, (400,), "prompt"),
    ("infill input_extra a string", INFILL, {"input_extra": "x"}, (400,), "input_extra"),
    ("infill chunk without text", INFILL, {"input_extra": [{"filename": "a"}]}, (400,), "input_extra.0.text"),
    ("infill chunk unknown field", INFILL, {"input_extra": [{"text": "a", "x": 1}]}, (400,), "input_extra.0.x"),
    ("infill chunk time", INFILL, {"input_extra": [{"text": "a", "time": "now"}]}, (400,), "input_extra.0.time"),
    ("infill input_extra 1000 chunks", INFILL, {"input_extra": [{"text": "a"}] * 1000}, (400,), "input_extra"),
    ("infill input_extra nested lists", INFILL, {"input_extra": [[[[[[{"text": "a"}]]]]]]}, (400,), "input_extra.0"),
    ("infill n_predict a string", INFILL, {"n_predict": "16"}, (400,), "n_predict"),
    ("infill n_predict true", INFILL, {"n_predict": True}, (400,), "n_predict"),
    ("infill n_predict -2", INFILL, {"n_predict": -2}, (400,), "n_predict"),
    ("infill n_predict 2**40", INFILL, {"n_predict": 2**40}, (400,), "n_predict"),
    ("infill temperature 99", INFILL, {"temperature": 99}, (400,), "temperature"),
    ("infill temperature a string", INFILL, {"temperature": "hot"}, (400,), "temperature"),
    ("infill seed -5", INFILL, {"seed": -5}, (400,), "seed"),
    ("infill stop a number list", INFILL, {"stop": [1]}, (400,), "stop"),
    ("infill stop 10 strings", INFILL, {"stop": ["a"] * 10}, (400,), "stop"),
    ("infill lora an adapter", INFILL, {"lora": [{"id": 0, "scale": 0.5}]}, (400,), "lora"),
    ("infill grammar", INFILL, {"grammar": "root ::= \"a\""}, (400,), "grammar"),
    ("infill json_schema", INFILL, {"json_schema": {}}, (400,), "json_schema"),
    ("infill n_probs", INFILL, {"n_probs": 5}, (400,), "n_probs"),
    ("infill logit_bias", INFILL, {"logit_bias": [[15043, 1.0]]}, (400,), "logit_bias"),
    ("infill min_p (unknown)", INFILL, {"min_p": 0.05}, (400,), "min_p"),
    ("infill top_p 2", INFILL, {"top_p": 2}, (400,), "top_p"),
    ("infill top_k a float", INFILL, {"top_k": 40.5}, (400,), "top_k"),
    ("infill samplers numbers", INFILL, {"samplers": [1]}, (400,), "samplers.0"),
    ("infill samplers an object", INFILL, {"samplers": {"a": 1}}, (400,), "samplers"),
    ("infill samplers 100", INFILL, {"samplers": ["top_k"] * 100}, (400,), "samplers"),
    ("infill cache_prompt a string", INFILL, {"cache_prompt": "yes"}, (400,), "cache_prompt"),
    ("infill t_max_predict_ms huge", INFILL, {"t_max_predict_ms": 2**40}, (400,), "t_max_predict_ms"),
    ("infill stream a string", INFILL, {"stream": "true"}, (400,), "stream"),
    ("infill dgemma a string", INFILL, {"dgemma": "x"}, (400,), "dgemma"),
    ("infill dgemma unknown setting", INFILL, {"dgemma": {"bogus": 1}}, (400,), "dgemma.bogus"),
    ("infill dgemma steps 0", INFILL, {"dgemma": {"max_denoising_steps": 0}}, (400,), "dgemma.max_denoising_steps"),
    ("infill another model", INFILL, {"model": "other"}, (404,), "model"),
    ("infill warming with a bad temperature", INFILL, {"n_predict": 0, "temperature": -1}, (400,), "temperature"),
    ("infill warming with another model", INFILL, {"n_predict": 0, "model": "other"}, (404,), "model"),
    ("infill prefix of 2M characters", INFILL, {"input_prefix": "x" * 2_000_000}, (400, 413), "input_prefix"),
    ("completion body a string", COMPLETION, "x", (400, 422), None),
    ("completion without prompt", COMPLETION, {"n_predict": 4}, (400,), "prompt"),
    ("completion prompt null", COMPLETION, {"prompt": None}, (400,), "prompt"),
    ("completion prompt empty ids", COMPLETION, {"prompt": []}, (400,), "prompt"),
    ("completion two prompts", COMPLETION, {"prompt": ["a", "b"]}, (400,), "prompt"),
    ("completion ids and text mixed", COMPLETION, {"prompt": [1, "a"]}, (400,), "prompt"),
    ("completion prompt an object", COMPLETION, {"prompt": {"prompt_string": "x"}}, (400,), "prompt"),
    ("completion id -1", COMPLETION, {"prompt": [-1]}, (400,), "prompt"),
    ("completion id past the vocabulary", COMPLETION, {"prompt": [10**9]}, (400,), "prompt"),
    ("completion warming, id past the vocabulary", COMPLETION, {"prompt": [10**9], "n_predict": 0}, (400,), "prompt"),
    ("completion prompt a lone surrogate", COMPLETION, {"prompt": "a\ud800"}, (400,), "prompt"),
    ("completion n_predict 2**40", COMPLETION, {**_P, "n_predict": 2**40}, (400,), "n_predict"),
    ("completion n_probs", COMPLETION, {**_P, "n_probs": 3}, (400,), "n_probs"),
    ("completion n_cmpl (unknown)", COMPLETION, {**_P, "n_cmpl": 2}, (400,), "n_cmpl"),
    ("completion seed a float", COMPLETION, {**_P, "seed": 1.5}, (400,), "seed"),
    ("completion dgemma.ignore_eos", COMPLETION, {**_P, "dgemma": {"ignore_eos": "y"}}, (400,), "dgemma.ignore_eos"),
]  # fmt: skip


def _raw(server, path: str, body: object) -> httpx.Response:
    """`body` as json.dumps writes it (a lone surrogate as its `\\ud800` escape)."""
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=json.dumps(body).encode(), headers=headers, timeout=60)


@pytest.mark.parametrize("name, path, body, statuses, param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies(server, name, path, body, statuses, param):
    """Each is a 4xx in llama.cpp's error shape ({"error": {code, message, type}}) naming its field, and
    none reaches the engine."""
    before = _submitted(server)
    r = _raw(server, path, body)
    assert r.status_code in statuses, r.text
    error = r.json()["error"]
    assert set(error) == {"code", "message", "type"} and error["code"] == r.status_code, error
    if param is not None and r.status_code != 413:
        assert error["message"].startswith(param + ":") or error["message"].startswith(param + " "), error
    if isinstance(body, dict) and "stream" not in body:  # streamed, the same error before any event
        again = _raw(server, path, {**body, "stream": True})
        assert again.status_code == r.status_code and again.json() == r.json()
    assert _submitted(server) == before


# -- the shipped code model ---------------------------------------------------------------------------------------


def test_the_code_model_fills_a_function_body():
    """A real /infill on the shipped code model: a Python function's body between its docstring and the next
    function, as llama.vscode asks for it."""
    from dgemma.server.app import create_app
    from dgemma.tasks.code import MODEL_DIR

    model, tok = dgemma.load(MODEL_DIR), dgemma.Tokenizer.from_dir(MODEL_DIR)
    prefix = 'def mean(values):\n    """Return the arithmetic mean of a list of numbers."""\n    '
    suffix = "\n\n\ndef median(values):\n    values = sorted(values)\n    return values[len(values) // 2]\n"
    body = {**_vscode_body(prefix, suffix, n_predict=-1), "input_extra": [], "dgemma": {}}
    with LiveServer(create_app(model, tok, model_name="code", api_key=KEY)) as live:
        answer = _post(live, "/infill", body).json()
    _check_answer(answer, len(tok.encode(prefix)))
    assert answer["content"].strip() and answer["tokens_predicted"] > 0, answer
    assert answer["model"] == "code" and answer["dgemma"]["middle_length"] >= answer["tokens_predicted"]
