"""Answers with a given shape on the server: response_format (a request's JSON plan, dgemma/structured.py,
and the finish that reads each choice's answer back, validates it, and draws it again when it fails)
and `choices` (the answer is the option the model scores best).

A schema's answer is sized by a free draft first (`sized_plans`), as dgemma.generate_json does. A JSON
answer is whole: its text is written from the values read back, so it is sent when the choice
ends (one content piece when streaming), never token by token; `stop` does not apply (the request model
refuses it). An answer that fails after `DEFAULT_RETRIES` more draws is a 422 naming response_format.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import replace

from ..engine import Engine, EngineRequest
from ..generate import GenerationResult
from ..settings import SamplingParams
from ..structured import DEFAULT_RETRIES, JsonPlan, json_text, object_plan, schema_plan, unsatisfied
from .choices import Choice, Finish, Piece, as_api_error, rerun, run_to_end
from .output import StreamText
from .protocol import ApiError, ResponseFormat


def json_plan(fmt: ResponseFormat | None, tokenizer, model, length: Callable[[], int]) -> JsonPlan | None:
    """The plan a response_format asks for (None for text); `length()` is the budget of a json_object
    answer (max_tokens, or the default, within the context). A schema it cannot compile is a 400."""
    if fmt is None or fmt.type == "text":
        return None
    from ..structured import StructuredOutputError

    try:
        if fmt.type == "json_object":
            return object_plan(tokenizer, model.text_config.vocab_size, length())
        return schema_plan(model, tokenizer, fmt.json_schema.schema_)
    except StructuredOutputError as e:
        raise ApiError(400, str(e), "response_format.json_schema.schema") from e


async def sized_plans(
    engine: Engine, plan: JsonPlan, prompts: list[list[int]], params: SamplingParams, tokenizer, **given
) -> list[JsonPlan]:
    """Each prompt's plan sized by a free draft (dgemma.structured.draft_plan): the answer generated with
    `params` and no constraint, as requests of their own on the engine (`given`: pixels, timeout), read
    for its values. A plan that cannot be sized (any JSON object) serves every prompt as it is."""
    if plan.resize is None:
        return [plan] * len(prompts)
    params = replace(params, max_new_tokens=len(plan.template), early_commit=False)
    drafts = [asyncio.ensure_future(run_to_end(engine, EngineRequest(p, params, **given))) for p in prompts]
    try:
        results = await asyncio.gather(*drafts)
    except BaseException as e:
        for d in drafts:  # the other drafts stop too (each cancels its engine request)
            d.cancel()
        if isinstance(e, ApiError) or not isinstance(e, Exception):  # a full queue (429), draining (503), a cancel
            raise
        raise as_api_error(e) from e  # what the engine reported for a draft: a timeout is a 504
    return [plan.resize(tokenizer.decode(r.tokens[0])) for r in results]


def json_finish(
    engine: Engine, plans: list[JsonPlan], prompts: list[list[int]], n: int, tokenizer, write: Callable = json_text
) -> Finish:
    """A choice's finish (server/choices.py): its answer read back by its prompt's plan and validated on
    the engine thread (scoring a choice takes model passes), and written by `write` (JSON text, or a tool
    call); one that fails is drawn again with the next seeds."""

    async def finish(choice: Choice, result: GenerationResult) -> tuple[list[int], int]:
        prompt, plan = prompts[choice.index // n], plans[choice.index // n]
        seed = choice.request.params.seed
        errors = []
        for attempt in range(DEFAULT_RETRIES + 1):
            if attempt:
                result = await rerun(engine, choice.request, None if seed is None else (seed + attempt) % 2**63)
            tokens = result.tokens[0]
            read = engine.call(lambda runner, tokens=tokens: plan.read(runner, prompt, tokens))
            value, error = await asyncio.wrap_future(read)
            if error is None:  # whole and valid: the answer ended itself, whatever length its template had
                choice.answer, choice.finish_reason = write(value), "stop"
                choice.details = {"json_attempts": attempt + 1}
                return tokenizer.encode(choice.answer, add_special_tokens=False), 0
            errors.append(error)
        raise unsatisfied(DEFAULT_RETRIES + 1, errors[-1])

    return finish


async def chosen_answers(
    engine: Engine, tokenizer, prompts: list[list[int]], options: list[str], option_ids: list[list[int]]
):
    """`choices`: for each prompt, the option (`options`, tokenized as `option_ids`) the model scores best
    (dgemma.choose, on the engine thread), as the Choices and pieces the answer writers read; the scores
    go in each choice's `dgemma` details."""
    from ..structured import choose

    chosen = []
    for p in prompts:
        future = engine.call(lambda runner, p=p: choose(runner, p, option_ids))
        try:
            chosen.append(await asyncio.wrap_future(future))
        except ValueError as e:
            raise ApiError(400, str(e), "choices") from e
    details = [{"choice_index": c.index, "choice_scores": [round(s, 4) for s in c.scores]} for c in chosen]
    return given_answers(tokenizer, [options[c.index] for c in chosen], details)


def given_answers(tokenizer, texts: list[str], details: list[dict] | None = None):
    """Answers known without denoising (a chosen option, a tool call without arguments) as the Choices
    and pieces the answer writers read: one content piece and an end each."""
    choices = []
    for j, text in enumerate(texts):
        choice = Choice(j, None, StreamText(None, False), answer=text)
        choice.returned_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        choice.details = details[j] if details else {}
        choices.append(choice)

    async def pieces():
        for choice in choices:
            yield Piece(choice.index, "content", choice.answer)
            yield Piece(choice.index, "end", finish_reason="stop")

    return choices, pieces()


async def call_plan(engine: Engine, tokenizer, model, prompt: list[int], tools: list[dict], named: str | None):
    """tool_choice "required" or named: the function (the named one, the only one, or the one whose call
    the encoder scores best as the answer's start) and the plan of its call, whose arguments follow its
    `parameters` schema. A tool or schema that cannot be laid out is a 400 naming it."""
    from ..structured import StructuredOutputError, choose, tool_call_plan
    from ..tool_calls import CALL_OPEN, FUNCTION_NAME

    functions = [t.get("function") if isinstance(t.get("function"), dict) else t for t in tools]
    names = [f.get("name") for f in functions]
    for i, name in enumerate(names):
        if not isinstance(name, str) or len(name) > 128 or not re.fullmatch(FUNCTION_NAME, name):
            raise ApiError(400, "a function name must be letters, digits, _ . - (at most 128)", f"tools.{i}")
    if named is not None:
        index = names.index(named)
    elif len(names) == 1:
        index = 0
    else:
        starts = [f"{CALL_OPEN}call:{name}{{" for name in names]
        future = engine.call(lambda runner: choose(runner, prompt, starts, tokenizer=tokenizer, whole=False))
        index = (await asyncio.wrap_future(future)).index
    parameters = functions[index].get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ApiError(400, "parameters must be a JSON schema object", f"tools.{index}.function.parameters")
    try:
        plan = tool_call_plan(model, tokenizer, names[index], parameters)
    except StructuredOutputError as e:
        raise ApiError(400, str(e), f"tools.{index}.function.parameters") from e
    return names[index], plan
