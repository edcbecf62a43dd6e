"""The bounds on one HTTP request that the server applies before any route runs (no dependencies, so
that the command line can show their defaults without the server's packages installed)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limits:
    """Bounds on what one HTTP request may cost, before any route runs. Each field's help is that of its
    `dgemma serve` flag (--max-body-bytes, ...), which the command line makes from these fields."""

    max_body_bytes: int = field(default=8 * 2**20, metadata={"help": "largest request body in bytes, 413 above"})
    body_timeout: float = field(default=30.0, metadata={"help": "seconds a client has to send a body, 408 after"})
    header_timeout: float = field(
        default=10.0, metadata={"help": "seconds a client has to send its headers (the connection closes after)"}
    )
    max_queued_tokens: int = field(
        default=65536,
        metadata={"help": "prompt tokens waiting for their prefill, 429 above (one longer request may wait alone)"},
    )
