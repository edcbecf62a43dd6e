"""Answers the model chooses by its scores: an option among given ones (Choose), and a tool call (Call: the
function named, the only one, or the one whose call the encoder scores best; Auto: a call or text, as the
answer's likeliest first token says). The tasks' rules are programs.py's (what max_tokens means, the
limits); a call's arguments are a JSON answer (`json_program`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..model.model import DiffusionGemma
from ..runtime.runner import Runner, as_runner
from ..structured.plans import JsonPlan, tool_call_plan
from ..structured.tokens import DEFAULT_RETRIES, StructuredOutputError
from ..tool_calls import CALL_OPEN, FUNCTION_NAME, call_text
from .engine import Answer, DoneEvent, DraftEvent, Program, ScoreCall, result_of, run
from .loop import GenerationResult, end_of_text_ids
from .programs import (
    CONTEXT,
    Generate,
    Json,
    JsonResult,
    SchemaRefused,
    check_json_options,
    check_rows,
    context_of,
    fast_only,
    json_program,
    length,
    library_checked,
    library_params,
    one_prompt,
    resolved,
    shaped_limit,
    sizes_of,
)
from .sampling import RequestError, SamplingParams

MAX_OPTIONS = 64


@dataclass
class Chosen:
    index: int  # of the option chosen
    option: str | list[int]
    scores: list[float]  # per option: the encoder's log-probability of it (and of the end of text after it)

    def answer(self) -> Answer:
        details = {"choice_index": self.index, "choice_scores": [round(s, 4) for s in self.scores]}
        text = self.option if isinstance(self.option, str) else None
        return Answer(text, None if text is not None else list(self.option), None, details, "stop")


def option_ids(model: DiffusionGemma, options: list, tokenizer=None) -> list[list[int]]:
    """Options (texts, with `tokenizer`, or token ids) as token ids, checked."""
    if not isinstance(options, list) or not 0 < len(options) <= MAX_OPTIONS:
        raise RequestError(f"options must be a list of 1 to {MAX_OPTIONS} options", "options")
    if tokenizer is None and any(isinstance(o, str) for o in options):
        raise RequestError("text options need a tokenizer", "options")
    ids = [tokenizer.encode(o, add_special_tokens=False) if isinstance(o, str) else list(o) for o in options]
    check_rows(ids, model, "options", "option")
    return ids


@dataclass(frozen=True)
class Choose:
    """The option the model most likely answers `prompt` with (dgemma.choose): each scored by the
    encoder's summed log-probability of its tokens and of the end-of-text token after them (`whole`; else
    as the answer's start). `max_tokens`: the most tokens an option may have."""

    prompt: list[int]
    options: list
    tokenizer: Any = None
    whole: bool = True
    max_tokens: int | None = None
    pixels: Any = None
    ids: list[list[int]] | None = None  # the options' token ids, by check
    work: ClassVar[str | None] = "tokenize"

    def check(self, model: DiffusionGemma, context: int | None = None) -> Choose:
        if self.pixels is not None:
            raise RequestError("options are scored on text prompts (leave out the images)", "options")
        check_rows([self.prompt], model, "prompt")
        ids = option_ids(model, self.options, self.tokenizer)
        longest = max(map(len, ids))
        if self.max_tokens is not None and longest > self.max_tokens:
            raise RequestError(f"max_tokens is {self.max_tokens}, but an option has {longest} tokens", "max_tokens")
        if len(self.prompt) + longest + 1 > context_of(model, context):
            message = f"options: the prompt and the longest option exceed the context of {context_of(model, context)}"
            raise RequestError(message, "options", CONTEXT)
        return dataclasses.replace(self, ids=ids)

    def program(self, model: DiffusionGemma, stats=None) -> Program:
        return Program(choose_program(model, self.prompt, self.options, self.ids, self.whole, self.pixels))


