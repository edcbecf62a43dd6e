"""The canvas loop: block diffusion generation, as a stream of events or a finished result.

    encode(prompt)                                   # causal prefill into the KV cache
    for each canvas (until max_new_tokens or a stop token):
        canvas = uniform random tokens (pinned positions hold given tokens)
        for step = N, ..., 1:                         # N = max_denoising_steps
            logits = denoise(canvas, cache, self-conditioning) / temperature(step)
            accept some positions (the sampler), draw tokens there, renoise the rest
            stop early once the argmax canvas is stable and confident
        commit the argmax canvas through encode

This is the fast loop (mode "fast", the default): one full-vocabulary buffer per step, draws only where tokens
are accepted, rows that stopped leave the batch, it stops as soon as `max_new_tokens` is met, and it can pin
positions (infilling, editing, templates), constrain them, seed them (a prediction), and stream a canvas's
leading tokens early. Mode "exact" reproduces transformers' `generate` operation for operation and random
draw for random draw, so the same seed gives the same token ids: it is its own program, reference.py, on the
reference modules; the Generate task (programs.py) runs one or the other. Both compute the same distribution.
Here too: prompts as rows, what a request produces (Output, its events and result), and the tokens each
position may hold (Allowed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Generator, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..images import DEFAULT_BUDGET, text_prompt
from ..model.kv_cache import KVCache
from ..model.model import DiffusionGemma
from .engine import Answer, DenoiseCall, DoneEvent, DraftEvent, EncodeCall, ModelCall, TokensEvent
from .prediction import drop_misleading, placed, prediction_counts
from .sampling import (
    RequestError,
    SamplingParams,
    StableAndConfident,
    fast_transition,
    random_tokens,
    restrict,
    temperature,
    top_logprobs,
)

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
    seeds: torch.Tensor | None = None  # [B, C] with a prediction: its tokens placed on this canvas (-1: none)
    start: int = 0  # the canvas's first step, counted as steps remaining (lower for a seeded canvas)


def _canvas_window(per_position: torch.Tensor | None, k: int, c: int, b: int, device) -> torch.Tensor:
    """Canvas k's part [b, c] of a per-position tensor of the generated sequence (pins, allowed-token
    classes), -1 past its end (or everywhere, without one)."""
    out = torch.full((b, c), -1, dtype=torch.long, device=device)
    if per_position is not None:
        chunk = per_position[:, k * c : (k + 1) * c]
        out[:, : chunk.shape[1]] = chunk
    return out


class Loop:
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
        prediction: torch.Tensor | None = None,  # [B, L] token ids seeding the canvases (-1: none)
    ):
        self.step_stats, self.prompt, self.stats, self.prediction = step_stats, prompt, stats, prediction
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
        window = None if self.prediction is None else _canvas_window(self.prediction, k, c, b, self.device)
        tokens = tokens if window is None else torch.where(window >= 0, window, tokens)  # a prediction: no noise
        tokens = torch.where(pinned, pin_values, tokens)
        budget = self.p.max_new_tokens - k * c
        needed = (torch.arange(c, device=self.device) < budget).expand(b, c)
        done = torch.tensor([self.out.finished(r) for r in range(b)], device=self.device)
        seeds, start = placed(window, pinned | ~needed | done[:, None], self.p.max_denoising_steps)
        return _Canvas(
            tokens=tokens,
            argmax=tokens,
            pinned=pinned,
            pin_values=pin_values,
            done=done,
            needed=needed,
            allowed=None if self.allowed is None else _canvas_window(self.allowed.index, k, c, b, self.device),
            seeds=seeds,
            start=start,
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
            step, n = st.start, 0
            while step > 0:  # steps remaining: max_denoising_steps (or a seeded canvas's start) down to 1
                n += 1
                accepted = yield from self._fast_step(st, step, stopper)
                step -= 1
                if n == 1 and st.seeds is not None and drop_misleading(st, stopper, self.v, self.gen):
                    step = p.max_denoising_steps - 1  # the rest of an unseeded canvas's schedule
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
        result = self.out.result(torch.cat(sequences, dim=1), self.logprobs is not None)
        counts = prediction_counts(self.prediction, self.pins, result.tokens)  # (None, None) without one
        result.accepted_prediction_tokens, result.rejected_prediction_tokens = counts
        yield DoneEvent(result)


# ------------------------------------------------------------------------------------------------
# Public entry points


# ------------------------------------------------------------------------------------------------
# Prompts: rows of token ids, left-padded


def prompt_rows(prompt, tokenizer) -> list[list[int]]:
    """A prompt as a batch of token-id rows: text (with `tokenizer`), ids, a list of either, or a tensor."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist() if prompt.dim() == 2 else [prompt.tolist()]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a string, a list of token ids, or a list of those")
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    rows = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (pass tokenizer=Tokenizer.from_dir(...))")
            p = tokenizer.encode(p)
        if not isinstance(p, list) or not p or not all(isinstance(t, int) for t in p):
            raise ValueError("each prompt must be a non-empty string or a non-empty list of token ids")
        rows.append(p)
    return rows


