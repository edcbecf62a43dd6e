"""The choices of one HTTP request, run on the engine: submission, the events of every choice merged into
one stream of pieces (text, drafts, ends), stop strings applied as soon as they are final, cancellation
when the client goes away. Both endpoints, streaming or not, read the same pieces."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import torch

from ..engine import Engine, EngineRequest, QueueFull, RequestTimeout, ShuttingDown
from ..generate import DoneEvent, DraftEvent, GenerationResult, SamplingParams, TokensEvent
from ..structured import StructuredOutputError
from .output import StreamText
from .protocol import ApiError

log = logging.getLogger("dgemma.server")
POLL_SECONDS = 0.25  # how often a wait checks whether the client is still there (a left client frees the engine)


class _Sink:
    """Lets the engine thread hand events to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class Piece:
    """Something to send for one choice: text ("content" / "reasoning"), a "draft", or its "end"."""

    index: int
    kind: str
    text: str = ""
    draft: dict | None = None
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
    answer: str | None = None  # the text to send, when a finish writes it (a JSON answer) rather than decoding
    finish_reason: str | None = None  # set by a finish that knows (a whole JSON answer: "stop")
    logprobs: tuple[list[float], list] | None = None  # with logprobs: per output token, and its alternatives


# After a choice's request is done: its output tokens and the row they come from (see run's `finish`).
Finish = Callable[[Choice, GenerationResult], Awaitable[tuple[list[int], int]]]


def as_api_error(event: Exception) -> ApiError:
    """The HTTP answer to an exception the engine reported for a request."""
    if isinstance(event, RequestTimeout):
        return ApiError(504, str(event), kind="timeout_error", code="timeout")
    if isinstance(event, ShuttingDown):
        return ApiError(503, str(event), kind="server_error", code="shutting_down")
    if isinstance(event, StructuredOutputError):
        return ApiError(422, str(event), "response_format", code="json_unsatisfied")
    if isinstance(event, ValueError):
        return ApiError(400, str(event))
    log.error("generation failed: %r", event)
    return ApiError(500, "generation failed", kind="server_error")


def submit(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    *,
    stops: list[str] | None,
    reasoning: bool,
    pins: torch.Tensor | list[torch.Tensor] | None = None,
    allowed=None,
    logprobs: int | None = None,
    pixels=None,
    want_drafts: bool = False,
    timeout: float | None = None,
) -> list[Choice]:
    """One engine request per prompt and choice (choice i of prompt j has index j * n + i, seed + i);
    `pins` and `allowed` are the same for every prompt, or lists of one per prompt."""
    check_capacity(engine, len(prompts) * n)
    loop = asyncio.get_running_loop()
    choices: list[Choice] = []
    for j, prompt in enumerate(prompts):
        for i in range(n):
            seed = None if params.seed is None else (params.seed + i) % 2**63
            shape = dict(pins=pins[j] if isinstance(pins, list) else pins)
            shape["allowed"] = allowed[j] if isinstance(allowed, list) else allowed
            given = dict(**shape, logprobs=logprobs, pixels=pixels, want_drafts=want_drafts)
            req = EngineRequest(prompt, replace(params, seed=seed), **given, timeout=timeout)
            try:
                _submit(engine, req, loop)
            except ApiError:
                for c in choices:
                    c.request.cancel()
                raise
            choices.append(Choice(j * n + i, req, StreamText(stops, reasoning)))
    return choices


def check_capacity(engine: Engine, choices: int) -> None:
    """A 400 naming `n` when a request's choices cannot all be held at once."""
    if choices > engine.capacity:
        raise ApiError(400, f"{choices} choices exceed what this server holds at once ({engine.capacity})", "n")


def _submit(engine: Engine, request: EngineRequest, loop: asyncio.AbstractEventLoop) -> None:
    """Queue one request whose events go to an asyncio queue; a full queue is a 429, draining a 503."""
    request.events = _Sink(loop)
    try:
        engine.submit(request)
    except ShuttingDown as e:
        raise as_api_error(e) from e
    except QueueFull as e:
        raise ApiError(429, str(e), kind="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from e


async def rerun(engine: Engine, request: EngineRequest, seed: int | None) -> GenerationResult:
    """The same request again with another seed, to its end (a retry of an answer that did not validate);
    the engine's error if it fails, cancelled if this is."""
    timeout = None
    if request.timeout is not None:  # the deadline stays the first request's
        timeout = max(request.timeout - (time.monotonic() - request.submitted), 1e-3)
    params = replace(request.params, seed=seed)
    given = dict(pins=request.pins, allowed=request.allowed, logprobs=request.logprobs, pixels=request.pixels)
    return await run_to_end(engine, EngineRequest(request.prompt, params, **given, timeout=timeout))


async def run_to_end(engine: Engine, request: EngineRequest) -> GenerationResult:
    """Queue `request` and wait for its result (a retry, or a free draft that sizes a JSON answer); the
    engine's error if it fails, cancelled if this is."""
    _submit(engine, request, asyncio.get_running_loop())
    try:
        while True:
            event = await request.events.queue.get()
            if isinstance(event, Exception):
                raise event
            if isinstance(event, DoneEvent):
                return event.result
    finally:
        request.cancel()


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


def _on_event(choice: Choice, event, decode) -> list[Piece]:
    """What one engine event of a choice gives to send."""
    if isinstance(event, Exception):
        choice.ended = True
        return [Piece(choice.index, "end", error=as_api_error(event))]
    if isinstance(event, DraftEvent):
        ids = event.drafts[0].tolist()
        draft = {
            "canvas": event.canvas_index,
            "step": event.step,
            "text": decode(ids),
            "tokens": [decode([t]) for t in ids],
        }
        return [Piece(choice.index, "draft", draft=draft)]
    if not isinstance(event, TokensEvent | DoneEvent):
        return []
    done = isinstance(event, DoneEvent)
    pieces = _on_tokens(choice, event, decode, final=done)
    if done:
        result = event.result
        if result.logprobs is not None:
            choice.logprobs = (result.logprobs[choice.row], result.top_logprobs[choice.row])
        choice.steps_per_canvas = event.result.stats.steps_per_canvas[choice.row]
        choice.tokens_per_forward = round(event.result.stats.tokens_per_forward[choice.row], 3)
    if done or choice.text.stopped:
        choice.ended = True
        given = "stop" if choice.text.stopped else choice.finish_reason  # a stop string, or the finish's word
        reason = given or event.result.finish_reasons[choice.row]
        pieces.append(Piece(choice.index, "end", finish_reason=reason))
    return pieces


async def _finished(choice: Choice, event, finish: Finish | None):
    """The event as run hands it on: with `finish`, tokens come from the done request as a whole (rows
    of an infill: the chosen middle), so per-row token events are passed over."""
    if finish is None or not isinstance(event, TokensEvent | DoneEvent):
        return event
    if isinstance(event, TokensEvent):
        return None
    try:
        choice.tokens, choice.row = await finish(choice, event.result)
    except Exception as e:  # reported as this choice's end
        return e
    return event


async def run(choices: list[Choice], decode, is_disconnected, finish: Finish | None = None) -> AsyncIterator[Piece]:
    """The pieces of all choices as they come; the engine work stops when this ends, however it ends
    (every choice finished, the client went away, or the consumer stopped reading). `finish(choice,
    result)`, if given, makes a choice's output from its finished request (infilling: the middle)."""
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
                event = await _finished(choice, pending.pop(k).result(), finish)
                for piece in _on_event(choice, event, decode):
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
