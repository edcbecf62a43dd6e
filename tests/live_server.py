"""A real `dgemma serve` HTTP server (dgemma.server.http: uvicorn with the header deadline and the draining
shutdown) on a free loopback port in a background thread, for tests that need a live HTTP server."""

from __future__ import annotations

import socket
import threading
import time

from dgemma.server.http import make_server

KEY = "sk-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`with LiveServer(app) as live:` serves `app` at `live.url` until the block ends."""

    def __init__(self, app, **server_options):
        self.port = _free_port()
        self.server = make_server(app, "127.0.0.1", self.port, log_level="error", **server_options)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=15)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
