"""The client dialects besides OpenAI's Chat Completions: each module maps its bodies onto a chat or
completions body (`start_mapped`, so every rule, limit and default is the task's and the chat body's, stated
once) and the pieces that come back onto its own answer and stream shapes; errors name the dialect's fields
(`Renames`). docs/server.md has the table of what each takes and refuses."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request
from pydantic import ValidationError

from ..protocol import ApiError, ChatCompletionRequest, validation_error
from ..routes import Started, start_chat, start_completion
from ..runs import Piece, Served

# the settings another dialect takes under its `dgemma` key (the chat body's fields of the same names)
EXTENSIONS = frozenset(
    {"max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold"}
    | {"sampler", "confidence", "tokens_per_step", "mode", "early_commit", "early_commit_steps"}
    | {"early_commit_entropy", "greedy", "seed", "retries", "ignore_eos", "max_soft_tokens", "cache_prompt"}
)


def extensions(value: dict | None) -> dict:
    """A dialect's `dgemma` object: settings the chat body takes under the same names (checked there)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, "dgemma: must be an object of dgemma's settings", "dgemma")
    for key in value:
        if key not in EXTENSIONS:
            raise ApiError(400, f"dgemma.{key}: not a dgemma setting (see docs/server.md)", f"dgemma.{key}")
    return dict(value)


class Renames:
    """A dialect's names for the fields of the chat or completions body it was mapped onto: `names` maps a
    dotted path (`*` for any index) to the dialect's, `messages[i]` is where chat message i came from
    (`input.3`), and an extension setting is named under the dialect's `dgemma` key."""

    def __init__(self, names: dict[str, str], messages: list[str] | None = None):
        self.names, self.messages = names, messages or []

    def __call__(self, param: str) -> str:
        parts = param.split(".")
        if parts[0] == "messages" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) < len(self.messages):
            return ".".join([self.messages[int(parts[1])], *parts[2:]])
        for length in range(len(parts), 0, -1):
            head, indices = parts[:length], [p for p in parts[:length] if p.isdigit()]
            pattern = ".".join("*" if p.isdigit() else p for p in head)
            if pattern in self.names:
                named = self.names[pattern]
                for i in indices[len(indices) - named.count("*") :]:  # a name with fewer indices keeps the last
                    named = named.replace("*", i, 1)
                return ".".join([named, *parts[length:]])
        return f"dgemma.{param}" if parts[0] in EXTENSIONS else param


def mapped(kind: type, fields: dict, rename: Renames):
    """The chat or completions body (`kind`) `fields` make; what is wrong is a 400 in the dialect's names."""
    try:
        return kind.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e.errors()).renamed(rename) from None


async def start_mapped(served: Served, kind: type, fields: dict, http: Request, rename: Renames) -> Started:
    """A dialect's request as the chat (`kind` ChatCompletionRequest) or completions body `fields` make,
    started as that route starts it; every error names the dialect's field (`rename`)."""
    body = mapped(kind, fields, rename)
    try:
        started = await (start_chat if kind is ChatCompletionRequest else start_completion)(served, body, http)
    except ApiError as e:
        raise e.renamed(rename) from None
    return dataclasses.replace(started, pieces=_renamed(started.pieces, rename))


async def _renamed(pieces: AsyncIterator[Piece], rename: Renames) -> AsyncIterator[Piece]:
    """Pieces whose errors (a JSON answer that never validated, say) name the dialect's fields."""
    async for piece in pieces:
        yield dataclasses.replace(piece, error=piece.error.renamed(rename)) if piece.error is not None else piece
