"""The server against hostile and careless input, live on loopback: bounded bodies, bounded settings,
invalid Unicode, disconnects, metrics that no path can break, parameters it cannot honour refused by name,
and the bounds on slow clients and on shutdown. Every answer that is not a 2xx is an OpenAI-shaped 4xx."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers import load_quiet

pytest.importorskip("uvicorn")
from live_server import KEY, LiveServer, _free_port

AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
FAST = {"max_denoising_steps": 3}


def _user(text="x") -> list[dict]:
    return [{"role": "user", "content": text}]


def _post(url: str, path: str, body=None, raw: bytes | None = None, headers=None, timeout=60) -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(url + path, content=content, headers=headers, timeout=timeout)


def _error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["message"] and set(err) == {"message", "type", "param", "code"}
    if param != "any":
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def app_factory(model_dir):
    from dgemma.checkpoints.tokenizer import Tokenizer
    from dgemma.server.app import create_app

    def make(**options):
        options.setdefault("model_name", "tiny")
        return create_app(load_quiet(model_dir), Tokenizer.from_dir(model_dir), **options)

    return make


# -- 1. bodies, message counts and prompts are bounded before any work --------------------------------


def test_body_size_is_bounded(app_factory):
    from dgemma.server.limits import Limits

    with LiveServer(app_factory(limits=Limits(max_body_bytes=4096))) as live:
        big = {"messages": _user("y" * 5000)}
        _error(_post(live.url, CHAT, big), 413)
        # a chunked body (no Content-Length) is counted as it arrives
        chunks = (b'{"messages": [{"role": "user", "content": "' + b"z" * 1000 for _ in range(8))
        r = httpx.post(live.url + CHAT, content=chunks, headers={"Content-Type": "application/json"}, timeout=30)
        _error(r, 413)


def test_a_million_messages_do_not_block_the_server(server):
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 1_000_000}).encode()
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", _post(server.url, CHAT, raw=body)))
    thread.start()
    t0 = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert time.monotonic() - t0 < 2.0  # the event loop stayed free
    thread.join(timeout=30)
    assert result["r"].status_code in (400, 413)
    many = {"messages": [{"role": "user", "content": "m"}] * 3000, "max_tokens": 2}
    _error(_post(server.url, CHAT, many), 400, "messages")


def test_prompts_are_bounded_in_characters_before_tokenising(server):
    err = _error(_post(server.url, CHAT, {"messages": _user("w" * 200_000)}), 400, "messages")
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    _error(_post(server.url, "/v1/completions", {"prompt": "w" * 200_000}), 400, "prompt")
    _error(_post(server.url, "/v1/completions", {"prompt": "a", "suffix": "w" * 200_000}), 400, "suffix")


# -- 2. every setting has a finite range -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("stability_threshold", 2_000_000),
        ("stability_threshold", 1e9),
        ("max_denoising_steps", 10**6),
        ("confidence_threshold", 1e308),
        ("entropy_bound", 1e12),
        ("t_max", 1e6),
        ("t_min", -1),
        ("temperature", 100),
        ("seed", -5),
        ("seed", 2**70),
        ("n", 0),
        ("early_commit_steps", 10**9),
        ("tokens_per_step", 0),
        ("confidence", 2),
    ],
)
def test_settings_out_of_range_are_400s(server, field, value):
    _error(_post(server.url, CHAT, {"messages": _user(), field: value}), 400, field)


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_numbers_are_400s(server, literal):
    raw = f'{{"messages": [{{"role": "user", "content": "x"}}], "t_max": {literal}}}'.encode()
    _error(_post(server.url, CHAT, raw=raw), 400, "t_max")


# -- 3. text must be valid Unicode -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"messages": _user("a\ud800b")}, "messages.0.content"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages.0.content"),
        (CHAT, {"messages": _user(), "stop": ["\ud800"]}, "stop"),
        ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\ud800"]}, "prompt"),
        ("/v1/completions", {"prompt": "ok", "suffix": "\ud800"}, "suffix"),
    ],
)
def test_lone_surrogates_are_400s(server, path, body, param):
    err = _error(_post(server.url, path, body), 400, param)
    assert "surrogate" in err["message"]


# -- 4. a client that goes away stops its work -------------------------------------------------------------


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


SLOW = {"max_tokens": 400, "max_denoising_steps": 200, "confidence_threshold": 1e-9, "ignore_eos": True}
# As long, but in short canvases: the test model's 8-token canvases are committed (and streamed) every 20
# steps, about 0.1 s, while the 100 canvases take several seconds.
STREAMED = {**SLOW, "max_tokens": 800, "max_denoising_steps": 20}


def test_a_non_streaming_request_is_cancelled_when_its_client_leaves(app_factory):
    with LiveServer(app_factory(api_key=KEY)) as live:
        before = _metric(live.url, "dgemma_requests_cancelled_total")
        with pytest.raises(httpx.ReadTimeout):
            _post(live.url, CHAT, {"messages": _user(), **SLOW}, timeout=1.5)
        for _ in range(50):
            if _metric(live.url, "dgemma_requests_cancelled_total") > before:
                break
            time.sleep(0.1)
        assert _metric(live.url, "dgemma_requests_cancelled_total") == before + 1
        assert httpx.get(live.url + "/health").json()["active"] == 0


# -- 5. metrics are labelled by route, and always parse ------------------------------------------------------


def test_metrics_survive_crafted_paths(server):
    from prometheus_client.parser import text_string_to_metric_families

    for i in range(50):
        httpx.get(server.url + f"/v1/x{i}%22%7D%201%0A%23evil", headers=AUTH)  # decodes to '"} 1\n#evil'
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # raises if the page does not parse
    routes = {s.labels["route"] for s in families["dgemma_http_requests"].samples}
    known = {"/", "/health", "/metrics", "/docs", "/openapi.json", "/v1/models", CHAT, "/v1/completions"}
    known |= {"/v1/canvas/score", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/infill"}
    known |= {"/completion", *(f"/api/{name}" for name in ("chat", "generate", "show", "tags", "ps", "version"))}
    assert routes <= known | {"other"}
    assert "other" in routes and len(text) < 20_000


# -- 8. errors are OpenAI-shaped everywhere; settings are checked before a stream starts ------------------


def test_errors_outside_the_routes_are_openai_shaped(server):
    _error(_post(server.url, CHAT, raw=b'{"messages": "\xff\xfe"}'), 400)
    _error(_post(server.url, CHAT, raw=b"[" * 50_000 + b"]" * 50_000), 400)
    _error(_post(server.url, CHAT, raw=b'"just a string"'), 400)
    assert httpx.get(server.url + "/nowhere", headers=AUTH).json()["error"]["type"] == "not_found_error"
    _error(httpx.delete(server.url + "/v1/models", headers=AUTH), 405)
    _error(httpx.get(server.url + CHAT, headers=AUTH), 405)


def test_bad_settings_are_400s_before_the_stream(server):
    body = {"messages": _user(), "t_min": 0.9, "t_max": 0.5, "stream": True}
    _error(_post(server.url, CHAT, body), 400)
    body = {"messages": _user(), "mode": "exact", "sampler": "fixed", "stream": True}
    _error(_post(server.url, CHAT, body), 400)


def test_n_beyond_what_the_server_holds_is_a_400(app_factory):
    with LiveServer(app_factory(max_batch=1, max_queue=1)) as live:
        _error(_post(live.url, CHAT, {"messages": _user(), "n": 3, "max_tokens": 2}), 400, "n")
        _error(_post(live.url, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2}), 400, "n")
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"properties": {"a": {"type": "integer"}}}},
        }
        body = {"prompt": ["a", "b"], "n": 2, "response_format": fmt}  # refused before its drafts run
        _error(_post(live.url, "/v1/completions", body), 400, "n")


def test_a_timed_out_stream_counts_what_it_sent(app_factory):
    import openai

    with LiveServer(app_factory(request_timeout=1.5)) as live:
        _error(_post(live.url, CHAT, {"messages": _user(), **SLOW}), 504)
        # Text must go out well before the timeout: early commits were not enough (a random model's first
        # position may keep changing its argmax, so the first text came out at 1.3-1.4 s in some runs).
        body = {"messages": _user(), **STREAMED, "stream": True, "stream_options": {"include_usage": True}}
        lines = []
        with httpx.stream("POST", live.url + CHAT, json=body, timeout=30) as r:
            lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        sent = sum(len(c["choices"][0]["delta"].get("content") or "") for c in lines if c.get("choices"))
        errors = [c for c in lines if "error" in c]
        assert errors and errors[0]["error"]["code"] == "timeout" and sent > 0
        assert lines[-1]["usage"]["completion_tokens"] > 0
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError):
            for _ in client.chat.completions.create(model="tiny", messages=_user(), stream=True, extra_body=SLOW):
                pass


def test_a_json_answer_whose_draft_times_out_is_a_504(app_factory):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with LiveServer(app_factory(request_timeout=1.5)) as live:  # the free draft that sizes it runs out of time
        _error(_post(live.url, CHAT, {"messages": _user(), **SLOW, "response_format": fmt}), 504)


# -- 9. parameters that cannot be honoured are refused by name ------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("logit_bias", {"5": 10}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("top_p", 0.5),
        ("reasoning_effort", "high"),
        ("tool_choice", "required"),
        ("made_up_field", 1),
    ],
)
def test_unsupported_parameters_are_400s_naming_the_field(server, field, value):
    _error(_post(server.url, CHAT, {"messages": _user(), field: value}), 400, field)


def test_no_op_values_of_those_parameters_are_accepted(server):
    body = {
        "messages": _user(),
        "max_tokens": 2,
        "top_p": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "user": "someone",
        **FAST,
    }
    assert _post(server.url, CHAT, body).status_code == 200


def test_tools_need_a_template_that_renders_them(model_dir):
    from tokenizers import Tokenizer as HFTokenizer

    from dgemma.checkpoints.tokenizer import Tokenizer
    from dgemma.server.app import create_app

    shipped = Tokenizer.from_dir(model_dir)
    plain = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no tools in it
    tok = Tokenizer(HFTokenizer.from_str(shipped.to_json()), shipped.special_tokens, plain)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with LiveServer(create_app(load_quiet(model_dir), tok, model_name="tiny", api_key=KEY)) as live:
        _error(_post(live.url, CHAT, {"messages": _user(), "tools": tools}), 400, "tools")
        off = {"messages": _user(), "tools": tools, "tool_choice": "none", "max_tokens": 2}
        assert _post(live.url, CHAT, off).is_success  # tools switched off are not rendered
        messages = [*_user(), {"role": "tool", "content": "42", "tool_call_id": "c1"}]
        _error(_post(live.url, CHAT, {"messages": messages}), 400, "messages.1")


def test_echo_returns_the_prompt_first(server):
    r = _post(server.url, "/v1/completions", {"prompt": "hello there", "max_tokens": 3, "echo": True, **FAST})
    assert r.json()["choices"][0]["text"].startswith("hello there")


# -- 10. keys, open routes, hosts, slow clients, shutdown -------------------------------------------------------


def test_which_routes_need_the_key(server):
    for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
        assert httpx.get(server.url + path).status_code == 401, path
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200, path
    for path in ("/", "/health"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401


def test_loopback_without_a_key_answers_only_localhost(app_factory):
    with LiveServer(app_factory(check_host=True)) as live:
        assert httpx.get(live.url + "/health").status_code == 200
        assert httpx.get(live.url + "/health", headers={"Host": f"localhost:{live.port}"}).status_code == 200
        err = _error(httpx.get(live.url + "/v1/models", headers={"Host": "attacker.example"}), 403)
        assert err["code"] == "host_not_allowed"


def _raw_exchange(port: int, data: bytes, wait: float) -> bytes:
    """Send `data`, then read what the server says within `wait` seconds (b'' if it closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait + 5) as s:
        s.sendall(data)
        s.settimeout(wait)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            out += b"<still open>"
        return out


