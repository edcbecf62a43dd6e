"""A batching engine for serving: many programs, one model, one background thread (docs/server.md,
"Batching, queue, timeouts, cancellation").

Each request is a program (dgemma/programs.py), the generator the library drives alone; every step the
engine answers the model calls of all active requests, batched by kind (denoising calls in one pass,
encodes of one shape in one pass, the rest alone). New requests join at the next step, up to `max_batch`;
beyond that they wait in a queue bounded in requests and prompt tokens (full: QueueFull, a 429). Events
(TokensEvent, DraftEvent, DoneEvent, or an exception) go to each request's thread-safe queue.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Generator
from concurrent import futures
from dataclasses import dataclass, field

import torch

from .calls import MODEL_CALLS, DenoiseCall, DoneEvent, EncodeCall, LogitsBuffer, ModelCall, WorkCall, answer
from .generate import DraftEvent, GenerationResult, SamplingParams
from .kv_cache import EncodeStack, KVCache, StackedCache
from .model import DiffusionGemma
from .programs import generate_program
from .reference import own_global_rng
from .runtime.runner import Runner, as_runner

WORK_POLL_SECONDS = 0.05  # while every active request waits on work: how long a new one may wait to join


class QueueFull(RuntimeError):
    """The engine's waiting queue is full; try again later."""


class RequestTimeout(RuntimeError):
    """The request ran past its deadline."""


class ShuttingDown(RuntimeError):
    """The engine is draining: no new requests, and the running ones end now."""


@dataclass
class EngineRequest:
    """One program to run (dgemma/programs.py), and how: its events go to `events`; `cancel` ends it."""

    program: Generator  # events and model calls, a DoneEvent last
    prompt_tokens: int = 0  # the prefill work it brings (the waiting queue is bounded in these)
    want_drafts: bool = False
    reference: bool = False  # exact mode: run alone on the reference modules, with a global RNG state of its own
    timeout: float | None = None  # seconds from submission
    id: int = field(default_factory=itertools.count().__next__)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    # engine side
    _call: ModelCall | None = None  # the model call its program waits on
    _work: futures.Future | None = None  # its WorkCall, started on the worker thread

    def __post_init__(self):
        if self.reference:
            self.program = own_global_rng(self.program)

    def cancel(self) -> None:
        self.cancelled.set()


def generation_request(
    runner: Runner, prompt, params: SamplingParams | dict, *, want_drafts: bool = False, timeout=None, **kwargs
) -> EngineRequest:
    """An EngineRequest of `dgemma.generate`'s program (`kwargs`: pins, allowed, logprobs, pixels)."""
    params = SamplingParams(**params) if isinstance(params, dict) else params
    rows = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    return EngineRequest(
        generate_program(runner, prompt, params, **kwargs),
        prompt_tokens=sum(len(r) for r in rows),
        want_drafts=want_drafts,
        reference=params.mode == "exact",
        timeout=timeout,
    )


def _tokens_generated(result) -> int:
    """The tokens of a program's last generation or fill (0 for a choice among options)."""
    while not isinstance(result, GenerationResult):
        result = getattr(result, "result", None) or getattr(result, "json", None)
        if result is None:
            return 0
    return sum(len(t) for t in result.tokens)


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
    ):
        """`max_queued_tokens` bounds the prompt tokens of the waiting requests (None: no bound); a request
        that alone exceeds it is taken when nothing else waits. `batch_encodes=False` encodes each
        request's prompt and commits in passes of its own (benchmarks/batched_encodes.py compares)."""
        if max_batch <= 0 or max_queue < 0 or (max_queued_tokens is not None and max_queued_tokens <= 0):
            raise ValueError("max_batch and max_queued_tokens must be > 0, and max_queue >= 0")
        self.runner = as_runner(model)
        self.model = self.runner.model
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_queued_tokens = max_queued_tokens
        self.batch_encodes = batch_encodes
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
            queued = sum(r.prompt_tokens for r in self._waiting)
            if self._waiting and self.max_queued_tokens and queued + request.prompt_tokens > self.max_queued_tokens:
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

    def close(self) -> None:
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
        request.program.close()
        return True

    def _start(self, request: EngineRequest) -> None:
        """Run the request's program up to its first model call (run at the next step); nothing for a
        request whose client left, or whose deadline passed, while it waited. A program checks what it
        is given when it starts: a bad request ends here, with its error as its event."""
        if self._gone(request, time.monotonic()):
            return
        self._active.append(request)
        self._advance(request, None)

    def _advance(self, request: EngineRequest, reply) -> None:
        """Resume a request's program with `reply` until its next model call (or its end)."""
        try:
            while True:
                item = request.program.send(reply)
                reply = None
                if isinstance(item, MODEL_CALLS):
                    request._call = item
                    return
                if isinstance(item, DraftEvent) and not request.want_drafts:
                    continue
                if isinstance(item, DoneEvent):
                    self.stats.requests_finished += 1
                    self.stats.tokens_generated += _tokens_generated(item.result)
                request.events.put(item)
        except StopIteration:
            request._call = None
        except Exception as e:  # report it to this request; the others go on
            self._fail([request], e)

    def _fail(self, requests: list[EngineRequest], error: Exception) -> None:
        """End `requests` with `error` as their last event (the others go on)."""
        for r in requests:
            r._call = None
            r.program.close()
            r.events.put(error)
        self.stats.requests_failed += len(requests)

    def _drop_finished(self) -> None:
        now = time.monotonic()
        keep = []
        for r in self._active:
            if r._call is None:
                continue
            if self._draining:
                r.program.close()
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
            for group in self._encode_groups(waiting):
                if len(group) > 1:
                    self._encode_together(group)
                else:
                    self._answer_one(group[0])
        self._active = [r for r in self._active if r._call is not None]
        denoising = [r for r in self._active if isinstance(r._call, DenoiseCall)]
        fast = [r for r in denoising if not r.reference]
        groups = [fast] if fast else []
        groups += [[r] for r in denoising if r.reference]
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

    def _encode_groups(self, waiting: list[EngineRequest]) -> list[list[EngineRequest]]:
        """The requests waiting on calls other than denoising, grouped: fast text encodes of the same shape
        (caches at one length, as many new tokens, prompts or commits alike) together, the rest alone."""
        groups: dict[tuple, list[EngineRequest]] = {}
        for r in waiting:
            c = r._call
            alike = isinstance(c, EncodeCall) and not r.reference and c.pixels is None and type(c.cache) is KVCache
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
        for r in group:
            self._advance(r, None)

    def _answer_one(self, request: EngineRequest) -> None:
        """Run the call (not a denoising pass) `request` waits on, alone, and resume it to its next call."""
        try:
            reply = answer(self._runner_of(request), request._call)
        except Exception as e:  # a bad prompt (e.g. images that do not fit it) fails alone
            self._fail([request], e)
            return
        self.stats.encode_passes += isinstance(request._call, EncodeCall)
        self._advance(request, reply)

    def _runner_of(self, request: EngineRequest) -> Runner:
        return self.runner.reference if request.reference else self.runner

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