def with_images(model: DiffusionGemma, prompt, tokenizer, pixels, images, budget: int | None = None):
    """A text prompt with images -> its token ids (placeholders expanded) and the images' Pixels."""
    if pixels is not None:
        raise ValueError("give images= or pixels=, not both")
    if not isinstance(prompt, str) or tokenizer is None:
        raise ValueError("images= goes with a text prompt (one image token per image) and tokenizer=")
    model.check_vision()  # before reading and preprocessing the images
    return text_prompt(tokenizer, model.config, prompt, list(images), DEFAULT_BUDGET if budget is None else budget)


def check_ids(ids: list[int], vocab: int, what: str, param: str | None = None) -> list[int]:
    """`ids` checked as token ids of the vocabulary; a RequestError names `param` (default: `what`'s first
    word)."""
    param = param or what.split()[0]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError(f"{what} must be a list of token ids", param)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"{what} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param)
    return ids


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [B, T] left-padded to the longest row, and the attention mask (None if nothing is padded)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids.to(device), (None if bool(mask.all()) else mask.to(device))


# ------------------------------------------------------------------------------------------------
# What a request produces: its statistics and result


@dataclass
class GenerationStats:
    canvases: int
    steps_per_canvas: list[list[int]]  # per row: denoising steps that row ran in each canvas
    # per row and canvas: the stop rule (stable and confident) ended it, at or before the step cap (or, with
    # early commit, every position was committed; a row that had already stopped counts as ended)
    converged_per_canvas: list[list[bool]]
    decoder_forward_passes: list[int]
    tokens_per_forward: list[float]
    time_to_first_token: float | None  # seconds from the call to the first final token
    elapsed: float
    tokens_per_second: float
    prompt_tokens: list[int]


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # per row: new tokens, stop token excluded, at most max_new_tokens
    finish_reasons: list[str]  # "stop" (a stop token) or "length" (max_new_tokens)
    sequences: torch.Tensor  # [B, canvases * C]: the committed canvases, pad after a stop token
    stats: GenerationStats
    text: list[str] | None = None
    # with `logprobs=k`: per row and token, the denoiser's log-probability of it at its canvas's last step
    # (before temperature), and the k likeliest tokens there as (id, log-probability)
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    # with a prediction, per row: its placed tokens the answer kept at their position, and the others
    accepted_prediction_tokens: list[int] | None = None
    rejected_prediction_tokens: list[int] | None = None

    def answer(self, row: int = 0) -> Answer:
        """Row `row` as a front end shows it: its tokens (streamed as they became final), the generation."""
        return Answer(None, self.tokens[row], self, {}, None, row)


