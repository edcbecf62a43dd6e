"""Every task as a program of model calls, written once, for the library, the CLI and the server.

A program is a generator (dgemma/calls.py) that yields events and model calls and ends with a DoneEvent
holding its result; `calls.run(runner, program)` drives one alone, the engine many at once. Each task is
its program (`*_program`: generate, fill, infill, json, tool_call, choose; docs/architecture.md draws
them) and the blocking function the library exports. A program validates what it is given when it starts
(a ValueError, before any model call); the server builds the same programs (server/routes.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from .calls import DenoiseCall, DoneEvent, EncodeCall, ScoreCall, WorkCall, result_of, run
from .editing import (
    SCORED_SUFFIX,
    InfillPlan,
    InfillResult,
    _infill_template,
    cut_at_end,
    end_of_text_ids,
    fill_rows,
    max_middle_length,
    plan_edit,
    plan_infill,
)
from .generate import (
    MAX_LOGPROBS,
    DraftEvent,
    GenerationResult,
    SamplingParams,
    context_room,
    left_pad,
    prepare,
    prompt_rows,
)
from .model import DiffusionGemma
from .runtime.runner import Runner, as_runner
from .structured.nodes import json_text
from .structured.plans import JsonPlan, JsonResult, object_plan, schema_plan, tool_call_plan, unsatisfied
from .structured.tokens import DEFAULT_RETRIES, StructuredOutputError
from .tool_calls import CALL_OPEN, FUNCTION_NAME, call_text

Program = Generator[Any, Any, None]
MAX_OPTIONS = 64
MAX_RETRIES = 8


def generate_program(runner: Runner, prompt, params: SamplingParams | None = None, **kwargs) -> Program:
    """`dgemma.generate` as a program (see `dgemma.generate.stream` for the arguments); the request is
    validated when the program starts."""
    yield from prepare(runner, prompt, params, **kwargs)


# ------------------------------------------------------------------------------------------------
# fill, infill, edit


def fill_program(
    runner: Runner, template, prompt=None, params: SamplingParams | None = None, *, allowed=None, **overrides
) -> Program:
    """Templates filled (dgemma.editing.fill_rows says what they may be): a GenerationResult whose tokens
    are the whole templates, holes filled."""
    prompts, pins, overrides = fill_rows(runner.model, template, prompt, overrides)
    yield from prepare(runner, prompts, params, pins=pins, allowed=allowed, max_new_tokens=pins.shape[1], **overrides)


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
    or a set of token ids (one list for every row, or one per row; see dgemma.constraints). `on_event`,
    if given, sees every event (drafts, commits)."""
    runner = as_runner(model)
    program = fill_program(runner, template, prompt, params, allowed=allowed, **overrides)
    return run(runner, program, on_event)


def infill_program(runner: Runner, plan: InfillPlan, params: SamplingParams | None = None, **overrides) -> Program:
    """An infill laid out by `plan_infill`: its rows filled, each middle cut at the end of text, and the one
    kept (the only one, or the best by `plan.length_score`): an InfillResult."""
    fill_rows_ = fill_program(runner, plan.templates, plan.prompts, params, **overrides)
    result = yield from result_of(fill_rows_, passes=(DraftEvent,))
    model = runner.model
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


def encoder_scores(model: DiffusionGemma, prompt: list[int], middles: list[list[int]], suffix: list[int]):
    """Mean encoder log-probability of each middle and the `SCORED_SUFFIX` tokens after it (the suffix, then
    the end of text: with a short or empty suffix the model says whether the text can end there)."""
    after = suffix + end_of_text_ids(model)[:1]
    scored = yield ScoreCall(prompt, [m + after[:SCORED_SUFFIX] for m in middles])
    return [float(lp.mean()) for lp in scored.logprobs]


