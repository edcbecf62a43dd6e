"""Property-based fuzzing of the live server from its own OpenAPI schema (schemathesis): whatever the body,
the answer is never a 5xx. Generation sizes are clamped so that each case stays short on a CPU; the
oversized and invalid values themselves are covered by test_server.py."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
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
