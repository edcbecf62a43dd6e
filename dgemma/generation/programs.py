"""Every task once: a value that says what a request means, and the program that runs it.

A task is a small frozen dataclass (Generate, Fill, Infill, Edit, Json, Call, Auto, Choose, Score). Its
`check(model, context)` decides everything that can be decided before a model pass: the checkpoint's
defaults, what `max_tokens` means for it, the limits, which settings go together; what is wrong is one
RequestError naming the task's field (`param`), which every front end maps to its own names. The
checked task's `program(model, stats)` is a Program (dgemma/generation/engine.py): the generator of
events and model calls, and how to drive it (exact mode's reference modules, the prefill it brings).

Front ends only build tasks: the library's functions below (their `**overrides` become the task's
SamplingParams here and go no further), the server's `to_task` per route (dgemma/server/), the CLI
(dgemma/cli/). `run(runner, program)` drives one program alone, the engine many at once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from ..model.kv_cache import KVCache, PrefixCache
from ..model.model import DiffusionGemma
from ..runtime.runner import Runner, as_runner
from ..structured.nodes import json_text
from ..structured.plans import JsonPlan, Sizes, object_plan, schema_plan, unsatisfied
from ..structured.tokens import DEFAULT_RETRIES, StructuredOutputError
from .editing import (
    InfillPlan,
    InfillResult,
    canvas_logprobs_program,
    cut_at_end,
    denoiser_scores,
    encoder_scores,
    fill_rows,
    max_middle_length,
    plan_edit,
    plan_infill,
    prompt_logprobs_program,
    template_pins,
)
from .engine import (
    Answer,
    DoneEvent,
    DraftEvent,
    EncodeCall,
    Program,
    ScoreCall,
    WorkCall,
    drive,
    result_of,
    run,
)
from .loop import (
    MAX_LOGPROBS,
    Event,
    GenerationResult,
    Loop,
    Output,
    as_allowed,
    check_ids,
    end_of_text_ids,
    left_pad,
    prompt_rows,
    text_ends,
    with_images,
)
from .prediction import check_prediction, prediction_tensor
from .reference import reference_program
from .sampling import RequestError, SamplingParams

MAX_RETRIES = 8
CONTEXT = "context_length_exceeded"  # the code of a RequestError about the context's room


# ------------------------------------------------------------------------------------------------
# What a request may take: one formula for the library, the CLI and the server


def context_room(context: int, canvas: int, prompt_len: int) -> int:
    """The tokens a context of `context` positions leaves after a prompt, in whole canvases (what can be
    generated; 0 when the prompt fills it)."""
    return max(context - prompt_len, 0) // canvas * canvas


def cache_for(model: DiffusionGemma, ids: torch.Tensor, total: int, cache: KVCache | None) -> KVCache:
    """The cache a request writes: a new one with room for the prompt and `total` new tokens in whole
    canvases (the task checked they fit the context), or the conversation's (`cache`) if they fit in it."""
    c = model.config.canvas_length
    room = ids.shape[1] + math.ceil(total / c) * c
    if cache is None:
        return model.new_cache(ids.shape[0], room)
    if cache.length + room > cache.max_length:
        raise ValueError(
            f"the conversation needs {cache.length + room} positions but its cache holds {cache.max_length}"
        )
    return cache


def sizes_of(model: DiffusionGemma) -> Sizes:
    """What a structured plan needs of `model`: its vocabulary, its canvas, its end-of-text token."""
    return Sizes(model.text_config.vocab_size, model.config.canvas_length, end_of_text_ids(model)[0])


def context_of(model: DiffusionGemma, context: int | None) -> int:
    return model.text_config.max_position_embeddings if context is None else context


def room(model: DiffusionGemma, prompt_len: int, context: int | None = None) -> int:
    """The tokens a context leaves after a prompt, in whole canvases; a RequestError (`prompt`) at 0."""
    c, context = model.config.canvas_length, context_of(model, context)
    left = context_room(context, c, prompt_len)
    if left <= 0:
        message = (
            f"prompt has {prompt_len} tokens, which leaves no room for a canvas of {c} in the context of {context}"
        )
        raise RequestError(message, "prompt", CONTEXT)
    return left