def test_slow_headers_and_bodies_are_cut_off(app_factory):
    from dgemma.server.limits import Limits

    limits = Limits(header_timeout=1.0, body_timeout=1.0)
    with LiveServer(app_factory(limits=limits), limits=limits) as live:
        t0 = time.monotonic()
        out = _raw_exchange(live.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", wait=4)
        assert out == b"" and time.monotonic() - t0 < 3.5  # closed after ~1 s, not held open
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        out = _raw_exchange(live.port, head + b"Content-Length: 100\r\n\r\n{", wait=4)
        assert out.startswith(b"HTTP/1.1 408"), out[:200]


def test_shutdown_ends_open_streams_with_done(app_factory):
    with LiveServer(app_factory(), shutdown_timeout=5) as live:
        body = {"messages": _user(), **SLOW, "stream": True}
        with httpx.stream("POST", live.url + CHAT, json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            t0 = time.monotonic()
            live.server.should_exit = True  # what SIGTERM sets
            rest = [x for x in lines if x.startswith("data: ")]
        assert time.monotonic() - t0 < 5
        assert rest[-1] == "data: [DONE]" and any('"shutting_down"' in x for x in rest)


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--port", "99999", "between 1 and 65535"),
        ("--port", "http", "not a port number"),
        ("--request-timeout", "inf", "positive number of seconds"),
        ("--max-queue", "-1", "integer >= 0"),
        ("--threads", "0", "positive integer"),
    ],
)
def test_serve_flags_are_checked(flag, value, message, capsys):
    from dgemma.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "x", flag, value])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="signals and /proc")
