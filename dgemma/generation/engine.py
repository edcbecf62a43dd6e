"""Programs, the model calls they yield, and their drivers: the one place a task's calls become forward passes.

A task's program (dgemma/generation/programs.py) is a Program: a generator that yields events for its
caller and model calls for its driver, and ends with a `DoneEvent` holding its result, with what a
driver needs to run it (mode "exact": the reference modules; the prefill it brings):

    logits = yield DenoiseCall(tokens, cache, self_conditioning)   # one denoising pass
    yield EncodeCall(ids, cache)                                   # a prompt's prefill, a canvas's commit
    scores = yield ScoreCall(prompt, continuations)                # log-probabilities of given continuations
    value = yield WorkCall(fn, args)                               # client-sized work between passes

The program never holds a runner. `drive(runner, program)` answers each call on its own (`answer`); the
serving engine (`Engine`, below) answers the calls of many programs together, batched by kind, and runs
work calls on a worker thread while the other programs' passes go on. Every result offers `answer()`:
one shape (Answer) that the engine, the server and the CLI read without knowing the task.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.kv_cache import EncodeStack, KVCache, PrefixCache, Reuse, StackedCache
from ..model.model import DiffusionGemma
from ..model.vision import Pixels
from ..runtime.runner import Runner, as_runner


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
class DraftEvent:
    """After each denoising step: the argmax canvas of every row (finished rows keep their last draft)."""

    canvas_index: int
    step: int  # 1 for the first step of a canvas
    drafts: torch.Tensor  # [B, C]
    accepted: torch.Tensor  # [B, C] bool: positions accepted (or pinned) this step
    # with step_stats: of the distribution the sampler read (after temperature and constraints); a row
    # that has stopped keeps its last values
    entropy: torch.Tensor | None = None  # [B, C] fp32
    confidence: torch.Tensor | None = None  # [B, C] fp32, the argmax's probability


@dataclass
class TokensEvent:
    """Tokens of one row that are final: a committed canvas, or its leading part under early commit."""

    row: int
    tokens: list[int]
    canvas_index: int
    early: bool = False


@dataclass
class Program:
    """A task's program and how to drive it: `steps` yields events and model calls, a DoneEvent last;
    `reference` (mode "exact"): every call is answered by the reference modules (transformers' numbers),
    and a server gives it a global RNG state of its own; `prompt_tokens`: the prefill it brings (a
    server's waiting queue is bounded in these)."""

    steps: Generator
    reference: bool = False
    prompt_tokens: int = 0


@dataclass
class Answer:
    """What every task's result offers its front ends (`result.answer()`): `text` when the task writes
    its answer (JSON, a call, an option; else None: decode `tokens`), `tokens` the answer's tokens (a
    generation's streamed ones, an infill's middle), `generation` the GenerationResult behind it (logprobs,
    steps; None when nothing was generated) and its `row`, `details` what the answer says of itself (a
    server's `dgemma` block), `finish_reason` "stop" for an answer that is whole (else the generation's)."""

    text: str | None
    tokens: list[int] | None
    generation: Any = None
    details: dict = field(default_factory=dict)
    finish_reason: str | None = None
    row: int = 0


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


def drive(
    model: DiffusionGemma | Runner, program: Program, observe=None, prefix: PrefixCache | None = None
) -> Iterator:
    """Run a program on its own: answer each model call (`answer`; on the reference modules for a
    reference program), pass its events through. `observe(call)`, if given, sees every DenoiseCall before
    it is answered (stage 2 records the states); `prefix`, a store its encodes load from and are kept in
    (a fast program's: dgemma/model/kv_cache.py)."""
    runner = as_runner(model)
    runner = runner.reference if program.reference else runner
    reply, buffer, steps = None, LogitsBuffer(runner.text_config.vocab_size, runner.device), program.steps
    reuse = Reuse() if prefix is not None and not program.reference else None
    while True:
        try:
            item = steps.send(reply)
        except StopIteration:
            return
        if isinstance(item, EncodeCall) and reuse is not None:  # what the store holds loaded, the rest encoded
            rest, reply = prefix.admit(item, reuse), None
            if rest is not None:
                answer(runner, rest)
            prefix.keep(reuse)
        elif isinstance(item, MODEL_CALLS):
            if observe is not None and isinstance(item, DenoiseCall):
                observe(item)
            reply = answer(runner, item, buffer)
        else:
            reply = None
            yield item


def run(model: DiffusionGemma | Runner, program: Program, on_event=None) -> Any:
    """Drive `program` to its end and return its result; `on_event(event)`, if given, sees every event."""
    for event in drive(model, program):
        if on_event is not None:
            on_event(event)
        if isinstance(event, DoneEvent):
            return event.result
    raise AssertionError("the program ended without a DoneEvent")


def _global_rng() -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _set_global_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def own_global_rng(program):
    """`program` with a global generator state of its own (a server runs many): the state at its start,
    swapped in at each resume and out at each yield, so that requests never draw from each other's."""
    state, reply = _global_rng(), None
    while True:
        outer = _global_rng()
        _set_global_rng(state)
        try:
            item = program.send(reply)
        except StopIteration:
            return
        finally:
            state = _global_rng()
            _set_global_rng(outer)
        try:
            reply = yield item
        except GeneratorExit:
            program.close()
            raise


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


# ------------------------------------------------------------------------------------------------
# The serving engine: many programs at once


WORK_POLL_SECONDS = 0.05  # while every active request waits on work: how long a new one may wait to join


class QueueFull(RuntimeError):
    """The engine's waiting queue is full; try again later."""


class RequestTimeout(RuntimeError):
    """The request ran past its deadline."""


class ShuttingDown(RuntimeError):
    """The engine is draining: no new requests, and the running ones end now."""


@dataclass
class EngineRequest:
    """One program to run, and how: its events go to `events`; `cancel` ends it. A reference program runs
    alone on the reference modules, with a global RNG state of its own."""

    program: Program
    want_drafts: bool = False
    timeout: float | None = None  # seconds from submission
    reuse: bool = True  # whether it loads from and keeps in the engine's prefix cache (a fast program only)
    id: int = field(default_factory=itertools.count().__next__)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    # engine side
    _call: ModelCall | None = None  # the model call its program waits on
    _work: futures.Future | None = None  # its WorkCall, started on the worker thread
    _reuse: Reuse | None = None  # its part in the engine's prefix cache (None: it takes none)

    @property
    def cached_tokens(self) -> int:
        """The prompt positions loaded from the prefix cache instead of encoded (known once it encoded)."""
        return 0 if self._reuse is None else self._reuse.cached

    def __post_init__(self):
        self.steps = own_global_rng(self.program.steps) if self.program.reference else self.program.steps

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class EngineStats:
    requests: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0
    tokens_generated: int = 0
    denoising_steps: int = 0  # batched forward passes
    encode_passes: int = 0  # forward passes of encodes (prompts, commits): several requests' may share one
    encoded_tokens: int = 0  # positions those passes computed (rows counted once each)
    row_steps: int = 0  # canvas-steps summed over the rows of those passes
    last_batch_size: int = 0  # requests denoised in the last step (fast ones together, exact ones alone)


class Engine:
    """Owns the model (a DiffusionGemma or a Runner of one); `submit` requests from any thread, read their
    events from `request.events`."""

    def __init__(
        self,
        model: DiffusionGemma | Runner,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        max_queued_tokens: int | None = None,
        batch_encodes: bool = True,
        prefix_cache: PrefixCache | None = None,
    ):
        """`max_queued_tokens` bounds the prompt tokens of the waiting requests (None: no bound); a request
        that alone exceeds it is taken when nothing else waits. `batch_encodes=False` encodes each
        request's prompt and commits in passes of its own (benchmarks/batched_encodes.py compares).
        `prefix_cache`: where fast requests' prompts and commits are kept and looked up (None: none)."""
        if max_batch <= 0 or max_queue < 0 or (max_queued_tokens is not None and max_queued_tokens <= 0):
            raise ValueError("max_batch and max_queued_tokens must be > 0, and max_queue >= 0")
        self.runner = as_runner(model)
        self.model = self.runner.model
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_queued_tokens = max_queued_tokens
        self.batch_encodes = batch_encodes
        self.prefix_cache = prefix_cache
        self.stats = EngineStats()
        self._waiting: deque[EngineRequest] = deque()
        self._active: list[EngineRequest] = []
        self._logits = LogitsBuffer(self.model.text_config.vocab_size, self.model.device)  # fast batches'
        self._running = 0  # active requests as the submitting threads see them (updated under the lock)
        self._lock = threading.Condition()
        self._stop = False
        self._draining = False
        self._worker = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dgemma-work")  # WorkCalls
        self._thread = threading.Thread(target=self._run, name="dgemma-engine", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> EngineRequest:
        """Queue a request (QueueFull when the queue is full, ShuttingDown once draining)."""
        with self._lock:
            if self._draining:
                raise ShuttingDown("the server is shutting down")
            left = [r for r in self._waiting if r.cancelled.is_set()]  # their clients went away
            if left:
                self._waiting = deque(r for r in self._waiting if not r.cancelled.is_set())
                self.stats.requests_cancelled += len(left)
            if len(self._waiting) + self._running >= self.max_batch + self.max_queue:
                self.stats.requests_rejected += 1
                raise QueueFull(f"{len(self._waiting)} requests are waiting; try again shortly")
            queued, brings = sum(r.program.prompt_tokens for r in self._waiting), request.program.prompt_tokens
            if self._waiting and self.max_queued_tokens and queued + brings > self.max_queued_tokens:
                self.stats.requests_rejected += 1
                raise QueueFull(f"{queued} prompt tokens are waiting for their prefill; try again shortly")
            self._waiting.append(request)
            self.stats.requests += 1
            self._lock.notify()
        return request

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return self._running

    @property
    def capacity(self) -> int:
        """The most requests the engine holds at once (running and waiting)."""
        return self.max_batch + self.max_queue

    def drain(self) -> None:
        """Refuse new requests and end every waiting and running one with ShuttingDown (at its next step)."""
        with self._lock:
            self._draining = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self._lock.notify()
        for request in waiting:
            request.events.put(ShuttingDown("the server is shutting down"))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drain, stop the engine thread and the worker."""
        self.drain()
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=10)
        self._worker.shutdown(wait=False, cancel_futures=True)

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._lock:
                    while not self._stop and not self._waiting and not self._active:
                        self._lock.wait()
                    if self._stop:
                        break
                    admitted = []
                    while self._waiting and len(self._active) + len(admitted) < self.max_batch:
                        admitted.append(self._waiting.popleft())
                    self._running = len(self._active) + len(admitted)
                for request in admitted:
                    self._start(request)
                self._step()
                with self._lock:
                    self._running = len(self._active)
        for request in list(self._active) + list(self._waiting):
            request.events.put(ShuttingDown("the server is shutting down"))

    def _gone(self, request: EngineRequest, now: float) -> bool:
        """Whether `request` ends here because its client left (cancelled) or its deadline passed (it gets
        a RequestTimeout); its loop, if it has one, is closed."""
        if request.cancelled.is_set():
            self.stats.requests_cancelled += 1
        elif request.timeout is not None and now - request.submitted > request.timeout:
            self.stats.requests_failed += 1
            request.events.put(RequestTimeout(f"the request took longer than {request.timeout:g} s"))
        else:
            return False
        request.steps.close()
        return True

    def _start(self, request: EngineRequest) -> None:
        """Run the request's program up to its first model call (run at the next step); nothing for a
        request whose client left, or whose deadline passed, while it waited. A program checks what it
        is given when it starts: a bad request ends here, with its error as its event."""
        if self._gone(request, time.monotonic()):
            return
        if self.prefix_cache is not None and request.reuse and not request.program.reference:
            request._reuse = Reuse()
        self._active.append(request)
        self._advance(request, None)

    def _advance(self, request: EngineRequest, reply) -> None:
        """Resume a request's program with `reply` until its next model call (or its end)."""
        try:
            while True:
                item = request.steps.send(reply)
                reply = None
                if isinstance(item, MODEL_CALLS):
                    request._call = item
                    return
                if isinstance(item, DraftEvent) and not request.want_drafts:
                    continue
                if isinstance(item, DoneEvent):
                    self.stats.requests_finished += 1
                    answer = getattr(item.result, "answer", None)  # a score's result is not an answer
                    generation = None if answer is None else answer().generation
                    self.stats.tokens_generated += 0 if generation is None else sum(map(len, generation.tokens))
                request.events.put(item)
        except StopIteration:
            request._call = None
        except Exception as e:  # report it to this request; the others go on
            self._fail([request], e)

    def _fail(self, requests: list[EngineRequest], error: Exception) -> None:
        """End `requests` with `error` as their last event (the others go on)."""
        for r in requests:
            r._call = None
            r.steps.close()
            r.events.put(error)
        self.stats.requests_failed += len(requests)

    def _drop_finished(self) -> None:
        now = time.monotonic()
        keep = []
        for r in self._active:
            if r._call is None:
                continue
            if self._draining:
                r.steps.close()
                r.events.put(ShuttingDown("the server is shutting down"))
                continue
            if not self._gone(r, now):
                keep.append(r)
        self._active = keep

    def _step(self) -> None:
        """The encodes and scores the active requests wait on (prompts, commits; encodes of equal shape in
        one pass), until each waits on a denoising pass or has ended; then one denoising pass for the fast
        requests together, and one for each exact request. Work calls run on the worker thread meanwhile;
        when every active request waits on one, the step waits for the first to finish (a new request
        waits at most WORK_POLL_SECONDS to be admitted)."""
        self._drop_finished()
        self._work_on()
        while True:
            waiting = [
                r for r in self._active if r._call is not None and not isinstance(r._call, DenoiseCall | WorkCall)
            ]
            if not waiting:
                break
            for group in self._encode_groups(self._admit(waiting)):
                if len(group) > 1:
                    self._encode_together(group)
                else:
                    self._answer_one(group[0])
        self._active = [r for r in self._active if r._call is not None]
        denoising = [r for r in self._active if isinstance(r._call, DenoiseCall)]
        fast = [r for r in denoising if not r.program.reference]
        groups = [fast] if fast else []
        groups += [[r] for r in denoising if r.program.reference]
        if groups:
            self.stats.last_batch_size = len(self._active)  # requests denoised this step
        for group in groups:
            self._denoise(group)
        self._work_on()
        self._active = [r for r in self._active if r._call is not None]
        if not self._active:
            self._logits.release()  # idle: hold no logits
        elif all(r._work is not None for r in self._active):
            futures.wait([r._work for r in self._active], WORK_POLL_SECONDS, futures.FIRST_COMPLETED)

    def _work_on(self) -> None:
        """Resume each request whose work call is done (its value, or its error ends it), and start the
        work calls not started yet on the worker thread."""
        for r in list(self._active):
            if isinstance(r._call, WorkCall) and r._work is not None and r._work.done():
                work, r._work = r._work, None
                if work.exception() is not None:
                    self._fail([r], work.exception())
                else:
                    self._advance(r, work.result())
            if isinstance(r._call, WorkCall) and r._work is None:
                r._work = self._worker.submit(r._call.fn, *r._call.args)

    def _admit(self, waiting: list[EngineRequest]) -> list[EngineRequest]:
        """The prefix cache's look at each encode waiting (every one is answered before the next look): a
        prompt's stored prefix is loaded and the request waits on the encode of the rest (or, all loaded, goes
        on). Returns those still waiting."""
        out = []
        for r in waiting:
            if r._reuse is not None and isinstance(r._call, EncodeCall):
                r._call = self.prefix_cache.admit(r._call, r._reuse)
                if r._call is None:
                    self.prefix_cache.keep(r._reuse)
                    self._advance(r, None)
                    continue
            out.append(r)
        return out

    def _encoded(self, request: EngineRequest, call: EncodeCall) -> None:
        """After an encode of `request`'s: its positions counted, and what it completes kept in the prefix cache."""
        self.stats.encoded_tokens += call.ids.shape[1]
        if request._reuse is not None:
            self.prefix_cache.keep(request._reuse)

    def _encode_groups(self, waiting: list[EngineRequest]) -> list[list[EngineRequest]]:
        """The requests waiting on calls other than denoising, grouped: fast text encodes of the same shape
        (caches at one length, as many new tokens, prompts or commits alike) together, the rest alone."""
        groups: dict[tuple, list[EngineRequest]] = {}
        for r in waiting:
            c = r._call
            alike = isinstance(c, EncodeCall) and c.pixels is None and type(c.cache) is KVCache
            alike = alike and not r.program.reference
            if self.batch_encodes and alike:
                key = (c.is_generated, c.cache.length, c.ids.shape[1], c.attention_mask is None)
            else:
                key = ("alone", r.id)
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    def _encode_together(self, group: list[EngineRequest]) -> None:
        """One encode pass for the group's calls (EncodeStack writes each row into its own cache); a request
        the pass refuses (a ValueError: a bad prompt, a full cache) makes each go alone, so that it fails
        alone."""
        calls = [r._call for r in group]
        ids = torch.cat([c.ids for c in calls])
        mask = None if calls[0].attention_mask is None else torch.cat([c.attention_mask for c in calls])
        try:
            self.runner.encode(ids, EncodeStack([c.cache for c in calls]), mask, is_generated=calls[0].is_generated)
        except ValueError:
            for r in group:
                self._answer_one(r)
            return
        except Exception as e:
            self._fail(group, e)
            return
        self.stats.encode_passes += 1
        for r, call in zip(group, calls, strict=True):
            self._encoded(r, call)
        for r in group:
            self._advance(r, None)

    def _answer_one(self, request: EngineRequest) -> None:
        """Run the call (not a denoising pass) `request` waits on, alone, and resume it to its next call."""
        try:
            reply = answer(self._runner_of(request), request._call)
        except Exception as e:  # a bad prompt (e.g. images that do not fit it) fails alone
            self._fail([request], e)
            return
        if isinstance(request._call, EncodeCall):
            self.stats.encode_passes += 1
            self._encoded(request, request._call)
        self._advance(request, reply)

    def _runner_of(self, request: EngineRequest) -> Runner:
        return self.runner.reference if request.program.reference else self.runner

    def _denoise(self, group: list[EngineRequest]) -> None:
        """One forward pass for `group`'s canvases (caches stacked), each request then resumed on its rows."""
        calls = [r._call for r in group]
        embeds = []
        m = self.model.text_config.hidden_size
        for call in calls:
            if call.self_conditioning is not None:
                embeds.append(call.self_conditioning)
            elif len(calls) > 1:  # the first step in a batch: an exactly-zero signal
                embeds.append(torch.zeros(*call.tokens.shape, m, dtype=self.model.dtype, device=self.model.device))
        tokens = torch.cat([c.tokens for c in calls])
        runner = self._runner_of(group[0])
        alone = len(calls) == 1 and runner.graphs is None  # a graphed runner serves batches of any size alike
        cache = calls[0].cache if alone else StackedCache([c.cache for c in calls])
        signal = torch.cat(embeds) if embeds else None
        try:
            out = self._logits.rows(tokens.shape) if runner.writes_in_place() else None
            logits = runner.denoise(tokens, cache, signal, out=out)
        except Exception as e:
            self._fail(group, e)
            return
        self.stats.denoising_steps += 1
        self.stats.row_steps += tokens.shape[0]
        row = 0
        for r, call in zip(group, calls, strict=True):
            n = call.tokens.shape[0]
            self._advance(r, logits[row : row + n])
            row += n