def length(model: DiffusionGemma, asked: int | None, prompt_len: int, context: int | None = None) -> int:
    """The tokens a text answer generates: `asked`, or the checkpoint's default within the context."""
    left = room(model, prompt_len, context)
    if asked is None:
        return min(model.generation_config.max_new_tokens, left)
    if asked > left:
        message = (
            f"max_tokens is too large: with a prompt of {prompt_len} tokens, at most {left} tokens fit in the "
            f"context of {context_of(model, context)} (whole canvases of {model.config.canvas_length})"
        )
        raise RequestError(message, "max_tokens", CONTEXT)
    return asked


def shaped_limit(model: DiffusionGemma, plans: list[JsonPlan], asked: int | None, prompt_len: int, context=None):
    """The token limit of an answer laid out by plans (JSON, a call): `asked` is an upper bound, as for
    text (without it, what the context leaves); refused only when the shortest valid answer does not fit."""
    n = max(p.smallest for p in plans)
    if asked is not None and asked < n:
        raise RequestError(f"max_tokens is {asked}, but the shortest valid answer takes {n} tokens", "max_tokens")
    left = context_room(context_of(model, context), model.config.canvas_length, prompt_len)
    if n > left:
        message = (
            f"the shortest valid answer takes {n} tokens, but with a prompt of {prompt_len} tokens at most {left} "
            f"fit in the context of {context_of(model, context)} (whole canvases of {model.config.canvas_length})"
        )
        raise RequestError(message, "prompt", CONTEXT)
    return left if asked is None else min(asked, left)


def resolved(model: DiffusionGemma, params: SamplingParams, **fields) -> SamplingParams:
    """`params` with `fields` set and the checkpoint's defaults filled in (a RequestError names a setting)."""
    return dataclasses.replace(params, **fields).resolve(model.generation_config, text_ends(model))


def check_rows(rows: list[list[int]], model: DiffusionGemma, param: str, what: str | None = None) -> None:
    """Each row a non-empty list of token ids of the vocabulary (a RequestError naming `param`; the message
    names row i as `what i`)."""
    for i, row in enumerate(rows):
        if not row:
            raise RequestError(f"{what or param} {i} must be a non-empty list of token ids", param)
        check_ids(row, model.text_config.vocab_size, f"{what or param} {i}", param)


def fast_only(params: SamplingParams, what: str, param: str = "mode") -> None:
    if params.mode == "exact":
        raise RequestError(f"mode 'exact' has no {what} (transformers' generate has none): use mode 'fast'", param)


class SchemaRefused(RequestError, StructuredOutputError):
    """A schema (or a tool's parameters) no answer can be laid out by, found before any pass: a RequestError
    naming the field for front ends, a StructuredOutputError for the library's callers."""


def check_json_options(retries: int, size: str) -> None:
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= MAX_RETRIES:
        raise RequestError(f"retries must be an integer in [0, {MAX_RETRIES}]", "retries")
    if size not in ("draft", "schema"):
        raise RequestError(f"size must be 'draft' or 'schema' (got {size!r})", "size")


# ------------------------------------------------------------------------------------------------
# Text: the canvas loop, and for mode "exact" the reference program


