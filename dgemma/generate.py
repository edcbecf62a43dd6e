"""The canvas loop: block diffusion generation, as a stream of events or a finished result.

    encode(prompt)                                   # causal prefill into the KV cache
    for each canvas (until max_new_tokens or a stop token):
        canvas = uniform random tokens (pinned positions hold given tokens)
        for step = N, ..., 1:                         # N = max_denoising_steps
            logits = denoise(canvas, cache, self-conditioning) / temperature(step)
            accept some positions (the sampler), draw tokens there, renoise the rest
            stop early once the argmax canvas is stable and confident
        commit the argmax canvas through encode

This is the fast loop (mode "fast", the default): one full-vocabulary buffer per step, draws only where
tokens are accepted, rows that stopped leave the batch, it stops as soon as `max_new_tokens` is met, and
it can pin positions (infilling, editing, templates), constrain them, and stream a canvas's leading tokens
early. Mode "exact" reproduces transformers' `generate` operation for operation and random draw for
random draw, so the same seed gives the same token ids: it is its own program, dgemma/reference.py, on
the reference modules; `prepare` returns one or the other. Both compute the same distribution.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import torch

from .calls import DenoiseCall, DoneEvent, EncodeCall, ModelCall, drive
from .constraints import Allowed, as_allowed
from .images import DEFAULT_BUDGET
from .kv_cache import KVCache
from .model import DiffusionGemma
from .prompts import left_pad, prompt_rows, with_images
from .reference import reference_program
from .results import DraftEvent, GenerationResult, GenerationStats, Output, TokensEvent, sequence_canvas  # noqa: F401 (public here)
from .runtime.runner import Runner, as_runner
from .sampling import (
    StableAndConfident,
    fast_transition,
    random_tokens,
    restrict,
    temperature,
    top_logprobs,
)
from .settings import MODES, SamplingParams  # noqa: F401 (the settings live in settings.py; both are public here too)

Event = DraftEvent | TokensEvent | DoneEvent
MAX_LOGPROBS = 20  # alternatives per token a result may carry


# ------------------------------------------------------------------------------------------------
# The loop


@dataclass
class _Canvas:
    """One canvas being denoised, for every row of the batch."""

    tokens: torch.Tensor  # [B, C] current (noisy) canvas
    argmax: torch.Tensor  # [B, C] latest argmax canvas (the draft)
    pinned: torch.Tensor  # [B, C] bool: never renoised (given by a template, or frozen by early commit)
    pin_values: torch.Tensor  # [B, C]
    done: torch.Tensor  # [B] bool: this row stopped denoising
    needed: torch.Tensor  # [B, C] bool: positions whose tokens will be returned
    allowed: torch.Tensor | None = None  # [B, C] class of each position's allowed tokens (-1: any), when constrained
    sc: torch.Tensor | None = None  # self-conditioning: the soft embeddings of the last step's logits
    steps: torch.Tensor | None = None  # [B] steps run in this canvas
    stable_steps: torch.Tensor | None = None  # [B, C] consecutive steps with the same argmax (early commit)
    logprob: torch.Tensor | None = None  # [B, C] with logprobs: the draft's log-probability at the latest step
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, C, k] its k likeliest (log-probabilities, ids)
    frontier: list[int] = field(default_factory=list)  # per row: leading positions already emitted
    entropy: torch.Tensor | None = None  # [B, C] with step_stats: the latest step's entropy
    confidence: torch.Tensor | None = None  # [B, C] with step_stats: the latest step's argmax probability


def _canvas_window(per_position: torch.Tensor | None, k: int, c: int, b: int, device) -> torch.Tensor:
    """Canvas k's part [b, c] of a per-position tensor of the generated sequence (pins, allowed-token
    classes), -1 past its end (or everywhere, without one)."""
    out = torch.full((b, c), -1, dtype=torch.long, device=device)
    if per_position is not None:
        chunk = per_position[:, k * c : (k + 1) * c]
        out[:, : chunk.shape[1]] = chunk
    return out


class _Loop:
    """Runs canvases for one batch of prompts: asks for the prompt's encode into `cache` (`prompt`, None when
    it is there already), then denoises and commits canvas after canvas. It holds the model's configuration
    and embedding, never a runner: every forward pass is a call its driver answers. `stats` computes a
    step's sampler statistics (a runner's `canvas_stats`, compiled where that pays)."""

    def __init__(
        self,
        model: DiffusionGemma,
        stats,
        cache: KVCache,
        p: SamplingParams,
        pins: torch.Tensor | None,
        out: Output,
        allowed: Allowed | None = None,
        logprobs: int | None = None,
        step_stats: bool = False,
        prompt: EncodeCall | None = None,
    ):
        self.step_stats, self.prompt, self.stats = step_stats, prompt, stats
        self.model, self.cache, self.p, self.out = model, cache, p, out
        self.b = cache.batch_size
        self.c = model.config.canvas_length
        self.v = model.text_config.vocab_size
        self.device = model.device
        self.pins, self.allowed, self.logprobs = pins, allowed, logprobs
        self.stop = torch.tensor(p.stop_token_ids or [-1], device=self.device)
        self.gen = None if p.seed is None else torch.Generator(device=self.device).manual_seed(p.seed)
        self.sampler = p.make_sampler()
        # per-step constants, made once: temperatures by remaining step, and the embedding scale
        n = p.max_denoising_steps
        self.temperatures = {s: temperature(s, n, p.t_min, p.t_max, self.device) for s in range(1, n + 1)}
        w = model.embed_tokens.weight
        self.embedding, self.embed_scale = w, model.embed_scale(w.dtype)
        total = max(p.max_new_tokens, 0 if pins is None else pins.shape[1])
        self.num_canvases = math.ceil(total / self.c)

    # -- one canvas ----------------------------------------------------------------------------------
    def _new_canvas(self, k: int) -> _Canvas:
        b, c = self.b, self.c
        tokens = random_tokens((b, c), self.v, self.device, self.gen)
        pin_values = _canvas_window(self.pins, k, c, b, self.device)
        pinned = pin_values >= 0
        tokens = torch.where(pinned, pin_values, tokens)
        budget = self.p.max_new_tokens - k * c
        needed = (torch.arange(c, device=self.device) < budget).expand(b, c)
        done = torch.tensor([self.out.finished(r) for r in range(b)], device=self.device)
        return _Canvas(
            tokens=tokens,
            argmax=tokens,
            pinned=pinned,
            pin_values=pin_values,
            done=done,
            needed=needed,
            allowed=None if self.allowed is None else _canvas_window(self.allowed.index, k, c, b, self.device),
            steps=torch.zeros(b, dtype=torch.long, device=self.device),
            stable_steps=torch.zeros(b, c, dtype=torch.long, device=self.device),
            frontier=[0] * b,
        )

    def _fast_step(self, st: _Canvas, step: int, stopper: StableAndConfident):
        """The same step for the rows still denoising, with one full-vocabulary buffer and draws where accepted."""
        active = ~st.done
        everyone = bool(active.all())
        if everyone:  # the common case: no gathers and scatters
            rows, cache = slice(None), self.cache
            tokens, sc, pinned, pin_values, needed = st.tokens, st.sc, st.pinned, st.pin_values, st.needed
            allowed = st.allowed
        else:
            rows = active.nonzero().squeeze(-1)
            cache = self.cache.rows(rows)
            tokens, pinned, pin_values, needed = st.tokens[rows], st.pinned[rows], st.pin_values[rows], st.needed[rows]
            sc = None if st.sc is None else st.sc[rows]
            allowed = None if st.allowed is None else st.allowed[rows]
        self.out.passes[rows] += 1
        st.steps[rows] += 1
        logits = yield DenoiseCall(tokens, cache, self_conditioning=sc)
        lse, top = None, None
        if self.logprobs is not None:  # of the model's distribution: before temperature and constraints
            lse, *top = top_logprobs(logits, self.logprobs)
        logits.div_(self.temperatures[step])
        if allowed is not None:
            restrict(logits, self.allowed.classes, allowed)
        t = fast_transition(
            logits,
            self.sampler,
            self.p.max_denoising_steps - step + 1,
            pinned,
            pin_values,
            self.gen,
            self.embedding,
            self.embed_scale,
            self.stats,
            self.p.greedy,
        )
        if lse is not None:
            drafted = logits.gather(-1, t.argmax[..., None]).squeeze(-1) * self.temperatures[step]
            self._keep_logprobs(st, rows, drafted - lse, top)
        del logits
        finished = stopper(t.argmax, t.entropy, needed & ~pinned, None if everyone else rows)
        if self.p.early_commit:
            settled = (t.argmax == st.argmax[rows]) & (t.entropy < self.p.early_commit_entropy)
            st.stable_steps[rows] = torch.where(settled, st.stable_steps[rows] + 1, 0)
        if self.step_stats:
            self._keep_stats(st, rows, everyone, t)
        if everyone:
            st.tokens, st.argmax, st.sc = t.tokens, t.argmax, t.soft_embeds
            st.done = st.done | finished
            return t.accepted
        if st.sc is None:
            st.sc = t.soft_embeds.new_zeros(self.b, self.c, t.soft_embeds.shape[-1])
        st.tokens, st.argmax = st.tokens.clone(), st.argmax.clone()  # drafts already handed out stay as they were
        st.tokens[rows], st.argmax[rows], st.sc[rows] = t.tokens, t.argmax, t.soft_embeds
        st.done[rows] |= finished
        accepted = torch.zeros(self.b, self.c, dtype=torch.bool, device=self.device)
        accepted[rows] = t.accepted
        return accepted

    def _keep_stats(self, st: _Canvas, rows, everyone: bool, t) -> None:
        """The step's entropy and confidence of the rows that ran it (stopped rows keep theirs)."""
        if everyone:
            st.entropy, st.confidence = t.entropy.float(), t.confidence.float()
            return
        # new tensors, not writes into the last ones: the events already sent hold those
        for name, part in (("entropy", t.entropy), ("confidence", t.confidence)):
            last = getattr(st, name)
            full = torch.full((self.b, self.c), float("nan"), device=self.device) if last is None else last.clone()
            full[rows] = part.float()
            setattr(st, name, full)

    def _keep_logprobs(self, st: _Canvas, rows, logprob: torch.Tensor, top: list[torch.Tensor]) -> None:
        """The latest step's log-probabilities of the rows that ran it (stopped rows keep theirs)."""
        if st.logprob is None:
            st.logprob = logprob.new_zeros(self.b, self.c)
            st.top = (
                top[0].new_zeros(self.b, self.c, top[0].shape[-1]),
                top[1].new_zeros(self.b, self.c, top[1].shape[-1]),
            )
        st.logprob[rows], st.top[0][rows], st.top[1][rows] = logprob, top[0], top[1]

    def _row_logprobs(self, st: _Canvas, r: int, start: int):
        """(log-probabilities, alternatives) of row r's canvas from position `start`, or None."""
        if st.logprob is None:
            return None
        values, ids = st.top[0][r, start:].tolist(), st.top[1][r, start:].tolist()
        alternatives = [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
        return st.logprob[r, start:].tolist(), alternatives

    def _early_commit(self, st: _Canvas, k: int) -> Iterator[TokensEvent]:
        """Freeze and emit each row's leading positions that have settled (pinned ones count as settled)."""
        ready = (st.stable_steps >= self.p.early_commit_steps) | st.pinned
        ready &= st.needed
        lead = ready.long().cumprod(-1).sum(-1).tolist()
        needed = st.needed.sum(-1).tolist()
        for r in range(self.b):
            if self.out.finished(r) or lead[r] <= st.frontier[r]:
                continue
            a, z = st.frontier[r], lead[r]
            st.pin_values[r, a:z] = st.argmax[r, a:z]
            st.pinned[r, a:z] = True
            st.frontier[r] = z
            event = self.out.take(r, st.argmax[r, a:z].tolist(), k, early=True)
            if event:
                yield event
            if self.out.finished(r) or z >= needed[r]:  # nothing left to denoise in this canvas
                st.done[r] = True

    def run(self) -> Generator[Event | ModelCall, torch.Tensor | None, None]:
        """The canvases, as a generator of events and model calls (send a DenoiseCall's logits back; an
        EncodeCall's reply is None)."""
        p, c = self.p, self.c
        if self.prompt is not None:
            yield self.prompt
        sequences = []
        finished_rows = torch.zeros(self.b, dtype=torch.bool, device=self.device)
        for k in range(self.num_canvases):
            st = self._new_canvas(k)
            stopper = StableAndConfident(p.stability_threshold, p.confidence_threshold, (self.b, c), self.device)
            for n, step in enumerate(range(p.max_denoising_steps, 0, -1), 1):
                accepted = yield from self._fast_step(st, step, stopper)
                yield DraftEvent(k, n, st.argmax, accepted, st.entropy, st.confidence)
                if p.early_commit:
                    yield from self._early_commit(st, k)
                if bool(st.done.all()):
                    break
            self.out.end_canvas(st.steps, st.done | finished_rows)
            final = st.argmax
            seq, hit_stop = sequence_canvas(final, self.stop, self.out.pad_id, finished_rows)
            sequences.append(seq)
            for r in range(self.b):
                if not self.out.finished(r):
                    lp = self._row_logprobs(st, r, st.frontier[r])
                    event = self.out.take(r, final[r, st.frontier[r] :].tolist(), k, early=False, logprobs=lp)
                    if event:
                        yield event
            finished_rows = finished_rows | hit_stop
            if all(self.out.finished(r) for r in range(self.b)) or k == self.num_canvases - 1:
                break
            # commit: generated tokens, which may hold the image placeholder id (embedded as any token)
            yield EncodeCall(seq, self.cache, is_generated=True)
        yield DoneEvent(self.out.result(torch.cat(sequences, dim=1), self.logprobs is not None))


# ------------------------------------------------------------------------------------------------
# Public entry points


@dataclass
class Request:
    """One generation request, checked against a model (`make_request`): what `start` runs."""

    rows: list[list[int]]  # the prompt's token rows (left-padded when run)
    params: SamplingParams  # resolved against the checkpoint's defaults
    pins: torch.Tensor | None = None  # [B, L] given tokens of the generated sequence, -1 elsewhere
    allowed: Allowed | None = None  # the tokens each generated position may hold
    logprobs: int | None = None  # alternatives per token in the result (0: the token's own only)
    pixels: object = None  # vision.Pixels of the images whose placeholders the rows hold
    step_stats: bool = False  # each step's entropy and confidence in its DraftEvent (dgemma.tracing)


def make_request(
    model: DiffusionGemma | Runner,
    prompt,
    params: SamplingParams | None = None,
    *,
    tokenizer=None,
    pins: torch.Tensor | None = None,
    allowed=None,
    logprobs: int | None = None,
    pixels=None,
    images=None,
    max_soft_tokens: int = DEFAULT_BUDGET,
    step_stats: bool = False,
    **overrides,
) -> Request:
    """A Request of `prompt` (see `stream` for the arguments), every part checked: a ValueError names what
    is wrong before anything runs."""
    model = as_runner(model).model
    params = dataclasses.replace(params or SamplingParams(), **overrides)
    p = params.resolve(model.generation_config, model.text_config.eos_token_ids)
    if pins is not None and p.mode == "exact":
        raise ValueError("pinned positions need mode 'fast' (the reference has no pinning)")
    if allowed is not None and p.mode == "exact":
        raise ValueError("allowed tokens need mode 'fast' (the reference has no constraints)")
    _check_logprobs(logprobs, p)
    if images is not None:
        prompt, pixels = with_images(model, prompt, tokenizer, pixels, images, max_soft_tokens)
    rows = prompt_rows(prompt, tokenizer)
    if pins is not None and pins.shape[0] != len(rows):
        raise ValueError(f"pins has {pins.shape[0]} rows for a batch of {len(rows)} prompts")
    allowed = as_allowed(allowed, len(rows), model.text_config.vocab_size)
    if allowed is not None:
        allowed.check(len(rows), model.text_config.vocab_size, pins)
    return Request(rows, p, pins, allowed, logprobs, pixels, step_stats)


def start(model: DiffusionGemma | Runner, request: Request, cache: KVCache | None = None):
    """The program of a Request: the fast canvas loop, or for mode "exact" transformers' generate step for
    step (dgemma/reference.py); a generator of events and model calls (the prompt's EncodeCall first, then
    DenoiseCalls and the commits' EncodeCalls; see `dgemma.calls.drive`). `cache` continues a
    conversation already in it (else a new one, sized for the request)."""
    t0 = time.perf_counter()
    runner = as_runner(model)
    model, r, p = runner.model, request, request.params
    pad_id = model.generation_config.pad_token_id
    ids, mask = left_pad(r.rows, model.text_config.pad_token_id if pad_id is None else pad_id, model.device)
    cache = _cache_for(model, ids, max(p.max_new_tokens, 0 if r.pins is None else r.pins.shape[1]), cache)
    pins = None if r.pins is None else r.pins.to(model.device)
    allowed = None if r.allowed is None else r.allowed.to(model.device)
    encode = EncodeCall(ids, cache, mask, r.pixels)
    pad_id = (model.text_config.pad_token_id or 0) if pad_id is None else pad_id  # what commits pad with
    out = Output(ids.shape[0], p, [len(row) for row in r.rows], pad_id, model.device, t0)
    if p.mode == "exact":
        return reference_program(model, cache, p, encode, out, r.step_stats)
    return _Loop(model, runner.canvas_stats, cache, p, pins, out, allowed, r.logprobs, r.step_stats, encode).run()


def prepare(
    model: DiffusionGemma | Runner, prompt, params: SamplingParams | None = None, *, cache=None, **kwargs
) -> Generator[Event | ModelCall, torch.Tensor | None, None]:
    """`start(make_request(...))`: check the request and return its program (`model`: a DiffusionGemma or
    a Runner, dgemma/runtime/runner.py). `stream` is this plus a driver; a server drives many at once."""
    return start(model, make_request(model, prompt, params, **kwargs), cache)


def runner_for(model: DiffusionGemma | Runner, request: Request) -> Runner:
    """What answers a request's model calls: the reference modules for mode "exact", else `model`'s."""
    runner = as_runner(model)
    return runner.reference if request.params.mode == "exact" else runner


def context_room(context: int, canvas: int, prompt_len: int) -> int:
    """The tokens a context of `context` positions leaves after a prompt, in whole canvases (what can be
    generated; 0 when the prompt fills it)."""
    return max(context - prompt_len, 0) // canvas * canvas


def _cache_for(model: DiffusionGemma, ids: torch.Tensor, total: int, cache: KVCache | None) -> KVCache:
    """The cache a request writes: a new one with room for the prompt and `total` new tokens in whole
    canvases, or the conversation's (`cache`) if they fit in it; a ValueError beyond the context."""
    c = model.config.canvas_length
    room = ids.shape[1] + math.ceil(total / c) * c
    limit = model.text_config.max_position_embeddings
    if (0 if cache is None else cache.length) + room > limit:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) plus {total} new tokens (rounded up to whole canvases "
            f"of {c}) exceed the model's context of {limit} positions"
        )
    if cache is None:
        return model.new_cache(ids.shape[0], room)
    if cache.length + room > cache.max_length:
        raise ValueError(
            f"the conversation needs {cache.length + room} positions but its cache holds {cache.max_length}"
        )
    return cache