def denoiser_scores(model: DiffusionGemma, prompt: list[int], middles: list[list[int]], suffix: list[int]):
    """Mean log-probability one denoising pass gives each middle and what follows it in the canvas of its
    own (cut) length, `[middle | suffix | end-of-text ...]`: the middle, the visible suffix and the first
    end-of-text pin when the canvas has one."""
    canvas_length, end = model.config.canvas_length, end_of_text_ids(model)[0]
    canvases, scored = [], []
    for m in middles:
        template, visible = _infill_template(len(m), suffix, canvas_length, end)
        canvases.append(m + template[len(m) :])
        scored.append(min(len(m) + visible + 1, canvas_length))
    rows = len(middles)
    ids, _ = left_pad([prompt] * rows, 0, model.device)
    cache = model.new_cache(rows, ids.shape[1])
    yield EncodeCall(ids, cache)
    canvas = torch.tensor(canvases, device=model.device)
    logits = yield DenoiseCall(canvas, cache)
    token_logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, canvas[..., None]).squeeze(-1)
    return [float(token_logp[i, : scored[i]].mean()) for i in range(rows)]


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
    """Generate the middle between `prefix` and `suffix`, seeing both (see dgemma/editing.py)."""
    runner = as_runner(model)
    plan = plan_infill(runner, prefix, suffix, middle_length, tokenizer=tokenizer, length_score=length_score)
    return _decoded(run(runner, infill_program(runner, plan, params, **overrides)), tokenizer)


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
    with the text before the span as prefix and after it as suffix (dgemma.editing.plan_edit). The
    replacement has the span's length unless `new_length` says otherwise (a span of length 0 with a
    `new_length` inserts); it is shorter when the model ends the text inside it."""
    runner = as_runner(model)
    prefix, suffix, n = plan_edit(runner.model, ids, span, new_length, tokenizer)
    # the length asked for stands (up to max_middle_length): an edit's replacement is the user's to size
    plan = plan_infill(runner, prefix, suffix, n, longest=max_middle_length(runner.model))
    return _decoded(run(runner, infill_program(runner, plan, params, **overrides)), tokenizer)


def _one_prompt(prompt, tokenizer, what: str) -> list[list[int]]:
    rows = prompt_rows(prompt, tokenizer)
    if len(rows) != 1:
        raise ValueError(f"{what} takes one prompt")
    return rows


def _decoded(out: InfillResult, tokenizer) -> InfillResult:
    if tokenizer is not None:
        out.text, out.middle_text = tokenizer.decode(out.tokens), tokenizer.decode(out.middle)
    return out


# ------------------------------------------------------------------------------------------------
# JSON


def json_plan(model: DiffusionGemma | Runner, tokenizer, schema: dict | None, length: int) -> JsonPlan:
    """The plan of a JSON answer: `schema`'s template, or (None) any JSON object in `length` tokens."""
    m = as_runner(model).model
    if schema is None:
        return object_plan(tokenizer, m.text_config.vocab_size, length)
    return schema_plan(m, tokenizer, schema)


def check_limit(plan: JsonPlan, limit: int | None) -> None:
    """A ValueError when even the shortest valid answer takes more than `limit` tokens."""
    if limit is not None and plan.smallest > limit:
        raise ValueError(f"max_new_tokens is {limit}, but the shortest valid answer takes {plan.smallest} tokens")


def check_json_options(retries: int, size: str) -> None:
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"retries must be an integer in [0, {MAX_RETRIES}]")
    if size not in ("draft", "schema"):
        raise ValueError(f"size must be 'draft' or 'schema' (got {size!r})")


