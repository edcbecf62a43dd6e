"""Running the app under uvicorn with the bounds a public server needs and uvicorn lacks by default:

- a deadline for a request's headers (uvicorn waits for them forever, so slow-header clients could hold
  every connection): `HeaderTimeoutH11`, uvicorn's own h11 protocol with one timer added;
- a bounded graceful shutdown: on SIGTERM / Ctrl-C the engine drains first (every running stream gets an
  error event and `[DONE]`, every waiting request a 503), then uvicorn waits at most `shutdown_timeout`
  seconds for connections before it closes them.
"""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import Limits


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers do not all arrive within
    `header_timeout` seconds of its first byte (or of the connection's start)."""

    header_timeout = Limits().header_timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late, self.cycle)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self, cycle_then) -> None:
        self._header_timer = None
        if self.cycle is cycle_then:  # no new request started since the timer was set
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:
            self._disarm()  # a request's headers are complete
        elif idle:
            self._arm()  # bytes of a next request: its headers are now on the clock

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains the app's engine before its own graceful shutdown."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.dgemma_app = app

    async def shutdown(self, sockets=None) -> None:
        engine = getattr(self.dgemma_app.state, "engine", None)
        if engine is not None:
            engine.drain()
            await asyncio.sleep(0.2)  # let the streams send their last events
        await super().shutdown(sockets)


def make_server(
    app: FastAPI,
    host: str,
    port: int,
    *,
    log_level: str = "warning",
    limits: Limits | None = None,
    shutdown_timeout: float = 10.0,
) -> DrainingServer:
    """A uvicorn server for `app` with the header deadline and the bounded, draining shutdown."""
    limits = limits or Limits()
    protocol = type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout": limits.header_timeout})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol,
        timeout_graceful_shutdown=max(1, round(shutdown_timeout)),
        timeout_keep_alive=5,
    )
    return DrainingServer(config, app)