def _check_logprobs(logprobs: int | None, p: SamplingParams) -> None:
    if logprobs is None:
        return
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the alternatives per token)")
    if p.mode == "exact" or p.early_commit:
        raise ValueError("logprobs need mode 'fast' without early commit (they are read at a canvas's last step)")


@torch.no_grad()
def stream(
    model: DiffusionGemma | Runner,
    prompt,
    params: SamplingParams | None = None,
    *,
    tokenizer=None,
    pins: torch.Tensor | None = None,
    allowed=None,
    logprobs: int | None = None,
    cache: KVCache | None = None,
    **overrides,
) -> Iterator[Event]:
    """Generate, yielding DraftEvent after every denoising step, TokensEvent as tokens become final, and a
    DoneEvent with the GenerationResult last.

    `prompt`: token ids, a list of them (a batch, left-padded), or text (with `tokenizer`). `overrides` set
    SamplingParams fields. `pins` [B, L] (fast mode) holds token ids for positions of the generated
    sequence that are given, -1 elsewhere; `allowed` (fast mode) the tokens each position may hold: a
    list of token-id sets (None for any) for the positions of the generated sequence, one such list per
    row, or a dgemma.constraints.Allowed (see there); `logprobs=k` (fast mode, no early commit) puts in
    the result each token's log-probability under the denoiser at its canvas's last step, before
    temperature, with the k likeliest tokens there; `cache` continues a conversation already in that cache;
    `images` (paths, bytes or PIL images) go with a text prompt holding one image token per image (as a
    chat template writes them; dgemma.images.chat_prompt makes one from messages), each given at most
    `max_soft_tokens`; `pixels` (vision.Pixels) are images already preprocessed for token-id prompts
    (these three, like the SamplingParams fields, go to `prepare`).
    """
    runner = as_runner(model)
    request = make_request(
        runner, prompt, params, tokenizer=tokenizer, pins=pins, allowed=allowed, logprobs=logprobs, **overrides
    )
    for event in drive(runner_for(runner, request), start(runner, request, cache)):
        if isinstance(event, DoneEvent) and tokenizer is not None:
            event.result.text = [tokenizer.decode(t) for t in event.result.tokens]
        yield event


def generate(
    model: DiffusionGemma | Runner, prompt, params: SamplingParams | None = None, on_event=None, **kwargs
) -> GenerationResult:
    """Generate and return the result (see `stream` for the arguments); `on_event(event)`, if given,
    sees every event on the way (drafts, commits), e.g. to draw the canvas live."""
    for event in stream(model, prompt, params, **kwargs):
        if on_event is not None:
            on_event(event)
        if isinstance(event, DoneEvent):
            return event.result
    raise AssertionError("stream ended without a DoneEvent")
