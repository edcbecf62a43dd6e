"""Property-based fuzzing of the live server from its own OpenAPI schema (schemathesis): whatever the body,
the answer is never a 5xx. Generation sizes are clamped so that each case stays short on a CPU; the
oversized and invalid values themselves are covered by test_server_limits.py, and the requests that once
broke the server (tests/hostile.py) are replayed here, one by one and then under concurrent streams."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hostile import HOSTILE, ISSUE_56, PARAMS, is_openai_error, replay  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from live_server import KEY  # noqa: E402

# the largest value each field keeps when it is a number (smaller and invalid values pass unchanged); a
# missing max_tokens is set too, so that no case generates up to the context's end
CLAMP = {"max_tokens": 12, "max_completion_tokens": 12, "max_denoising_steps": 3, "n": 2}


def _check(case) -> None:
    if isinstance(case.body, dict):
        case.body.setdefault("max_tokens", CLAMP["max_tokens"])
        for name, top in CLAMP.items():
            value = case.body.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > top:
                case.body[name] = top
    response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:  # an OpenAI-style error body, never a traceback
        assert response.json()["error"]["message"] and "Traceback" not in response.text


def test_no_server_errors(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
    }
    for op in operations:
        run = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)(
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


def test_hostile_requests_under_concurrent_streams(server):
    """16 clients at once, each streaming a real completion and replaying a share of the hostile requests:
    no 5xx, every stream ends with [DONE], and /health answers promptly throughout."""

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
        for name, path, body, _ in HOSTILE[i::16]:
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