def json_program(
    runner: Runner,
    plan: JsonPlan,
    prompt: list[int],
    params: SamplingParams | None = None,
    *,
    retries: int = DEFAULT_RETRIES,
    size: str = "draft",
    write: Callable[[Any], str] = json_text,
    pixels=None,
    limit: int | None = None,
    **overrides,
) -> Program:
    """A JSON answer to `prompt` (one row) by `plan`: sized by a free draft (`size="draft"`, the draft
    as long as the template or `limit`, the same sampling) or by the schema alone, within `limit` tokens
    (an upper bound, as for text: `JsonPlan.resize`), filled, read back and validated; an answer that
    fails is filled again with the next seed, up to `retries` times, then StructuredOutputError. A
    JsonResult, its text written by `write`; `pixels`: the prompt's images."""
    check_json_options(retries, size)
    check_limit(plan, limit)
    if limit is None and plan.resize is not None:  # what the context leaves, as the server's default
        m = runner.model
        limit = context_room(m.text_config.max_position_embeddings, m.config.canvas_length, len(prompt))
        if plan.smallest > limit:
            raise ValueError(f"the shortest valid answer takes {plan.smallest} tokens, but the context leaves {limit}")
    params = dataclasses.replace(params or SamplingParams(), **overrides)
    params = dataclasses.replace(params, early_commit=False)
    seed, errors, steps, text, base = params.seed, [], 0, None, plan
    if size == "draft" and plan.resize is not None and not (plan.fixed and not plan.open):  # else nothing to size
        length = min(len(plan.template), limit or len(plan.template))
        draft = yield from result_of(
            generate_program(runner, [prompt], params, max_new_tokens=length, pixels=pixels), passes=(DraftEvent,)
        )
        text, steps = plan.classes.tokenizer.decode(draft.tokens[0]), sum(draft.stats.steps_per_canvas[0])
        plan = yield WorkCall(plan.resize, (text, limit))
    elif plan.resize is not None and limit is not None:
        plan = yield WorkCall(plan.resize, (None, limit))
    if plan.open and base.resize is not None:
        plan = yield from choose_branches(base, plan, prompt, text, limit, pixels)
    if plan.fixed:  # the shortest answer was all that fits, and it leaves nothing to choose
        value, error = yield from read_json(plan, prompt, plan.template[: plan.length], pixels=pixels)
        if error is not None:
            raise unsatisfied(1, error, steps)
        yield DoneEvent(JsonResult(value, write(value), 1, steps, None, errors))
        return
    for attempt in range(retries + 1):
        s = None if seed is None else (seed + attempt) % 2**63
        attempt_params = dataclasses.replace(params, seed=s)
        scores = {"logprobs": MAX_LOGPROBS} if plan.scored else {}  # what a pattern's reader chooses by
        filled = fill_program(
            runner, plan.template, prompt, attempt_params, allowed=plan.allowed, pixels=pixels, **scores
        )
        result = yield from result_of(filled, passes=(DraftEvent,))
        steps += sum(result.stats.steps_per_canvas[0])
        value, error = yield from read_json(plan, prompt, result.tokens[0], _alternatives(result), pixels)
        if error is None:
            yield DoneEvent(JsonResult(value, write(value), attempt + 1, steps, result, errors))
            return
        errors.append(error)
    raise unsatisfied(retries + 1, errors[-1], steps)


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

    def program():
        yield DoneEvent((yield from read_json(plan, prompt, tokens)))

    return run(as_runner(model), program())


def generate_json(
    model: Runner | Any,
    prompt,
    schema: dict | None,
    params: SamplingParams | None = None,
    *,
    tokenizer,
    retries: int = DEFAULT_RETRIES,
    max_new_tokens: int | None = None,
    size: str = "draft",
    **overrides,
) -> JsonResult:
    """An answer to `prompt` (text or token ids, one row) that is JSON valid against `schema`.

    The schema is compiled into a template with constrained holes and filled (dgemma/structured/);
    `max_new_tokens` bounds the answer's tokens (a schema's values are then sized within it; refused when
    even the shortest valid answer does not fit); `schema=None` asks for any JSON object, in at most
    `max_new_tokens` (default: the checkpoint's), as free text after a pinned `{`. `size="draft"` (the
    default) sizes the values by a free draft first,
    `"schema"` by the schema's bounds alone. An answer that fails is filled again with the next seed, up
    to `retries` times, then StructuredOutputError. `overrides` set SamplingParams fields."""
    runner = as_runner(model)
    check_json_options(retries, size)
    rows = _one_prompt(prompt, tokenizer, "generate_json")
    plan = json_plan(runner, tokenizer, schema, max_new_tokens or runner.generation_config.max_new_tokens)
    limit = max_new_tokens if schema is not None else None
    program = json_program(runner, plan, rows[0], params, retries=retries, size=size, limit=limit, **overrides)
    return run(runner, program)