class Output:
    """Per-row bookkeeping of what has been returned, and why a row finished."""

    def __init__(self, batch: int, p: SamplingParams, prompt_tokens: list[int], pad_id: int, device, t0: float):
        max_new_tokens, stop_ids = p.max_new_tokens, p.stop_token_ids
        self.t0, self.pad_id, self.prompt_tokens = t0, pad_id, prompt_tokens
        self.passes = torch.zeros(batch, dtype=torch.long, device=device)  # denoising passes per row
        self.steps_per_canvas: list[list[int]] = [[] for _ in range(batch)]
        self.converged_per_canvas: list[list[bool]] = [[] for _ in range(batch)]
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.logprobs: list[list[float]] = [[] for _ in range(batch)]  # with logprobs: one per token
        self.top: list[list[list[tuple[int, float]]]] = [[] for _ in range(batch)]
        self.reasons: list[str | None] = [None] * batch
        self.max_new = max_new_tokens
        self.stop_ids = set(stop_ids)
        self.first_token_time: float | None = None

    def end_canvas(self, steps: torch.Tensor, converged: torch.Tensor) -> None:
        """A canvas ended: the steps each row ran in it, and whether its stop rule ended it."""
        for r, (n, done) in enumerate(zip(steps.tolist(), converged.tolist(), strict=True)):
            self.steps_per_canvas[r].append(n)  # one device read per canvas, not one per row
            self.converged_per_canvas[r].append(done)

    def result(self, sequences: torch.Tensor, logprobs: bool = False) -> GenerationResult:
        """The GenerationResult of the committed canvases `sequences` [B, canvases * C]."""
        elapsed = time.perf_counter() - self.t0
        counted = (sequences[:, : self.max_new] != self.pad_id).sum(-1)
        passes = self.passes.tolist()
        total = sum(len(t) for t in self.tokens)
        first = self.first_token_time
        stats = GenerationStats(
            canvases=len(self.steps_per_canvas[0]),
            steps_per_canvas=self.steps_per_canvas,
            converged_per_canvas=self.converged_per_canvas,
            decoder_forward_passes=passes,
            tokens_per_forward=[float(n) / max(f, 1) for n, f in zip(counted.tolist(), passes, strict=True)],
            time_to_first_token=None if first is None else first - self.t0,
            elapsed=elapsed,
            tokens_per_second=total / elapsed if elapsed > 0 else 0.0,
            prompt_tokens=self.prompt_tokens,
        )
        result = GenerationResult(self.tokens, [r or "length" for r in self.reasons], sequences, stats)
        if logprobs:
            result.logprobs, result.top_logprobs = self.logprobs, self.top
        return result

    def finished(self, row: int) -> bool:
        return self.reasons[row] is not None

    def take(self, row: int, tokens: list[int], canvas_index: int, early: bool, logprobs=None) -> TokensEvent | None:
        """Append final tokens to a row up to a stop token or the length limit (and, given as (log-probabilities,
        alternatives) aligned with `tokens`, their log-probabilities); None if nothing is new."""
        out = []
        for t in tokens:
            if t in self.stop_ids:
                self.reasons[row] = "stop"
                break
            out.append(t)
            if len(self.tokens[row]) + len(out) >= self.max_new:
                self.reasons[row] = "length"
                break
        self.tokens[row].extend(out)
        if logprobs is not None:
            self.logprobs[row].extend(logprobs[0][: len(out)])
            self.top[row].extend(logprobs[1][: len(out)])
        if not out:
            return None
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        return TokensEvent(row, out, canvas_index, early)


def text_ends(model: DiffusionGemma) -> list[int]:
    """The token ids that end a text: generation_config.json's eos_token_id, else config.json's (maybe none)."""
    eos = model.generation_config.eos_token_id
    eos = model.text_config.eos_token_id if eos is None else eos
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def end_of_text_ids(model: DiffusionGemma) -> list[int]:
    """`text_ends`, of which a layout needs one: the first is the one infilling pins after the suffix; any
    of them ends a middle (`cut_at_end`)."""
    ids = text_ends(model)
    if not ids:
        raise ValueError("infilling pins end-of-text after the suffix and needs an eos_token_id in the config")
    return ids


def sequence_canvas(final: torch.Tensor, stop: torch.Tensor, pad_id: int, was_finished: torch.Tensor):
    """The reference's committed canvas: pad after the first stop token, all pad for rows finished before."""
    is_stop = torch.isin(final, stop)
    seen = is_stop.cumsum(-1)
    after = (seen > 0) & ~((seen == 1) & is_stop)
    out = final.masked_fill(after, pad_id)
    out[was_finished] = pad_id
    return out, is_stop.any(-1)


# ------------------------------------------------------------------------------------------------
# Allowed tokens per position (constraints)


TokenSet = Collection[int] | torch.Tensor | None  # ids, a bool [V] mask, or None (any token)


