"""Answers with a given shape on the server: response_format (a request's JSON plan, dgemma/structured.py,
and the finish that reads each choice's answer back, validates it, and draws it again when it fails)
and `choices` (the answer is the option the model scores best).

A JSON answer is whole: its text is written from the values read back, so it is sent when the choice
ends (one content piece when streaming), never token by token; `stop` does not apply (the request model
refuses it). An answer that fails after `DEFAULT_RETRIES` more draws is a 422 naming response_format.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..engine import Engine
from ..generate import GenerationResult
from ..structured import DEFAULT_RETRIES, JsonPlan, compile_schema, json_text, object_plan, unsatisfied
from .choices import Choice, Finish, Piece, rerun
from .output import StreamText
from .protocol import ApiError, ResponseFormat


def json_plan(fmt: ResponseFormat | None, tokenizer, model, length: Callable[[], int]) -> JsonPlan | None:
    """The plan a response_format asks for (None for text); `length()` is the budget of a json_object
    answer (max_tokens, or the default, within the context). A schema it cannot compile is a 400."""
    if fmt is None or fmt.type == "text":
        return None
    from ..editing import end_of_text_ids
    from ..structured import StructuredOutputError

    vocab = model.text_config.vocab_size
    try:
        if fmt.type == "json_object":
            return object_plan(tokenizer, vocab, length())
        end = end_of_text_ids(model)[0]
        return compile_schema(fmt.json_schema.schema_, tokenizer, vocab, model.config.canvas_length, end)
    except StructuredOutputError as e:
        raise ApiError(400, str(e), "response_format.json_schema.schema") from e


def json_finish(engine: Engine, plan: JsonPlan, prompts: list[list[int]], n: int, tokenizer) -> Finish:
    """A choice's finish (server/choices.py): its answer read back and validated on the engine thread
    (scoring a choice takes model passes); one that fails is drawn again with the next seeds."""

    async def finish(choice: Choice, result: GenerationResult) -> tuple[list[int], int]:
        prompt = prompts[choice.index // n]
        seed = choice.request.params.seed
        errors = []
        for attempt in range(DEFAULT_RETRIES + 1):
            if attempt:
                result = await rerun(engine, choice.request, None if seed is None else (seed + attempt) % 2**63)
            tokens = result.tokens[0]
            read = engine.call(lambda runner, tokens=tokens: plan.read(runner, prompt, tokens))
            value, error = await asyncio.wrap_future(read)
            if error is None:
                choice.answer = json_text(value)
                choice.details = {"json_attempts": attempt + 1}
                return tokenizer.encode(choice.answer, add_special_tokens=False), 0
            errors.append(error)
        raise unsatisfied(DEFAULT_RETRIES + 1, errors[-1])

    return finish


async def chosen_answers(engine: Engine, tokenizer, prompts: list[list[int]], options: list[str]):
    """`choices`: for each prompt, the option the model scores best (dgemma.choose, on the engine thread),
    as the Choices and pieces the answer writers read (one content piece and an end each); the scores
    go in each choice's `dgemma` details."""
    from ..structured import choose

    chosen = []
    for p in prompts:
        future = engine.call(lambda runner, p=p: choose(runner, p, options, tokenizer=tokenizer))
        try:
            chosen.append(await asyncio.wrap_future(future))
        except ValueError as e:
            raise ApiError(400, str(e), "choices") from e
    choices = []
    for j, c in enumerate(chosen):
        choice = Choice(j, None, StreamText(None, False))
        choice.returned_tokens = len(tokenizer.encode(c.option, add_special_tokens=False))
        choice.details = {"choice_index": c.index, "choice_scores": [round(s, 4) for s in c.scores]}
        choices.append(choice)

    async def pieces():
        for choice, c in zip(choices, chosen, strict=True):
            yield Piece(choice.index, "content", c.option)
            yield Piece(choice.index, "end", finish_reason="stop")

    return choices, pieces()
