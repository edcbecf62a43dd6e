"""Programs and the model calls they yield: the one place a task's calls become forward passes.

A task (generate, fill, infill, JSON, a tool call, choose; dgemma/programs.py) is a generator that yields
events for its caller and model calls for its driver, and ends with a `DoneEvent` holding its result:

    logits = yield DenoiseCall(tokens, cache, self_conditioning)   # one denoising pass
    yield EncodeCall(ids, cache)                                   # a prompt's prefill, a canvas's commit
    scores = yield ScoreCall(prompt, continuations)                # log-probabilities of given continuations
    value = yield WorkCall(fn, args)                               # client-sized work between passes

The program never holds a runner. `drive(runner, program)` answers each call on its own (`answer`); the
serving engine (dgemma/engine.py) answers the calls of many programs together, batched by kind, and
runs work calls on a worker thread while the other programs' passes go on.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .kv_cache import KVCache
from .model import DiffusionGemma
from .runtime.runner import Runner, as_runner
from .vision import Pixels


@dataclass
class DenoiseCall:
    """`logits = yield DenoiseCall(...)`: one denoising pass over canvases whose prompts are in `cache`.
    Keeping the call outside the program lets a server batch the canvases of many requests."""

    tokens: torch.Tensor  # [b, C]
    cache: KVCache
    self_conditioning: torch.Tensor | None = None  # [b, C, M] the soft embedding of the previous step's logits


@dataclass
class EncodeCall:
    """`yield EncodeCall(...)` (the reply is None): encode tokens into a cache, a prompt first, then each
    committed canvas, so that a driver runs every model pass and a server schedules prefills and commits."""

    ids: torch.Tensor  # [b, T]
    cache: KVCache
    attention_mask: torch.Tensor | None = None  # [b, T], 0 marks left padding
    pixels: object = None  # vision.Pixels of the images whose placeholders `ids` holds
    is_generated: bool = False  # a committed canvas (may hold the image placeholder id), not a prompt


@dataclass
class Scores:
    """A ScoreCall's reply: per continuation, each token's log-probability [len] (CPU, fp32), and with
    `top=k` the k likeliest tokens at each of its positions as (id, log-probability)."""

    logprobs: list[torch.Tensor]
    top: list[list[list[tuple[int, float]]]] | None = None


@dataclass
class ScoreCall:
    """`scores = yield ScoreCall(prompt, continuations)`: the causal encoder's next-token log-probability of
    each token of each continuation after `prompt` (a Scores). Self-contained (its own cache), so a driver
    may answer several together."""

    prompt: list[int]
    continuations: list[list[int]]
    top: int = 0
    pixels: Any = None  # vision.Pixels of the images whose placeholders the prompt holds


@dataclass
class WorkCall:
    """`value = yield WorkCall(fn, args)`: work whose size a client decides, between passes (a schema's
    layout sized by a draft, an answer's read and validation). `drive` runs it in place; the serving engine
    on a worker thread, so that it never holds up the other requests' passes. What it raises ends the
    program."""

    fn: Callable[..., Any]
    args: tuple = ()


@dataclass
class DoneEvent:
    """A program's last event: its result (a GenerationResult, JsonResult, InfillResult, Chosen, ...)."""

    result: Any


ModelCall = DenoiseCall | EncodeCall | ScoreCall | WorkCall  # what a program asks of its driver
MODEL_CALLS = (DenoiseCall, EncodeCall, ScoreCall, WorkCall)


class LogitsBuffer:
    """One [b, C, V] fp32 logits buffer for the fast steps of a driven program (or of a server's batches):
    each step's logits are used up before the next step is asked for, and on a CPU a fresh allocation
    of this size is faulted in page by page on every step (~8 ms for 32 MB). It grows to the most rows
    asked for; `release` drops it (an idle server)."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.tensor: torch.Tensor | None = None

    def rows(self, shape: torch.Size) -> torch.Tensor:
        """The buffer's first b rows for canvas tokens of `shape` [b, C]."""
        b, c = shape
        if self.tensor is None or self.tensor.shape[1] != c or self.tensor.shape[0] < b:
            self.tensor = torch.empty(b, c, self.vocab, dtype=torch.float32, device=self.device)
        return self.tensor[:b]

    def release(self) -> None:
        self.tensor = None


@torch.no_grad()
def score(
    model: DiffusionGemma | Runner, prompt: list[int], continuations: list[list[int]], top: int = 0, pixels=None
) -> Scores:
    """What a ScoreCall asks for, in two causal passes with every continuation a row: the prompt but its
    last token (with its images, `pixels`, once per row), then that token and the continuations,
    right-padded (a causal encoder never lets a real token see the padding after it)."""
    runner = as_runner(model)
    model = runner.model
    rows = len(continuations)
    if not prompt or any(not c for c in continuations):
        raise ValueError("scoring needs a non-empty prompt and non-empty continuations")
    width = 1 + max(len(c) for c in continuations)
    tail = torch.zeros(rows, width, dtype=torch.long)
    for i, c in enumerate(continuations):
        tail[i, : 1 + len(c)] = torch.tensor(prompt[-1:] + c)
    cache = model.new_cache(rows, len(prompt) - 1 + width)
    if len(prompt) > 1:
        images = None if pixels is None else Pixels.cat([pixels] * rows)
        runner.encode(torch.tensor([prompt[:-1]] * rows, device=model.device), cache, pixels=images)
    tail = tail.to(model.device)
    logp = torch.log_softmax(runner.encode(tail, cache, return_logits=True).logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(-1, tail[:, 1:, None]).squeeze(-1)
    out = Scores([token_logp[i, : len(c)].cpu() for i, c in enumerate(continuations)])
    if top:
        out.top = [alternatives(logp[r, : len(c)], top) for r, c in enumerate(continuations)]
    return out


def alternatives(logp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The k likeliest tokens of each row of log-probabilities [n, V], as (id, log-probability)."""
    if not k:
        return [[] for _ in range(logp.shape[0])]
    top = logp.topk(k, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]


@torch.no_grad()
def answer(runner: Runner, call: ModelCall, buffer: LogitsBuffer | None = None) -> torch.Tensor | Scores | None:
    """Run one model call on `runner`: a DenoiseCall's logits (written into `buffer`'s rows where the
    runner writes in place), a ScoreCall's Scores, None for an EncodeCall, a WorkCall's value."""
    if isinstance(call, WorkCall):
        return call.fn(*call.args)
    if isinstance(call, ScoreCall):
        return score(runner, call.prompt, call.continuations, call.top, call.pixels)
    if isinstance(call, EncodeCall):
        runner.encode(call.ids, call.cache, call.attention_mask, pixels=call.pixels, is_generated=call.is_generated)
        return None
    out = buffer.rows(call.tokens.shape) if buffer is not None and runner.writes_in_place() else None
    return runner.denoise(call.tokens, call.cache, call.self_conditioning, out=out)


def drive(model: DiffusionGemma | Runner, program: Generator, observe=None) -> Iterator:
    """Run a program on its own: answer each model call (`answer`), pass its events through. `observe(call)`,
    if given, sees every DenoiseCall before it is answered (stage 2 records the states)."""
    runner = as_runner(model)
    reply, buffer = None, LogitsBuffer(runner.text_config.vocab_size, runner.device)
    while True:
        try:
            item = program.send(reply)
        except StopIteration:
            return
        if isinstance(item, MODEL_CALLS):
            if observe is not None and isinstance(item, DenoiseCall):
                observe(item)
            reply = answer(runner, item, buffer)
        else:
            reply = None
            yield item


def run(model: DiffusionGemma | Runner, program: Generator, on_event=None) -> Any:
    """Drive `program` to its end and return its result; `on_event(event)`, if given, sees every event."""
    for event in drive(model, program):
        if on_event is not None:
            on_event(event)
        if isinstance(event, DoneEvent):
            return event.result
    raise AssertionError("the program ended without a DoneEvent")


def result_of(program: Generator, passes: tuple = ()) -> Generator[Any, Any, Any]:
    """`result = yield from result_of(program)`: run a program inside another, its model calls going to the
    driver, its events of the types in `passes` through, and its result returned."""
    reply = None
    while True:
        item = program.send(reply)
        if isinstance(item, MODEL_CALLS):
            reply = yield item
            continue
        reply = None
        if isinstance(item, DoneEvent):
            program.close()
            return item.result
        if isinstance(item, passes):
            yield item