@dataclass(frozen=True)
class Generate:
    """Text by the canvas loop (`stream` says each field); `params.max_new_tokens` is the most tokens
    generated (default: the checkpoint's, within the context)."""

    prompt: list[list[int]]
    params: SamplingParams = field(default_factory=SamplingParams)
    pins: torch.Tensor | None = None
    allowed: Any = None
    logprobs: int | None = None
    pixels: Any = None
    step_stats: bool = False
    prediction: Any = None  # token ids the answer is expected to be (for every row, or one list per row)
    work: ClassVar[str | None] = None  # what a server runs `check` as: None (inline), "tokenize", "compile"

    def check(self, model: DiffusionGemma, context: int | None = None) -> Generate:
        """The task with its settings resolved and its length decided; a RequestError names what is wrong."""
        check_rows(self.prompt, model, "prompt")
        if self.pixels is None and any(model.config.image_token_id in row for row in self.prompt):
            raise RequestError("prompt holds image placeholders, and no images were given", "prompt")
        fixed = None if self.pins is None else self.pins.shape[1]  # a fill: the template's length
        n = length(model, self.params.max_new_tokens if fixed is None else fixed, max(map(len, self.prompt)), context)
        p = resolved(model, self.params, max_new_tokens=n)
        if self.pins is not None or self.allowed is not None:
            fast_only(p, "pinned or constrained positions")
        self._check_logprobs(p)
        if self.pins is not None and self.pins.shape[0] != len(self.prompt):
            raise RequestError(f"pins has {self.pins.shape[0]} rows for a batch of {len(self.prompt)}", "pins")
        allowed = as_allowed(self.allowed, len(self.prompt), model.text_config.vocab_size)
        if allowed is not None:
            allowed.check(len(self.prompt), model.text_config.vocab_size, self.pins)
        prediction = self.prediction
        if prediction is not None:
            fast_only(p, "prediction (a seeded canvas)", "prediction")
            prediction = check_prediction(prediction, len(self.prompt), n, model.text_config.vocab_size)
        return dataclasses.replace(self, params=p, allowed=allowed, prediction=prediction)

    def _check_logprobs(self, p: SamplingParams) -> None:
        k = self.logprobs
        if k is None:
            return
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise RequestError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token)", "logprobs"
            )
        if p.mode == "exact" or p.early_commit:
            raise RequestError(
                "logprobs need mode 'fast' without early commit (read at a canvas's last step)", "logprobs"
            )

    def program(self, model: DiffusionGemma, stats, cache: KVCache | None = None) -> Program:
        """The fast canvas loop, or for mode "exact" transformers' generate step for step on the reference
        modules; `cache` continues a conversation already in it (else a new one, sized for the task)."""
        return Program(self.steps(model, stats, cache), self.params.mode == "exact", sum(map(len, self.prompt)))

    def steps(self, model: DiffusionGemma, stats, cache: KVCache | None = None) -> Generator:
        """The program's generator alone (for a program inside another)."""
        t0, p = time.perf_counter(), self.params
        pad_id = model.generation_config.pad_token_id
        ids, mask = left_pad(self.prompt, model.text_config.pad_token_id if pad_id is None else pad_id, model.device)
        cache = cache_for(model, ids, max(p.max_new_tokens, 0 if self.pins is None else self.pins.shape[1]), cache)
        encode = EncodeCall(ids, cache, mask, self.pixels)
        pad_id = (model.text_config.pad_token_id or 0) if pad_id is None else pad_id  # what commits pad with
        out = Output(ids.shape[0], p, [len(row) for row in self.prompt], pad_id, model.device, t0)
        if p.mode == "exact":
            return reference_program(model, cache, p, encode, out, self.step_stats)
        pins = None if self.pins is None else self.pins.to(model.device)
        allowed = None if self.allowed is None else self.allowed.to(model.device)
        seeds = None if self.prediction is None else prediction_tensor(self.prediction, model.device)
        return Loop(model, stats, cache, p, pins, out, allowed, self.logprobs, self.step_stats, encode, seeds).run()


@dataclass(frozen=True)
class Fill:
    """Templates filled (`fill` says each field); checked, it is the Generate of its templates' pins."""

    template: list
    prompt: list | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    allowed: Any = None
    logprobs: int | None = None
    pixels: Any = None
    work: ClassVar[str | None] = None

    def check(self, model: DiffusionGemma, context: int | None = None) -> Generate:
        prompts, pins, params = fill_rows(model, self.template, self.prompt, self.params)
        return Generate(prompts, params, pins, self.allowed, self.logprobs, self.pixels).check(model, context)


LIBRARY_NAMES = {"max_tokens": "max_new_tokens"}  # a task's fields as the library's functions call them


def library_checked(task, model: DiffusionGemma, context: int | None = None):
    """`task.check` in the library's names."""
    try:
        return task.check(model, context)
    except RequestError as e:
        raise e.named(LIBRARY_NAMES) from None


