"""Property-based fuzzing of the live server from its own OpenAPI schema (schemathesis): whatever the body,
the answer is never a 5xx, and an error is in the shape of the route's dialect. Generation sizes are clamped
so that each case stays short on a CPU; the oversized and invalid values themselves are covered by
test_server_limits.py, and the requests that once broke the server (tests/hostile.py, and its DIALECTS for
the Responses, Messages, Ollama and llama.cpp routes) are replayed here, one by one and then under concurrent
streams."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hostile import (  # noqa: E402
    DIALECTS,
    HOSTILE,
    ISSUE_56,
    PARAMS,
    STREAMED,
    body_bytes,
    dialect_error,
    is_openai_error,
    replay,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from live_server import KEY  # noqa: E402

from dgemma.server.protocol import dialect_of  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
# the largest value each field keeps when it is a number (smaller and invalid values pass unchanged); a
# missing max_tokens is set too, so that no case generates up to the context's end
CLAMP = {"max_tokens": 12, "max_completion_tokens": 12, "max_denoising_steps": 3, "n": 2}
# the same for the dialect routes, by path: (where, field, its largest value); `where` is the body itself or
# the object under that key (created when missing, left alone when the fuzzer chose a non-object). The
# lengths that mean "not given" (llama.cpp's -1, Ollama's -1 and -2) are clamped as well.
FAST = ("dgemma", "max_denoising_steps", 3)
DIALECT_CLAMP = {
    "/api/chat": [("options", "num_predict", 8), ("options", "max_denoising_steps", 3)],
    "/api/generate": [("options", "num_predict", 8), ("options", "max_denoising_steps", 3)],
    "/v1/messages": [(None, "max_tokens", 8), FAST],
    "/v1/responses": [(None, "max_output_tokens", 12), FAST],
    "/infill": [(None, "n_predict", 8), FAST],
    "/completion": [(None, "n_predict", 8), FAST],
}
DIALECT_EXAMPLES = 15  # examples per operation of the dialect routes (40 doubled the run's time)
DIALECT_ROUTES = {
    "POST /v1/responses", "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /infill", "POST /completion",
    "POST /api/chat", "POST /api/generate", "POST /api/show", "GET /api/tags", "GET /api/ps", "GET /api/version",
}  # fmt: skip
UNBOUNDED = {"n_predict": (-1,), "num_predict": (-1, -2)}


def _clamp(body: dict, name: str, top: int) -> None:
    """`body[name]` at most `top` (set when missing; an invalid value is left to be refused)."""
    value = body.setdefault(name, top)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and (value > top or value in UNBOUNDED.get(name, ())):
        body[name] = top


def _clamped(path: str, body: dict) -> None:
    if path in DIALECT_CLAMP:
        for where, name, top in DIALECT_CLAMP[path]:
            inner = body if where is None else body.setdefault(where, {})
            if isinstance(inner, dict):
                _clamp(inner, name, top)
        if path.startswith("/api/"):
            body.setdefault("stream", False)  # Ollama streams unless told not to
            if isinstance(body.get("model"), str):  # the served one: else nearly every case is a 404 (DIALECTS
                body["model"] = "tiny"  # holds another model's)
            if "num_predict" in body:  # where Open WebUI puts it
                _clamp(body, "num_predict", 8)
    elif dialect_of(path) == "openai":
        body.setdefault("max_tokens", CLAMP["max_tokens"])
        for name, top in CLAMP.items():
            value = body.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > top:
                body[name] = top


def _check(case) -> None:
    if isinstance(case.body, dict):
        _clamped(case.path, case.body)
    response = case.call(headers=AUTH, timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:  # an error body in the route's dialect, never a traceback
        assert dialect_error(response) is not None, (case.method, case.path, case.body, response.text[:500])


def test_no_server_errors(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        *DIALECT_ROUTES,
    }
    for op in operations:
        examples = DIALECT_EXAMPLES if f"{op.method.upper()} {op.path}" in DIALECT_ROUTES else 40
        run = settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)(
            given(case=op.as_strategy())(_check)
        )
        run()


# -- the requests that once broke the server (tests/hostile.py), once each and then all at once ----------------


@pytest.mark.parametrize("name, path, body, statuses", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_is_a_4xx(server, name, path, body, statuses):
    async def one():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await replay(client, path, body, KEY)

    response = asyncio.run(one())
    assert response.status_code in statuses and is_openai_error(response), (
        name,
        response.status_code,
        response.text[:300],
    )
    if name in PARAMS:
        assert (response.json()["error"]["param"] or "").startswith(PARAMS[name]), response.text[:300]


def _submitted(server) -> float:
    """The requests the server's engine has been given (its /metrics counter)."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("dgemma_requests_total")))