# ------------------------------------------------------------------------------------------------
# choose, tool_call


@dataclass
class Chosen:
    index: int  # of the option chosen
    option: str | list[int]
    scores: list[float]  # per option: the encoder's log-probability of it (and of the end of text after it)


def option_ids(model: DiffusionGemma, options: list, tokenizer=None) -> list[list[int]]:
    """Options (texts, with `tokenizer`, or token ids) as token ids, checked."""
    if not isinstance(options, list) or not 0 < len(options) <= MAX_OPTIONS:
        raise ValueError(f"options must be a list of 1 to {MAX_OPTIONS} options")
    vocab, out = model.text_config.vocab_size, []
    for i, option in enumerate(options):
        if isinstance(option, str):
            if tokenizer is None:
                raise ValueError("text options need a tokenizer")
            ids = tokenizer.encode(option, add_special_tokens=False)
        else:
            ids = list(option)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"option {i} must be a non-empty text or a list of token ids in [0, {vocab})")
        out.append(ids)
    return out


def choose_program(
    runner: Runner, prompt: list[int], options: list, ids: list[list[int]], whole: bool = True, pixels=None
):
    """The option the model most likely answers `prompt` with: each scored by the encoder's summed
    log-probability of its tokens `ids` and of the end-of-text token after them (so an option is scored
    as the whole answer; `whole=False`: as the start of the answer), all in one Score call. A Chosen."""
    end = end_of_text_ids(runner.model)[:1] if whole else []
    scored = yield ScoreCall(prompt, [o + end for o in ids], pixels=pixels)
    scores = [float(lp.sum()) for lp in scored.logprobs]
    best = max(range(len(options)), key=scores.__getitem__)
    yield DoneEvent(Chosen(best, options[best], scores))


def choose(model: Runner | Any, prompt, options: list, *, tokenizer=None, whole: bool = True) -> Chosen:
    """The option (text, with `tokenizer`, or token ids) the model most likely answers `prompt` (one row)
    with (`choose_program`)."""
    runner = as_runner(model)
    rows = _one_prompt(prompt, tokenizer, "choose")
    ids = option_ids(runner.model, options, tokenizer)
    return run(runner, choose_program(runner, rows[0], options, ids, whole))


@dataclass
class ToolCall:
    name: str  # the function called
    arguments: dict  # valid against its parameters schema
    text: str  # the call in Gemma 4's syntax (dgemma.tool_calls)
    scores: list[float] | None = None  # per function, when the model chose it
    json: JsonResult | None = None  # the arguments' fill (None for a function without parameters)


def tool_plans(model: DiffusionGemma | Runner, tokenizer, tools: list[dict]) -> list[tuple[str, JsonPlan]]:
    """Each tool's name and the plan of its call (OpenAI's `{"type": "function", "function": {...}}` or the
    function itself). A ValueError names the tool (`tools.i`) that cannot be called."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of functions")
    plans = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and isinstance(tool.get("function"), dict) else tool
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or len(name) > 128 or not re.fullmatch(FUNCTION_NAME, name):
            raise ValueError(f"tools.{i}: a function name must be letters, digits, _ . - (at most 128)")
        parameters = function.get("parameters")
        try:
            plans.append((name, tool_call_plan(model, tokenizer, name, parameters)))
        except StructuredOutputError as e:
            raise ValueError(f"tools.{i}.function.parameters: {e}") from e
    return plans


def tool_call_program(
    runner: Runner,
    prompt: list[int],
    plans: list[tuple[str, JsonPlan]],
    params: SamplingParams | None = None,
    *,
    tokenizer,
    name: str | None = None,
    retries: int = DEFAULT_RETRIES,
    size: str = "draft",
    **overrides,
) -> Program:
    """A call of one of the functions (`tool_plans`): the one named, the only one, or the one whose call
    the encoder scores best as the answer's start; then its arguments by the json program. A ToolCall."""
    names = [n for n, _ in plans]
    scores = None
    if name is not None:
        if name not in names:
            raise ValueError(f"tool_choice: no function named {name!r} among the tools")
        index = names.index(name)
    elif len(plans) == 1:
        index = 0
    else:  # the call's start that the encoder scores best as the answer's start (choose, whole=False)
        starts = [tokenizer.encode(f"{CALL_OPEN}call:{n}{{", add_special_tokens=False) for n in names]
        pixels = overrides.get("pixels")
        chosen = yield from result_of(choose_program(runner, prompt, names, starts, whole=False, pixels=pixels))
        index, scores = chosen.index, chosen.scores
    name, plan = plans[index]
    write = functools.partial(call_text, name)
    program = json_program(runner, plan, prompt, params, retries=retries, size=size, write=write, **overrides)
    answer = yield from result_of(program, passes=(DraftEvent,))
    yield DoneEvent(ToolCall(name, answer.value, answer.text, scores, answer))