@dataclass(frozen=True)
class Allowed:
    """Allowed tokens per position: `classes` [K, V] bool, `index` [B, L] long (a row of `classes`, or -1)."""

    classes: torch.Tensor
    index: torch.Tensor

    @classmethod
    def from_sets(cls, rows: Sequence[Sequence[TokenSet]], vocab_size: int) -> Allowed:
        """From one list of sets per row (rows of equal length); equal sets share a class."""
        if not rows or len({len(r) for r in rows}) != 1:
            raise ValueError("allowed needs one list of token sets per row, all of the same length")
        classes: list[torch.Tensor] = []
        keys: dict[bytes, int] = {}
        index = torch.full((len(rows), len(rows[0])), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            for i, tokens in enumerate(row):
                if tokens is None:
                    continue
                mask = token_mask(tokens, vocab_size, f"allowed[{r}][{i}]")
                key = mask.numpy().tobytes()
                if key not in keys:
                    keys[key] = len(classes)
                    classes.append(mask)
                index[r, i] = keys[key]
        stacked = torch.stack(classes) if classes else torch.zeros(0, vocab_size, dtype=torch.bool)
        return cls(stacked, index)

    def check(self, rows: int, vocab_size: int, pins: torch.Tensor | None = None) -> None:
        """ValueError unless this fits a batch of `rows` over `vocab_size` tokens (and keeps the pins)."""
        if self.classes.dtype != torch.bool or self.classes.dim() != 2 or self.classes.shape[1] != vocab_size:
            raise ValueError(f"allowed.classes must be a bool [K, {vocab_size}] tensor")
        if self.index.dim() != 2 or self.index.shape[0] != rows:
            raise ValueError(f"allowed.index must be [{rows}, length] (one row per prompt)")
        k = self.classes.shape[0]
        if bool(((self.index < -1) | (self.index >= k)).any()):
            raise ValueError(f"allowed.index holds a class outside [-1, {k})")
        if k and not bool(self.classes.any(-1).all()):
            raise ValueError("an allowed set is empty: no token could be placed there")
        if pins is None:
            return
        n = min(pins.shape[1], self.index.shape[1])
        pin, cls = pins[:, :n].cpu(), self.index[:, :n].cpu()
        both = (pin >= 0) & (cls >= 0)
        if both.any():
            ok = self.classes.cpu()[cls[both], pin[both]]
            if not bool(ok.all()):
                r, i = both.nonzero()[int((~ok).nonzero()[0])].tolist()
                raise ValueError(f"row {r}, position {i}: the pinned token {int(pin[r, i])} is not in its allowed set")

    def to(self, device) -> Allowed:
        return Allowed(self.classes.to(device), self.index.to(device))


def token_mask(tokens: TokenSet, vocab_size: int, what: str = "allowed") -> torch.Tensor:
    """A set of token ids (or a bool [V] mask) as a bool [V] mask; ValueError if empty or out of range."""
    if isinstance(tokens, torch.Tensor) and tokens.dtype == torch.bool:
        if tokens.shape != (vocab_size,):
            raise ValueError(f"{what}: a mask must have the vocabulary's {vocab_size} entries")
        mask = tokens.cpu().clone()
    else:
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{what} must be a collection of token ids")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{what} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[torch.tensor(ids, dtype=torch.long)] = True
    if not bool(mask.any()):
        raise ValueError(f"{what} is empty: no token could be placed there")
    return mask


def as_allowed(value, rows: int, vocab_size: int) -> Allowed | None:
    """`allowed=` as given (an Allowed, one row's list of sets, or one list per row) as an Allowed."""
    if value is None or isinstance(value, Allowed):
        return value
    if not isinstance(value, Sequence) or not value:
        raise ValueError("allowed must be an Allowed, a list of token sets (None for any), or one such list per row")
    one_row = not all(isinstance(r, Sequence) and not isinstance(r, str | bytes) and _is_row(r) for r in value)
    return Allowed.from_sets([value] * rows if one_row else value, vocab_size)


def _is_row(row: Sequence) -> bool:
    """A row of sets (its items are None or collections), not one set of ids."""
    return all(x is None or isinstance(x, Collection | torch.Tensor) for x in row) and not all(
        isinstance(x, int) for x in row
    )