def library_params(params: SamplingParams | None, overrides: dict) -> SamplingParams:
    """A library call's settings: `params` with its keyword overrides (a misspelled one is named here)."""
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        raise TypeError(f"unknown keyword argument(s): {', '.join(unknown)}")
    return dataclasses.replace(params or SamplingParams(), **overrides)


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
    images=None,
    pixels=None,
    max_soft_tokens: int | None = None,
    step_stats: bool = False,
    prediction=None,
    prefix: PrefixCache | None = None,
    context: int | None = None,
    **overrides,
) -> Iterator[Event]:
    """Generate, yielding DraftEvent after every denoising step, TokensEvent as tokens become final, and a
    DoneEvent with the GenerationResult last.

    `prompt`: token ids, a list of them (a batch, left-padded), or text (with `tokenizer`). `overrides` set
    SamplingParams fields. `pins` [B, L] (fast mode) holds token ids for positions of the generated
    sequence that are given, -1 elsewhere; `allowed` (fast mode) the tokens each position may hold: a
    list of token-id sets (None for any) for the positions of the generated sequence, one such list per
    row, or a dgemma.generation.loop.Allowed; `logprobs=k` (fast mode, no early commit) puts in the result
    each token's log-probability under the denoiser at its canvas's last step, before temperature, with
    the k likeliest tokens there; `cache` continues a conversation already in that cache; `images`
    (paths, bytes or PIL images) go with a text prompt holding one image token per image (as a chat
    template writes them; dgemma.chat_prompt makes one from messages), each given at most
    `max_soft_tokens`; `pixels` (vision.Pixels) are images already preprocessed for token-id prompts.
    `prediction` (fast mode): the answer as expected, token ids or text (with `tokenizer`), or one per row;
    its tokens seed the canvases and the result counts those kept (dgemma/generation/prediction.py).
    `prefix` (a PrefixCache, dgemma/model/kv_cache.py): the prompt's longest stored prefix is loaded
    instead of encoded, and the prompt and committed canvases are kept there (a Session's); `context`
    bounds the positions the prompt and the answer use (default: the model's, or what `cache` has left).
    """
    runner = as_runner(model)
    if images is not None:
        prompt, pixels = with_images(runner.model, prompt, tokenizer, pixels, images, max_soft_tokens)
    settings = library_params(params, overrides)
    seeds = _prediction_ids(prediction, tokenizer)
    task = Generate(prompt_rows(prompt, tokenizer), settings, pins, allowed, logprobs, pixels, step_stats, seeds)
    task = library_checked(task, runner.model, context if cache is None else cache.max_length - cache.length)
    for event in drive(runner, task.program(runner.model, runner.canvas_stats, cache), prefix=prefix):
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


def fill(
    model: DiffusionGemma | Runner,
    template: list[int | None] | list[list[int | None]],
    prompt: list[int] | list[list[int]] | None = None,
    params: SamplingParams | None = None,
    *,
    allowed=None,
    on_event=None,
    **overrides,
) -> GenerationResult:
    """Generate a sequence shaped like `template`: given token ids are kept, holes (None) are generated.

    A batch takes a list of templates of equal length (and a prompt per template). Templates longer than a
    canvas continue in the next canvases. The result's `tokens` hold the whole sequence, holes filled.
    `allowed`, aligned with the template, restricts what a hole may hold: per position None (any token)
    or a set of token ids (one list for every row, or one per row; see dgemma.generation.loop.Allowed).
    `on_event`, if given, sees every event (drafts, commits)."""
    runner = as_runner(model)
    task = library_checked(Fill(template, prompt, library_params(params, overrides), allowed), runner.model)
    return run(runner, task.program(runner.model, runner.canvas_stats), on_event)


# ------------------------------------------------------------------------------------------------
# Infill and edit


@dataclass(frozen=True)
class Infill:
    """The middle between `prefix` and `suffix` (dgemma.infill): `middle_length` "auto" (tried 2, 4, 8, ...
    and chosen by `length_score`) or an integer (the server's `max_tokens`), at most `longest`."""

    prefix: list[int]
    suffix: list[int]
    middle_length: int | str = "auto"
    params: SamplingParams = field(default_factory=SamplingParams)
    length_score: str = "encoder"
    logprobs: int | None = None
    longest: int | None = None
    plan: InfillPlan | None = None  # laid out by check (and `params` resolved for its rows)
    work: ClassVar[str | None] = None

    def check(self, model: DiffusionGemma, context: int | None = None) -> Infill:
        """Laid out and checked: no early commit (a middle is whole), no `max_new_tokens` (the middle's
        length is the template's), fast mode (its rows are pinned: their Generate checks it)."""
        if self.params.max_new_tokens is not None:
            raise RequestError("max_new_tokens does not apply: the middle's length is middle_length", "max_tokens")
        plan = plan_infill(model, self.prefix, self.suffix, self.middle_length, self.length_score, self.longest)
        params = dataclasses.replace(self.params, early_commit=False)
        params = params if params.stop_token_ids is not None else dataclasses.replace(params, stop_token_ids=[])
        rows = Generate(plan.prompts, params, plan.pins(), logprobs=self.logprobs).check(model, context)
        return dataclasses.replace(self, plan=plan, params=rows.params)

    def program(self, model: DiffusionGemma, stats) -> Program:
        return Program(infill_program(model, stats, self), False, len(self.plan.prompt) * len(self.plan.lengths))