def auto_program(
    runner: Runner,
    prompt: list[int],
    plans: list[tuple[str, JsonPlan]],
    params: SamplingParams | None = None,
    *,
    tokenizer,
    retries: int = DEFAULT_RETRIES,
    size: str = "draft",
    limit: int | None = None,
    logprobs: int | None = None,
    pixels=None,
    **overrides,
) -> Program:
    """tool_choice "auto": the model decides between text and a call by its own scores. One Score call
    reads the encoder's likeliest first token of the answer: a call's opening token, and the answer is
    a call (`tool_call_program`: the function it scores best, its arguments by construction); anything
    else, and the answer is text (the canvas loop, its tokens streamed). A ToolCall or a GenerationResult."""
    opening = tokenizer.encode(CALL_OPEN, add_special_tokens=False)[:1]
    scored = yield ScoreCall(prompt, [opening], top=1, pixels=pixels)
    if scored.top[0][0][0][0] == opening[0]:
        given = dict(tokenizer=tokenizer, retries=retries, size=size, limit=limit, pixels=pixels)
        call = tool_call_program(runner, prompt, plans, params, **given, **overrides)
        yield DoneEvent((yield from result_of(call, passes=(DraftEvent,))))
        return
    length = {} if limit is None else {"max_new_tokens": limit}
    yield from generate_program(runner, [prompt], params, logprobs=logprobs, pixels=pixels, **length, **overrides)


def tool_call(
    model: Runner | Any,
    prompt,
    tools: list[dict],
    params: SamplingParams | None = None,
    *,
    tokenizer,
    name: str | None = None,
    retries: int = DEFAULT_RETRIES,
    size: str = "draft",
    **overrides,
) -> ToolCall:
    """A call of one of `tools` as the answer to `prompt` (one row, usually a chat prompt that declares
    the tools): the function `name`, or the one the model scores best, with arguments valid against its
    `parameters` schema (what a server's tool_choice "required" or a named function gives). With
    `name="auto"` the model decides between a call and text (`auto_program`): a ToolCall, or the
    GenerationResult of its text."""
    runner = as_runner(model)
    rows = _one_prompt(prompt, tokenizer, "tool_call")
    check_json_options(retries, size)
    plans = tool_plans(runner, tokenizer, tools)
    limit = overrides.pop("max_new_tokens", None)  # the arguments' upper bound, as generate_json's
    kw = dict(tokenizer=tokenizer, retries=retries, size=size, limit=limit)
    if name == "auto":
        return _decoded_text(run(runner, auto_program(runner, rows[0], plans, params, **kw, **overrides)), tokenizer)
    return run(runner, tool_call_program(runner, rows[0], plans, params, name=name, **kw, **overrides))


def _decoded_text(out, tokenizer):
    if isinstance(out, GenerationResult):
        out.text = [tokenizer.decode(t) for t in out.tokens]
    return out
