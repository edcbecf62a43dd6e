"""What the generation routes share: the served model, its checks before a task is built, and the run of a
request's choices on the engine. Each choice is a program of the route's task (dgemma/generation/programs.py),
submitted; the events of every choice are merged into one stream of pieces (text, drafts, ends), stop strings
applied as soon as they are final, cancellation when the client goes away. A result's answer (`answer()`)
says what to send: a generation's tokens came as events, a whole answer (JSON, a call, an infill's middle,
an option) is sent when the choice ends. Every route, streaming or not, reads the same pieces."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ..generation.engine import (
    DoneEvent,
    DraftEvent,
    Engine,
    EngineRequest,
    RequestTimeout,
    ShuttingDown,
    TokensEvent,
)
from ..generation.sampling import RequestError
from ..model.model import DiffusionGemma
from ..structured import StructuredOutputError
from .output import StreamText
from .protocol import ApiError

log = logging.getLogger("dgemma.server")
POLL_SECONDS = 0.05  # how often a wait checks whether the client is still there (a left client frees the engine)


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

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


@dataclass
class Piece:
    """Something to send for one choice: text ("content" / "reasoning"), a "draft", its tool "calls" (read
    out of its text when tools are offered: answers.with_calls), or its "end"."""

    index: int
    kind: str
    text: str = ""
    draft: dict | None = None
    calls: list[tuple[str, dict]] | None = None  # (name, arguments) of each call
    finish_reason: str | None = None
    error: ApiError | None = None  # an end that is an error (a timeout, a shutdown)


@dataclass
class Choice:
    """One choice: its engine request and what it has produced so far."""

    index: int
    request: EngineRequest
    text: StreamText
    tokens: list[int] = field(default_factory=list)
    returned_tokens: int = 0  # tokens behind the text sent (what usage counts)
    steps_per_canvas: list[int] = field(default_factory=list)
    tokens_per_forward: float = 0.0
    ended: bool = False
    row: int = 0  # the row of the request's result that is this choice's output (an infill's chosen length)
    details: dict = field(default_factory=dict)  # what the answer says of this choice in its `dgemma` block
    answer: str | None = None  # the text to send, when the program writes it (a JSON answer) rather than decoding
    finish_reason: str | None = None  # set by a program whose answer is whole ("stop")
    logprobs: tuple[list[float], list] | None = None  # with logprobs: per output token, and its alternatives
    prediction: tuple[int, int] | None = None  # with a prediction: its (accepted, rejected) tokens

    def stop_string(self, decode: Callable[[list[int]], str]) -> str | None:
        """The stop string that ended this choice's text, or None."""
        if not self.text.stopped:
            return None
        text = decode(self.tokens) if self.answer is None else self.answer
        return next((s for s in self.text.stops or [] if text.startswith(s, self.text.cut)), None)


def as_api_error(event: Exception) -> ApiError:
    """The HTTP answer to an exception the engine reported for a request."""
    if isinstance(event, RequestTimeout):
        return ApiError(504, str(event), kind="timeout_error", code="timeout")
    if isinstance(event, ShuttingDown):
        return ApiError(503, str(event), kind="server_error", code="shutting_down")
    if isinstance(event, StructuredOutputError):
        return ApiError(422, str(event), "response_format", code="json_unsatisfied")
    if isinstance(event, RequestError):
        return ApiError(400, str(event), event.param, code=event.code)
    log.error("generation failed: %r", event)
    return ApiError(500, "generation failed", kind="server_error")


def _tokens_covering(tokens: list[int], chars: int, decode: Callable[[list[int]], str]) -> int:
    """The fewest leading tokens whose text reaches `chars` characters (what a cut text was made of)."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(tokens[:mid])) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _on_tokens(choice: Choice, event, decode, final: bool) -> list[Piece]:
    """Text pieces from a choice's new final tokens; a stop string ends the choice here."""
    if isinstance(event, TokensEvent):
        choice.tokens.extend(event.tokens)
    text = decode(choice.tokens) if choice.answer is None else choice.answer
    pieces = [Piece(choice.index, kind, piece) for kind, piece in choice.text.feed(text, final=final)]
    if choice.text.stopped:
        choice.returned_tokens = _tokens_covering(choice.tokens, choice.text.cut, decode)
    else:
        choice.returned_tokens = len(choice.tokens)
    return pieces