@dataclass(frozen=True)
class Edit:
    """Rewrite `ids[span[0]:span[1]]` with everything else in view (dgemma.edit): checked, the Infill with
    the text before the span as prefix, after it as suffix, and the span's length (or `new_length`)."""

    ids: list[int]
    span: tuple[int, int]
    new_length: int | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    work: ClassVar[str | None] = None

    def check(self, model: DiffusionGemma, context: int | None = None) -> Infill:
        prefix, suffix, n = plan_edit(model, self.ids, self.span, self.new_length)
        # the length asked for stands (up to max_middle_length): an edit's replacement is the user's to size
        return Infill(prefix, suffix, n, self.params, longest=max_middle_length(model)).check(model, context)


def infill_program(model: DiffusionGemma, stats, task: Infill) -> Generator:
    """A checked Infill: its rows filled, each middle cut at the end of text, and the one kept (the only
    one, or the best by `plan.length_score`): an InfillResult."""
    plan = task.plan
    rows = Generate(plan.prompts, task.params, plan.pins(), logprobs=task.logprobs)  # checked by the task
    result = yield from result_of(rows.steps(model, stats), passes=(DraftEvent,))
    middles = [cut_at_end(model, row[:n]) for row, n in zip(result.tokens, plan.lengths, strict=True)]
    scores: dict[int, float] = {}
    best = 0
    if len(plan.lengths) > 1:
        if plan.length_score == "encoder":
            values = yield from encoder_scores(model, plan.prompt, middles, plan.suffix)
        else:
            values = yield from denoiser_scores(model, plan.prompt, middles, plan.suffix)
        scores = dict(zip(plan.lengths, values, strict=True))
        best = max(range(len(plan.lengths)), key=lambda i: values[i])
    middle = middles[best]
    yield DoneEvent(
        InfillResult(middle, plan.prefix + middle + plan.suffix, plan.lengths[best], scores, result, row=best)
    )


def _prediction_ids(prediction, tokenizer):
    """A library call's prediction as token ids: text (or one text per row) encoded without special tokens,
    a tensor as its list."""
    if isinstance(prediction, torch.Tensor):
        return prediction.tolist()
    if isinstance(prediction, str):
        return _text_or_ids(prediction, tokenizer, "prediction")
    if isinstance(prediction, list) and prediction and all(isinstance(p, str) for p in prediction):
        return [_text_or_ids(p, tokenizer, "prediction") for p in prediction]
    return prediction


def _text_or_ids(value, tokenizer, param: str) -> list[int]:
    if isinstance(value, str):
        if tokenizer is None:
            raise RequestError(f"{param} is text, which needs a tokenizer (pass tokenizer=)", param)
        return tokenizer.encode(value, add_special_tokens=False)
    return list(value)


def infill(
    model: DiffusionGemma | Runner,
    prefix: list[int] | str,
    suffix: list[int] | str,
    middle_length: int | str = "auto",
    params: SamplingParams | None = None,
    *,
    tokenizer=None,
    length_score: str = "encoder",
    **overrides,
) -> InfillResult:
    """Generate the middle between `prefix` and `suffix`, seeing both (see dgemma/generation/editing.py)."""
    runner = as_runner(model)
    ends = _text_or_ids(prefix, tokenizer, "prefix"), _text_or_ids(suffix, tokenizer, "suffix")
    task = library_checked(Infill(*ends, middle_length, library_params(params, overrides), length_score), runner.model)
    return _decoded(run(runner, task.program(runner.model, runner.canvas_stats)), tokenizer)