@pytest.mark.parametrize("name, path, body, statuses", ISSUE_56, ids=[h[0] for h in ISSUE_56])
def test_errors_knowable_before_a_pass_never_reach_the_engine(server, name, path, body, statuses):
    """Issue 56: each is a 400 naming its field, streamed or not, and the engine never sees the request
    (no program is submitted, so no model pass runs for it)."""
    before = _submitted(server)
    response = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == PARAMS[name], response.text
    assert _submitted(server) == before


def _post(server, path: str, body: object) -> httpx.Response:
    """`body` as it is (bytes, or JSON as json.dumps writes it: a lone surrogate as its escape)."""
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=body_bytes(body), headers=headers, timeout=120)


@pytest.mark.parametrize("name, path, body, statuses, param", DIALECTS, ids=[d[0] for d in DIALECTS])
def test_hostile_dialect_body_is_a_4xx_in_its_shape(server, name, path, body, statuses, param):
    """Issue 57: each hostile body of a dialect's route is a 4xx in that dialect's error shape, naming its
    field (or a field inside it), the same error streamed or not, and the engine never sees it."""
    before = _submitted(server)
    response = _post(server, path, body)
    error = dialect_error(response)
    assert response.status_code in statuses and error is not None, (response.status_code, response.text[:300])
    if param is not None and response.status_code != 413:  # (a body too large is refused before it is read)
        named = error[1] or ""
        deeper = dialect_of(path) != "llama.cpp"  # (llama.cpp's name the very field)
        assert named == param or (deeper and named.startswith(param + ".")), (param, error)
    if isinstance(body, dict) and path in STREAMED and "stream" not in body:
        streamed = _post(server, path, {**body, "stream": not path.startswith("/api/")})  # Ollama's default: True
        assert (streamed.status_code, streamed.json()) == (response.status_code, response.json())
    assert _submitted(server) == before


def test_hostile_requests_under_concurrent_streams(server):
    """16 clients at once, each streaming a real completion and replaying a share of the hostile requests
    (every dialect's too): no 5xx, every stream ends with [DONE], and /health answers promptly throughout."""

    async def stream(client) -> tuple[int, str]:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "stream": True}
        body["max_denoising_steps"] = 3
        headers = {"Authorization": f"Bearer {KEY}"}
        for _ in range(100):  # 16 streams > the fixture's 12 places: a 429 says when to come back, as clients do
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                lines = [line async for line in r.aiter_lines() if line]
            if r.status_code != 429:
                return r.status_code, lines[-1]
            await asyncio.sleep(float(r.headers["retry-after"]) / 10)
        return 429, ""

    async def worker(client, i: int) -> list[int]:
        statuses = []
        for name, path, body, *_ in [*HOSTILE, *DIALECTS][i::16]:
            if name == "100 MB body":
                continue  # sent once above; 16 copies would only measure loopback bandwidth
            statuses.append((await replay(client, path, body, KEY)).status_code)
        assert await stream(client) == (200, "data: [DONE]")
        return statuses

    async def health_probe(client, stop: asyncio.Event) -> float:
        worst = 0.0
        while not stop.is_set():
            t0 = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(0.05)
        return worst

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            stop = asyncio.Event()
            probe = asyncio.create_task(health_probe(client, stop))
            results = await asyncio.gather(*(worker(client, i) for i in range(16)))
            stop.set()
            return [s for r in results for s in r], await probe

    statuses, worst_health = asyncio.run(main())
    assert statuses and all(400 <= s < 500 for s in statuses), statuses
    assert worst_health < 3.0  # the event loop never blocked on a request's parsing or tokenising