def choose_program(
    model: DiffusionGemma, prompt: list[int], options: list, ids: list[list[int]], whole: bool = True, pixels=None
):
    """The option the model most likely answers `prompt` with, all options in one Score call. A Chosen."""
    end = end_of_text_ids(model)[:1] if whole else []
    scored = yield ScoreCall(prompt, [o + end for o in ids], pixels=pixels)
    scores = [float(lp.sum()) for lp in scored.logprobs]
    best = max(range(len(options)), key=scores.__getitem__)
    yield DoneEvent(Chosen(best, options[best], scores))


def choose(model: Runner | Any, prompt, options: list, *, tokenizer=None, whole: bool = True) -> Chosen:
    """The option (text, with `tokenizer`, or token ids) the model most likely answers `prompt` (one row)
    with (`Choose`)."""
    runner = as_runner(model)
    task = library_checked(Choose(one_prompt(prompt, tokenizer), options, tokenizer, whole), runner.model)
    return run(runner, task.program(runner.model))


@dataclass
class ToolCall:
    name: str  # the function called
    arguments: dict  # valid against its parameters schema
    text: str  # the call in Gemma 4's syntax (dgemma.tool_calls)
    scores: list[float] | None = None  # per function, when the model chose it
    json: JsonResult | None = None  # the arguments' fill (None for a function without parameters)

    def answer(self) -> Answer:
        details = {} if self.json is None else {"json_attempts": self.json.attempts}
        return Answer(self.text, None, None if self.json is None else self.json.result, details, "stop")


def tool_plans(model: DiffusionGemma, tokenizer, tools: list[dict]) -> list[tuple[str, JsonPlan]]:
    """Each tool's name and the plan of its call (OpenAI's `{"type": "function", "function": {...}}` or the
    function itself). A RequestError names the tool (`tools.i...`) that cannot be called."""
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools must be a non-empty list of functions", "tools")
    plans, sizes = [], sizes_of(model)
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and isinstance(tool.get("function"), dict) else tool
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or len(name) > 128 or not re.fullmatch(FUNCTION_NAME, name):
            raise RequestError(f"tools.{i}: a function name must be letters, digits, _ . - (at most 128)", f"tools.{i}")
        try:
            plans.append((name, tool_call_plan(sizes, tokenizer, name, function.get("parameters"))))
        except StructuredOutputError as e:
            where = f"tools.{i}.function.parameters"
            raise SchemaRefused(f"{where}: {e}", where) from e
    return plans


@dataclass(frozen=True)
class Call:
    """A call of one of `tools` as the answer (dgemma.tool_call; a server's tool_choice "required" or a
    named function): the function `name`, the only one, or the one the model scores best, its arguments
    valid against its parameters schema, within `params.max_new_tokens` as a JSON answer's."""

    prompt: list[int]
    tools: list[dict]
    tokenizer: Any
    name: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    retries: int = DEFAULT_RETRIES
    size: str = "draft"
    pixels: Any = None
    plans: list | None = None  # (name, plan) per tool, by check
    limit: int | None = None
    work: ClassVar[str | None] = "compile"

    def check(self, model: DiffusionGemma, context: int | None = None) -> Call:
        check_json_options(self.retries, self.size)
        check_rows([self.prompt], model, "prompt")
        p = resolved(model, self.params, early_commit=False)
        fast_only(p, "constrained positions (a tool call)")
        plans = tool_plans(model, self.tokenizer, self.tools)
        names = [n for n, _ in plans]
        if self.name is not None and self.name not in names:
            raise RequestError(f"tool_choice: no function named {self.name!r} among the tools", "tool_choice")
        callable_ = [p for n, p in plans if self.name in (None, n)]
        limit = shaped_limit(model, callable_, self.params.max_new_tokens, len(self.prompt), context)
        return dataclasses.replace(self, plans=plans, limit=limit, params=dataclasses.replace(p, max_new_tokens=limit))

    def program(self, model: DiffusionGemma, stats) -> Program:
        return Program(call_program(model, stats, self), False, len(self.prompt))