def edit(
    model: DiffusionGemma | Runner,
    ids: list[int] | str,
    span: tuple[int, int],
    params: SamplingParams | None = None,
    *,
    new_length: int | None = None,
    tokenizer=None,
    **overrides,
) -> InfillResult:
    """Rewrite `ids[span[0]:span[1]]` (token positions) with everything else kept and in view: an infill
    with the text before the span as prefix and after it as suffix (dgemma.generation.editing.plan_edit).
    The replacement has the span's length unless `new_length` says otherwise (a span of length 0 with a
    `new_length` inserts); it is shorter when the model ends the text inside it."""
    runner = as_runner(model)
    task = Edit(_text_or_ids(ids, tokenizer, "text"), span, new_length, library_params(params, overrides))
    task = library_checked(task, runner.model)
    return _decoded(run(runner, task.program(runner.model, runner.canvas_stats)), tokenizer)


def one_prompt(prompt, tokenizer) -> list[int]:
    rows = prompt_rows(prompt, tokenizer)
    if len(rows) != 1:
        raise RequestError("prompt: this task takes one prompt", "prompt")
    return rows[0]


def _decoded(out: InfillResult, tokenizer) -> InfillResult:
    if tokenizer is not None:
        out.text, out.middle_text = tokenizer.decode(out.tokens), tokenizer.decode(out.middle)
    return out


# ------------------------------------------------------------------------------------------------
# JSON


@dataclass
class JsonResult:
    value: Any  # the answer, validated against the schema
    text: str  # its text: compact JSON (or, for a tool call, the call)
    attempts: int  # fills run (1 + retries used)
    steps: int  # denoising steps over all attempts (and the sizing draft)
    result: GenerationResult | None  # the last fill (None when the shortest answer was all that fit)
    errors: list[str] = field(default_factory=list)  # why earlier attempts were drawn again

    def answer(self) -> Answer:
        return Answer(self.text, None, self.result, {"json_attempts": self.attempts}, "stop")


@dataclass(frozen=True)
class Json:
    """An answer valid against `schema` by construction (`generate_json` says each field); `write` writes
    the value (a tool call writes its syntax)."""

    prompt: list[int]
    schema: dict | None
    tokenizer: Any
    params: SamplingParams = field(default_factory=SamplingParams)
    retries: int = DEFAULT_RETRIES
    size: str = "draft"
    pixels: Any = None
    write: Callable[[Any], str] = json_text
    plan: JsonPlan | None = None  # compiled by check
    limit: int | None = None  # the answer's most tokens, decided by check
    work: ClassVar[str | None] = "compile"

    def check(self, model: DiffusionGemma, context: int | None = None) -> Json:
        check_json_options(self.retries, self.size)
        check_rows([self.prompt], model, "prompt")
        asked, p = self.params.max_new_tokens, resolved(model, self.params, early_commit=False)
        fast_only(p, "constrained positions (a JSON answer)")
        try:
            if self.schema is None:
                plan = object_plan(
                    self.tokenizer, model.text_config.vocab_size, length(model, asked, len(self.prompt), context)
                )
            else:
                plan = schema_plan(sizes_of(model), self.tokenizer, self.schema)
        except StructuredOutputError as e:
            raise SchemaRefused(str(e), "max_tokens" if self.schema is None else "schema") from e
        limit = None if plan.resize is None else shaped_limit(model, [plan], asked, len(self.prompt), context)
        params = dataclasses.replace(p, max_new_tokens=limit or len(plan.template))
        return dataclasses.replace(self, plan=plan, limit=limit, params=params)

    def program(self, model: DiffusionGemma, stats) -> Program:
        return Program(json_program(model, stats, self), False, len(self.prompt))


