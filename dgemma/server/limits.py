"""The bounds on one HTTP request that the server applies before any route runs (no dependencies, so
that the command line can show their defaults without the server's packages installed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Bounds on what one HTTP request may cost, before any route runs."""

    max_body_bytes: int = 8 * 2**20  # 413 above
    body_timeout: float = 30.0  # seconds to receive the whole body (408 after)
    header_timeout: float = 10.0  # seconds to receive a request's headers (the connection is closed after)
