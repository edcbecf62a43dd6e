"""What every HTTP request crosses before a route sees it, as one plain ASGI middleware: the Host header on
loopback without a key, the API key (the bearer scheme or Anthropic's `x-api-key`; constant time; `/` and
`/health` open), the body's size, time, UTF-8 and JSON bounds (read once, here), and the answer counts for
/metrics (docs/server.md, "Security").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re

from ..structured.tokens import check_body
from .limits import Limits
from .protocol import ApiError

log = logging.getLogger("dgemma.server")
OPEN_PATHS = frozenset({"/", "/health"})
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})


async def send_error(send, err: ApiError, path: str = "") -> None:
    """Answer with an error body in the dialect of the route at `path`."""
    body = json.dumps(err.body(path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\[\]:/@\s]+)(:[0-9]{1,5})?")


def _host_name(host: str) -> str | None:
    """`127.0.0.1:8000` -> `127.0.0.1`, `[::1]:8000` -> `[::1]`; None for anything that is not a host and
    an optional port (`[::1]evil.example`, `a:b:c`, an empty header)."""
    match = _HOST.fullmatch(host)
    return match.group(1).lower() if match else None


def _bearer(header: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = header.partition(b" ")
    return token.strip(b" ") if scheme.lower() == b"bearer" and token.strip(b" ") else None


class Guard:
    """The ASGI middleware described in the module docstring; `count(route, status)` records each answer."""

    def __init__(self, app, *, api_key: str | None, limits: Limits, check_host: bool, routes, count):
        self.app, self.limits, self.check_host, self.count = app, limits, check_host, count
        self.expected = api_key.encode() if api_key else None
        self.routes = routes  # () -> the set of route paths (label values are these or "other")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: dict[str, int | None] = {"code": None}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            err = self._refuse(scope)
            if err is None:
                body, err = await self._read_body(scope, receive)
            if err is not None:
                await send_error(send_counted, err, scope.get("path", ""))
            else:
                await self.app(_as_json(scope) if body else scope, _replay(body, receive), send_counted)
        except Exception:  # never a traceback to the client
            log.exception("unhandled error on %s", scope.get("path"))
            if status["code"] is None:  # nothing sent yet
                failed = ApiError(500, "internal server error", kind="server_error")
                await send_error(send_counted, failed, scope.get("path", ""))
        finally:
            path = scope.get("path", "")
            self.count(path if path in self.routes() else "other", status["code"] or 500)

    def _refuse(self, scope) -> ApiError | None:
        """A reason to refuse the request from its headers alone, or None."""
        headers = dict(scope.get("headers") or [])
        if self.check_host:
            host = headers.get(b"host", b"").decode("latin-1")
            if _host_name(host) not in LOOPBACK_HOSTS:
                return ApiError(
                    403,
                    f"the Host header {host!r} is not this machine: a server on loopback without --api-key "
                    "answers only localhost, 127.0.0.1 and [::1] (DNS-rebinding protection)",
                    kind="permission_error",
                    code="host_not_allowed",
                )
        authorized = not self.expected or scope.get("path") in OPEN_PATHS
        token = _bearer(headers.get(b"authorization", b"")) or headers.get(b"x-api-key")  # Anthropic's header
        if not authorized and not hmac.compare_digest(token or b"", self.expected):
            return ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
                kind="authentication_error",
                code="invalid_api_key",
            )
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limits.max_body_bytes):
            return _too_large(self.limits.max_body_bytes)
        return None

    async def _read_body(self, scope, receive) -> tuple[bytes, ApiError | None]:
        """The whole body, bounded in size and time; or why it was refused."""
        chunks, size = [], 0
        limit = self.limits.max_body_bytes
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return b"", ApiError(499, "the client closed the connection")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return b"", _too_large(limit)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return b"", ApiError(408, f"the request body took longer than {self.limits.body_timeout:g} s to arrive")
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return b"", ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})")
        refused = check_body(body) if body else None
        if refused is not None:
            return b"", ApiError(400, str(refused), refused.path or None)
        return body, None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server takes ({limit} bytes)", code="body_too_large")


def _as_json(scope) -> dict:
    """Every route takes JSON: a body sent as a form (`curl -d`, as Ollama's and llama.cpp's docs show it) or
    with no type is read as the JSON it was checked to be."""
    headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _replay(body: bytes, receive):
    """A `receive` that gives the body already read, then the client's later messages (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