def json_program(model: DiffusionGemma, stats, task: Json) -> Generator:
    """A checked Json task: sized by a free draft (the draft as long as the template or the limit, the
    same sampling) or by the schema alone, within the limit (`JsonPlan.resize`), filled, read back and
    validated; an answer that fails is filled again with the next seed, up to `retries` times, then
    StructuredOutputError. A JsonResult."""
    plan, base, prompt, limit, params = task.plan, task.plan, task.prompt, task.limit, task.params
    seed, errors, steps, text = params.seed, [], 0, None
    if task.size == "draft" and plan.resize is not None and not (plan.fixed and not plan.open):  # else nothing to size
        draft = Generate([prompt], dataclasses.replace(params, max_new_tokens=min(len(plan.template), limit)))
        draft = yield from result_of(dataclasses.replace(draft, pixels=task.pixels).steps(model, stats), (DraftEvent,))
        text, steps = plan.classes.tokenizer.decode(draft.tokens[0]), sum(draft.stats.steps_per_canvas[0])
        plan = yield WorkCall(plan.resize, (text, limit))
    elif plan.resize is not None:
        plan = yield WorkCall(plan.resize, (None, limit))
    if plan.open and base.resize is not None:
        plan = yield from choose_branches(base, plan, prompt, text, limit, task.pixels)
    if plan.fixed:  # the shortest answer was all that fits, and it leaves nothing to choose
        value, error = yield from read_json(plan, prompt, plan.template[: plan.length], pixels=task.pixels)
        if error is not None:
            raise unsatisfied(1, error, steps)
        yield DoneEvent(JsonResult(value, task.write(value), 1, steps, None, errors))
        return
    for attempt in range(task.retries + 1):
        s = None if seed is None else (seed + attempt) % 2**63
        filled = _filled(model, plan, prompt, dataclasses.replace(params, seed=s), task.pixels)
        result = yield from result_of(filled.steps(model, stats), passes=(DraftEvent,))
        steps += sum(result.stats.steps_per_canvas[0])
        value, error = yield from read_json(plan, prompt, result.tokens[0], _alternatives(result), task.pixels)
        if error is None:
            yield DoneEvent(JsonResult(value, task.write(value), attempt + 1, steps, result, errors))
            return
        errors.append(error)
    raise unsatisfied(task.retries + 1, errors[-1], steps)


def _filled(model: DiffusionGemma, plan: JsonPlan, prompt: list[int], params: SamplingParams, pixels) -> Generate:
    """The fill of a plan's template: its pins and allowed tokens, stop tokens off (laid out by the plan
    within the limit the task checked)."""
    pins = template_pins([plan.template])
    params = dataclasses.replace(params, max_new_tokens=pins.shape[1], stop_token_ids=[])
    logprobs = MAX_LOGPROBS if plan.scored else None  # what a pattern's reader chooses by
    allowed = as_allowed(plan.allowed, 1, model.text_config.vocab_size)
    return Generate([prompt], params, pins, allowed, logprobs, pixels)


def choose_branches(
    base: JsonPlan, plan: JsonPlan, prompt: list[int], text: str | None, limit: int | None, pixels=None
):
    """`plan = yield from choose_branches(...)`: the unions `plan` leaves open (no draft value fits them)
    set to the branch whose first tokens the model scores likeliest after the answer before it, outermost
    first, then `base` resized by `text` (the draft, or None) within `limit` with those branches."""
    branches: dict = {}
    while plan.open:
        for path, before, options in plan.branch_requests():
            branches[path] = _likeliest((yield ScoreCall(prompt + before, options, pixels=pixels)))
        plan = yield WorkCall(base.resize, (text, limit, branches))
    return plan


def _likeliest(scored) -> int:
    """The index of the continuation a Score call's reply gives the highest summed log-probability."""
    return max(range(len(scored.logprobs)), key=lambda i: float(scored.logprobs[i].sum()))


def _alternatives(result: GenerationResult) -> list[dict[int, float]] | None:
    """Per position of a fill with logprobs, {token: log-probability} of its token and the alternatives."""
    if result.top_logprobs is None:
        return None
    pairs = zip(result.tokens[0], result.logprobs[0], result.top_logprobs[0], strict=False)
    return [dict(top) | {token: lp} for token, lp, top in pairs]


def read_json(plan: JsonPlan, prompt: list[int], tokens: list[int], alternatives=None, pixels=None):
    """`value, error = yield from read_json(...)`: `plan.read`, its choices between options spelled alike
    asked of the model as Score calls. The reader asks as it goes; each round reads with the answers
    known so far and asks what is still open, so that every choice is scored once. `alternatives`: the
    fill's scores (`JsonPlan.read`); `pixels`: the prompt's images."""
    answers: dict = {}
    while True:
        asked: dict = {}

        def score(position: int, options: list[list[int]], asked: dict = asked) -> int:
            key = (position, tuple(map(tuple, options)))
            if key not in answers:
                asked[key] = (position, options)
            return answers.get(key, 0)

        value, error = yield WorkCall(plan.read, (tokens, score, alternatives))  # validation: off the engine loop
        if not asked:
            return value, error
        for key, (position, options) in asked.items():
            answers[key] = _likeliest(
                (yield ScoreCall(*plan.score_request(prompt, tokens, position, options), pixels=pixels))
            )