def test_sigterm_drains_dgemma_serve_within_its_bound(model_dir):
    """The real command: SIGTERM with a stream open ends the stream with [DONE] and the process promptly."""
    port = _free_port()
    cmd = [sys.executable, "-m", "dgemma.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--shutdown-timeout", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"messages": _user(), **SLOW, "stream": True}
        with httpx.stream("POST", url + CHAT, json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and any('"shutting_down"' in x for x in rest)
        # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM ended it
        assert proc.wait(timeout=10) in (0, -signal.SIGTERM) and time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_max_context_bounds_each_requests_cache(app_factory):
    with pytest.raises(ValueError, match="max_context"):
        app_factory(max_context=10**9)
    with LiveServer(app_factory(max_context=64)) as live:
        assert _post(live.url, "/v1/completions", {"prompt": [5] * 40, "max_tokens": 24, **FAST}).is_success
        err = _error(_post(live.url, "/v1/completions", {"prompt": [5] * 40, "max_tokens": 25}), 400, "max_tokens")
        assert "at most 24 tokens" in err["message"] and "--max-context" in err["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"messages": _user(), "stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"messages": _user(), "include_drafts": True}, "include_drafts"),
        ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": ["a", "b"], "suffix": "c"}, "suffix"),
    ],
)
def test_fields_that_only_apply_with_others_are_400s_not_ignored(server, path, body, param):
    _error(_post(server.url, path, body), 400, param)
