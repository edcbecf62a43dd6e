"""The choices of one HTTP request, run on the engine: each choice is a program (dgemma/programs.py) the
route built, submitted; the events of every choice are merged into one stream of pieces (text, drafts,
ends), stop strings applied as soon as they are final, cancellation when the client goes away. A
composite program's answer (JSON, a tool call, an infill's middle, a chosen option) is whole: it is sent
when the choice ends. Both endpoints, streaming or not, read the same pieces."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field

from ..calls import DoneEvent
from ..editing import InfillResult
from ..engine import Engine, EngineRequest, QueueFull, RequestTimeout, ShuttingDown
from ..generate import DraftEvent, GenerationResult, TokensEvent
from ..programs import Chosen
from ..structured import JsonResult, StructuredOutputError
from .output import StreamText
from .protocol import ApiError

log = logging.getLogger("dgemma.server")
POLL_SECONDS = 0.05  # how often a wait checks whether the client is still there (a left client frees the engine)


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
    answer: str | None = None  # the text to send, when the program writes it (a JSON answer) rather than decoding
    finish_reason: str | None = None  # set by a program whose answer is whole ("stop")
    logprobs: tuple[list[float], list] | None = None  # with logprobs: per output token, and its alternatives


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


# A route's programs: build(j, seed) is choice i of prompt j's program, run with seed + i.
Build = Callable[[int, int | None], Generator]


def submit(
    engine: Engine,
    prompts: int,
    n: int,
    build: Build,
    *,
    seed: int | None,
    stops: list[str] | None,
    reasoning: bool,
    prompt_tokens: list[int],
    want_drafts: bool = False,
    reference: bool = False,
    timeout: float | None = None,
) -> list[Choice]:
    """One engine request per prompt and choice (choice i of prompt j has index j * n + i, seed + i), its
    program made by `build`; `prompt_tokens` per prompt (the prefill the queue is bounded in)."""
    check_capacity(engine, prompts * n)
    loop = asyncio.get_running_loop()
    choices: list[Choice] = []
    for j in range(prompts):
        for i in range(n):
            program = build(j, None if seed is None else (seed + i) % 2**63)
            given = dict(want_drafts=want_drafts, reference=reference, timeout=timeout)
            req = EngineRequest(program, prompt_tokens=prompt_tokens[j], **given)
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


async def outcome(engine: Engine, program: Generator, timeout: float | None = None):
    """Run one program that streams nothing (a prompt's logprobs, a canvas's scores) and return its
    result; what the engine reported as the HTTP error, cancelled if this is."""
    request = EngineRequest(program, timeout=timeout)
    _submit(engine, request, asyncio.get_running_loop())
    try:
        while True:
            event = await request.events.queue.get()
            if isinstance(event, Exception):
                raise as_api_error(event)
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
    if done or choice.text.stopped:
        choice.ended = True
        given = "stop" if choice.text.stopped else choice.finish_reason  # a stop string, or a whole answer
        reason = given or generated.finish_reasons[choice.row]
        pieces.append(Piece(choice.index, "end", finish_reason=reason))
    return pieces


def _adopt(choice: Choice, result, tokenizer) -> GenerationResult | None:
    """A choice's output from its program's result: a plain generation's tokens came as events; a
    composite program's answer is whole (an infill's chosen middle; JSON, a tool call or a chosen option,
    written as text). Returns the generation behind it, if any (logprobs, steps)."""
    if isinstance(result, GenerationResult):
        return result
    if isinstance(result, InfillResult):
        choice.tokens, choice.row = result.middle, result.row
        choice.details = {"middle_length": result.middle_length}
        if result.scores:
            choice.details["middle_scores"] = {str(n): round(s, 4) for n, s in result.scores.items()}
        return result.result
    if isinstance(result, Chosen):
        choice.answer = result.option
        choice.details = {"choice_index": result.index, "choice_scores": [round(s, 4) for s in result.scores]}
        generated = None
    else:  # a JsonResult, or a ToolCall (its arguments' JsonResult, None for a call without arguments)
        choice.answer = result.text
        answer = result if isinstance(result, JsonResult) else result.json
        choice.details = {"json_attempts": answer.attempts} if answer is not None else {}
        generated = None if answer is None else answer.result
    choice.tokens = tokenizer.encode(choice.answer, add_special_tokens=False)
    choice.finish_reason = "stop"
    return generated


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