def call_program(model: DiffusionGemma, stats, task: Call) -> Generator:
    """A checked Call: the function named, the only one, or the one whose call the encoder scores best as
    the answer's start; then its arguments by the json program. A ToolCall."""
    names = [n for n, _ in task.plans]
    scores = None
    if task.name is not None:
        index = names.index(task.name)
    elif len(names) == 1:
        index = 0
    else:  # the call's start that the encoder scores best as the answer's start (choose, whole=False)
        starts = [task.tokenizer.encode(f"{CALL_OPEN}call:{n}{{", add_special_tokens=False) for n in names]
        chosen = yield from result_of(choose_program(model, task.prompt, names, starts, False, task.pixels))
        index, scores = chosen.index, chosen.scores
    name, plan = task.plans[index]
    given = dict(retries=task.retries, size=task.size, pixels=task.pixels, write=functools.partial(call_text, name))
    params = dataclasses.replace(task.params, early_commit=False)  # Auto's may stream; a call is whole
    arguments = Json(task.prompt, None, task.tokenizer, params, plan=plan, limit=task.limit, **given)
    answer = yield from result_of(json_program(model, stats, arguments), passes=(DraftEvent,))
    yield DoneEvent(ToolCall(name, answer.value, answer.text, scores, answer))


@dataclass(frozen=True)
class Auto(Call):
    """tool_choice "auto": the model decides between text and a call by its own scores; `params.max_new_tokens`
    bounds the text, and the call's arguments as a JSON answer's."""

    logprobs: int | None = None

    def check(self, model: DiffusionGemma, context: int | None = None) -> Auto:
        params = dataclasses.replace(
            self.params, max_new_tokens=length(model, self.params.max_new_tokens, len(self.prompt), context)
        )
        call = Call.check(dataclasses.replace(self, params=params), model, context)  # a call's rules, within it
        text = Generate([self.prompt], params, logprobs=self.logprobs, pixels=self.pixels).check(model, context)
        return dataclasses.replace(self, plans=call.plans, limit=call.limit, params=text.params)

    def program(self, model: DiffusionGemma, stats) -> Program:
        return Program(auto_program(model, stats, self), False, len(self.prompt))


def auto_program(model: DiffusionGemma, stats, task: Auto) -> Generator:
    """One Score call reads the encoder's likeliest first token of the answer: a call's opening token, and
    the answer is a call (`call_program`); anything else, and the answer is text (the canvas loop, its
    tokens streamed). A ToolCall or a GenerationResult."""
    opening = task.tokenizer.encode(CALL_OPEN, add_special_tokens=False)[:1]
    scored = yield ScoreCall(task.prompt, [opening], top=1, pixels=task.pixels)
    if scored.top[0][0][0][0] == opening[0]:
        call = Call(task.prompt, task.tools, task.tokenizer, None, task.params, task.retries, task.size, task.pixels)
        call = dataclasses.replace(call, plans=task.plans, limit=task.limit)
        yield DoneEvent((yield from result_of(call_program(model, stats, call), passes=(DraftEvent,))))
        return
    text = Generate([task.prompt], task.params, logprobs=task.logprobs, pixels=task.pixels)
    yield from text.steps(model, stats)


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
    pixels=None,
    **overrides,
) -> ToolCall | GenerationResult:
    """A call of one of `tools` as the answer to `prompt` (one row, usually a chat prompt that declares
    the tools): the function `name`, or the one the model scores best, with arguments valid against its
    `parameters` schema (what a server's tool_choice "required" or a named function gives). With
    `name="auto"` the model decides between a call and text (`Auto`): a ToolCall, or the
    GenerationResult of its text."""
    runner = as_runner(model)
    kind, name = (Auto, None) if name == "auto" else (Call, name)
    task = kind(
        one_prompt(prompt, tokenizer), tools, tokenizer, name, library_params(params, overrides), retries, size, pixels
    )
    out = run(runner, library_checked(task, runner.model).program(runner.model, runner.canvas_stats))
    if isinstance(out, GenerationResult):
        out.text = [tokenizer.decode(t) for t in out.tokens]
    return out