def _on_event(choice: Choice, event, tokenizer) -> list[Piece]:
    """What one engine event of a choice gives to send."""
    if isinstance(event, Exception):
        choice.ended = True
        return [Piece(choice.index, "end", error=as_api_error(event))]
    if isinstance(event, DraftEvent):
        ids = event.drafts[0].tolist()
        draft = {
            "canvas": event.canvas_index,
            "step": event.step,
            "text": tokenizer.decode(ids),
            "tokens": [tokenizer.decode([t]) for t in ids],
        }
        return [Piece(choice.index, "draft", draft=draft)]
    if not isinstance(event, TokensEvent | DoneEvent):
        return []
    done = isinstance(event, DoneEvent)
    generated = _adopt(choice, event.result, tokenizer) if done else None
    pieces = _on_tokens(choice, event, tokenizer.decode, final=done)
    if generated is not None:
        if generated.logprobs is not None:
            choice.logprobs = (generated.logprobs[choice.row], generated.top_logprobs[choice.row])
        choice.steps_per_canvas = generated.stats.steps_per_canvas[choice.row]
        choice.tokens_per_forward = round(generated.stats.tokens_per_forward[choice.row], 3)
        if generated.accepted_prediction_tokens is not None:
            counts = generated.accepted_prediction_tokens, generated.rejected_prediction_tokens
            choice.prediction = counts[0][choice.row], counts[1][choice.row]
    if done or choice.text.stopped:
        choice.ended = True
        given = "stop" if choice.text.stopped else choice.finish_reason  # a stop string, or a whole answer
        reason = given or generated.finish_reasons[choice.row]
        pieces.append(Piece(choice.index, "end", finish_reason=reason))
    return pieces


def _adopt(choice: Choice, result, tokenizer):
    """A choice's output from its program's result (`answer()`): a generation's tokens came as events; a
    whole answer (JSON, a call, an option) is written as text, an infill's middle is its tokens. Returns
    the generation behind it, if any (logprobs, steps)."""
    answer = result.answer()
    choice.row, choice.details, choice.finish_reason = answer.row, answer.details, answer.finish_reason
    choice.answer = answer.text
    if answer.text is not None:
        choice.tokens = tokenizer.encode(answer.text, add_special_tokens=False)
    elif answer.tokens is not None:
        choice.tokens = list(answer.tokens)
    return answer.generation


async def run(choices: list[Choice], tokenizer, is_disconnected) -> AsyncIterator[Piece]:
    """The pieces of all choices as they come; the engine work stops when this ends, however it ends
    (every choice finished, the client went away, or the consumer stopped reading)."""
    pending: dict[int, asyncio.Future] = {}
    clock = asyncio.get_running_loop().time
    checked = clock()
    try:
        for k, c in enumerate(choices):
            pending[k] = asyncio.ensure_future(c.request.events.queue.get())
        while pending:
            done, _ = await asyncio.wait(pending.values(), timeout=POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
            if clock() - checked >= POLL_SECONDS:  # busy or idle, the client is looked for every POLL_SECONDS
                checked = clock()
                if await is_disconnected():
                    return
            if not done:
                continue
            for k in [k for k, fut in pending.items() if fut in done]:
                choice = choices[k]
                event = pending.pop(k).result()
                for piece in _on_event(choice, event, tokenizer):
                    yield piece
                if choice.ended:
                    choice.request.cancel()
                else:
                    pending[k] = asyncio.ensure_future(choice.request.events.queue.get())
    finally:
        for fut in pending.values():
            fut.cancel()
        for c in choices:
            c.request.cancel()
