"""llama.cpp server's /infill and /completion against a live server, with the bodies llama.vscode sends (no
client package exists: httpx and llama.cpp's documented fields): the answer and stream shapes, the
cache-warming call that runs nothing, input_extra, the same tokens as /v1/completions, and a real infill of a
Python function body on the shipped code model. Its hostile bodies are tests/hostile.py's DIALECTS, replayed
by test_server_fuzz.py."""

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
TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_second"}
TIMINGS |= {"predicted_n", "predicted_ms", "predicted_per_second"}


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
    assert answer["stop"] is True and answer["truncated"] is False
    assert answer["tokens_cached"] == answer["timings"]["cache_n"] <= answer["tokens_evaluated"]  # the prefix cache's
    assert isinstance(answer["content"], str) and answer["stop_type"] in ("eos", "limit", "word")
    assert isinstance(answer["tokens_predicted"], int) and answer["tokens_evaluated"] > 0
    assert answer["timings"]["prompt_n"] + answer["tokens_cached"] == answer["tokens_evaluated"]
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
        "top_k", "top_p", "samplers", "n_indent", "t_max_prompt_ms", "t_max_predict_ms", "input_extra.time",
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


def test_the_cache_warming_call_keeps_the_prompt(server, model_dir):
    """llama.vscode's updateExtraContext: n_predict 0, no samplers, empty prefix and suffix, the chunks. It
    runs the prompt's prefill only, into the prefix cache: the completion that follows loads the chunks."""
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
    assert _submitted(server) == before + 3  # three prefills, nothing denoised
    chunks = len(tok.encode("".join(c["text"] + "\n" for c in CHUNKS)))
    follow = _post(server, "/infill", _vscode_body(PREFIX, SUFFIX, n_predict=4)).json()
    assert chunks >= 16 and follow["tokens_cached"] >= chunks // 16 * 16 - 16  # whole blocks, the last may differ
    cold = _post(server, "/infill", {**_vscode_body(PREFIX, SUFFIX, n_predict=4), "cache_prompt": False}).json()
    assert cold["tokens_cached"] == 0 and cold["content"] == follow["content"]


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
