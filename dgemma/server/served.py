"""What the server's routes share: the served model, its tokenizer and engine, and the checks every
generation route makes before it builds its program (model name, characters, context, settings)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..engine import Engine
from ..generate import context_room
from ..model import DiffusionGemma
from ..settings import SETTINGS, SamplingParams
from .protocol import ApiError


@dataclass
class Served:
    """What the routes share: the model, its tokenizer and engine, and the server's settings."""

    model: DiffusionGemma  # the reference modules (configs); passes run through engine.runner
    tokenizer: object
    engine: Engine
    name: str
    request_timeout: float
    tokenizing: asyncio.Semaphore
    context: int  # the most positions one request may use (prompt + generated): its KV cache's size
    compiling: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))  # schemas, one at a time

    @property
    def canvas(self) -> int:
        return self.model.config.canvas_length

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def check_model(served: Served, name: str | None) -> None:
    if name is not None and name != served.name:
        raise ApiError(
            404, f"the model {name!r} does not exist; this server has {served.name!r}", "model", code="model_not_found"
        )


async def tokenize(served: Served, fn, *args, param: str, **kwargs):
    """Run a tokenizer or image call on a worker thread (a few at a time); its ValueErrors are 400s naming
    `param`."""
    async with served.tokenizing:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ValueError as e:
            raise ApiError(400, str(e), param) from e


async def compile_plans(served: Served, http, fn, *args, param: str):
    """Compile a schema's plan (or tools' plans: `fn(*args)`) on a worker thread, one compile at a time (a
    compile holds the GIL that the engine's step loop needs between its passes) and not at all for a client
    that left while it waited (a repeated schema is a cache hit: dgemma.structured.plans); its ValueErrors
    are 400s naming `param`."""
    async with served.compiling:
        if http is not None and await http.is_disconnected():
            raise ApiError(499, "the client closed the request")
        try:
            return await asyncio.to_thread(fn, *args)
        except ValueError as e:
            raise ApiError(400, str(e), param) from e


def check_chars(served: Served, chars: int, param: str) -> None:
    """A text of more characters than the context could hold even at the longest token is refused
    before it is tokenised."""
    limit = served.context * served.tokenizer.max_token_chars
    if chars > limit:
        raise ApiError(
            400,
            f"{param} has {chars} characters, more than the context of {served.context} tokens can hold",
            param,
            code="context_length_exceeded",
        )


def room(served: Served, prompt_len: int) -> int:
    """The tokens the context leaves after a prompt, in whole canvases (what the engine generates)."""
    return context_room(served.context, served.canvas, prompt_len)


def budget(served: Served, requested: int | None, prompt_len: int, param: str, prompt_param: str) -> int:
    """The tokens to generate: as requested (or the checkpoint's default), within the context."""
    c, left = served.canvas, room(served, prompt_len)
    if left <= 0:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens, which leaves no room for a canvas of {c} in the "
            f"context of {served.context} (dgemma serve --max-context)",
            prompt_param,
            code="context_length_exceeded",
        )
    max_tokens = requested or min(served.model.generation_config.max_new_tokens, left)
    if max_tokens > left:
        raise ApiError(
            400,
            f"{param} is too large: with a prompt of {prompt_len} tokens, at most {left} tokens fit in the "
            f"context of {served.context} (whole canvases of {c}; dgemma serve --max-context)",
            param,
            code="context_length_exceeded",
        )
    return max_tokens


def resolve(served: Served, params: SamplingParams) -> SamplingParams:
    """The settings with the checkpoint's defaults filled in; a 400 naming the field if they are invalid."""
    try:
        return params.resolve(served.model.generation_config, served.model.text_config.eos_token_ids)
    except ValueError as e:
        message = str(e)  # the first setting the message names (the longest, where one name starts another)
        named = sorted((message.find(name), -len(name), name) for name in SETTINGS if name in message)
        raise ApiError(400, message, named[0][2] if named else None) from e