def read_answer(model: DiffusionGemma | Runner, plan: JsonPlan, prompt: list[int], tokens: list[int]):
    """`read_json` driven alone: the value a fill of `plan` holds and None, or None and why not."""

    def steps():
        yield DoneEvent((yield from read_json(plan, prompt, tokens)))

    return run(as_runner(model), Program(steps()))


def generate_json(
    model: Runner | Any,
    prompt,
    schema: dict | None,
    params: SamplingParams | None = None,
    *,
    tokenizer,
    retries: int = DEFAULT_RETRIES,
    size: str = "draft",
    pixels=None,
    **overrides,
) -> JsonResult:
    """An answer to `prompt` (text or token ids, one row) that is JSON valid against `schema`.

    The schema is compiled into a template with constrained holes and filled (dgemma/structured/);
    `max_new_tokens` bounds the answer's tokens (a schema's values are then sized within it; refused when
    even the shortest valid answer does not fit); `schema=None` asks for any JSON object, in at most
    `max_new_tokens` (default: the checkpoint's), as free text after a pinned `{`. `size="draft"` (the
    default) sizes the values by a free draft first, `"schema"` by the schema's bounds alone. An answer
    that fails is filled again with the next seed, up to `retries` times, then StructuredOutputError.
    `overrides` set SamplingParams fields."""
    runner = as_runner(model)
    task = Json(
        one_prompt(prompt, tokenizer), schema, tokenizer, library_params(params, overrides), retries, size, pixels
    )
    return run(runner, library_checked(task, runner.model).program(runner.model, runner.canvas_stats))


# ------------------------------------------------------------------------------------------------
# scores


@dataclass(frozen=True)
class Score:
    """Log-probabilities of given tokens: of each `canvas` token under one read-only denoising pass after
    `prompt` (the canvas's own scores), or without a canvas of each prompt token under the causal encoder
    (a prompt's `echo`); with the `top` likeliest tokens at each position. No sampling: no mode."""

    prompt: list[int]
    canvas: list[int] | None = None
    top: int = 0
    work: ClassVar[str | None] = None

    def check(self, model: DiffusionGemma, context: int | None = None) -> Score:
        check_rows([self.prompt], model, "prompt")
        if model.config.image_token_id in self.prompt:
            raise RequestError("prompt holds image placeholders, and a score takes no images", "prompt")
        if self.canvas is not None:
            check_rows([self.canvas], model, "canvas")
            c = model.config.canvas_length
            if len(self.canvas) > c:
                raise RequestError(f"canvas has {len(self.canvas)} tokens: a canvas of 1 to {c} tokens", "canvas")
            room(model, len(self.prompt), context)
        elif len(self.prompt) > context_of(model, context):
            raise RequestError(
                f"prompt has more tokens than the context of {context_of(model, context)}", "prompt", CONTEXT
            )
        return self

    def program(self, model: DiffusionGemma, stats=None) -> Program:
        if self.canvas is None:
            return Program(prompt_logprobs_program(self.prompt, self.top), False, len(self.prompt))
        return Program(canvas_logprobs_program(model, self.prompt, self.canvas, self.top), False, len(self.prompt))


def prompt_logprobs(model: DiffusionGemma | Runner, prompt: list[int], k: int = 0) -> tuple[list, list]:
    """Each prompt token's log-probability under the causal encoder (None for the first) and the k
    likeliest tokens at each position (the Score task without a canvas)."""
    runner = as_runner(model)
    return run(runner, library_checked(Score(list(prompt), None, k), runner.model).program(runner.model))


def canvas_logprobs(model: DiffusionGemma | Runner, prompt: list[int], canvas: list[int], k: int = 0) -> tuple:
    """Each canvas token's log-probability under one read-only denoising pass after `prompt` and the k
    likeliest tokens at each position (the Score task)."""
    runner = as_runner(model)
    return run(runner, library_checked(Score(list(prompt), list(canvas), k), runner.model).program(runner.model))


class Task(Protocol):
    """What every task offers (here, and in choose.py): `check` against a model and a context, `program` of a
    checked task, and how a server runs its check (`work`: inline, "tokenize" or "compile" off the loop)."""

    work: ClassVar[str | None]

    def check(self, model: DiffusionGemma, context: int | None = None) -> Task: ...

    def program(self, model: DiffusionGemma, stats) -> Program: ...
