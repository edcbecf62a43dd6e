"""The generation routes. Each one is: parse (the request model, protocol.py) -> checks and tokenization ->
its programs (dgemma/programs.py, one per choice; the same programs the library and the CLI run) ->
`engine.submit` -> the choices' pieces streamed or gathered (choices.py, answers.py).

What `max_tokens` (or `max_completion_tokens`) means, per request kind (docs/server.md has the table):
plain text, the most tokens generated; a JSON answer or a required tool call, the most it may take (its
values are sized within it; a 400 only when the shortest valid answer does not fit); infilling (`suffix`),
the middle's length (without it, the length is chosen as `dgemma.infill(middle_length="auto")` chooses
it); `choices`, the most tokens an option may have.
"""

from __future__ import annotations

import json
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..editing import canvas_logprobs_program, plan_infill
from ..images import DEFAULT_BUDGET, chat_prompt
from ..programs import (
    auto_program,
    choose_program,
    generate_program,
    infill_program,
    json_plan,
    json_program,
    tool_call_program,
    tool_plans,
)
from ..structured import DEFAULT_RETRIES
from . import answers, media
from . import choices as runs
from . import logprobs as logprob_blocks
from .protocol import ApiError, CanvasScoreRequest, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .served import Served, budget, check_chars, check_model, compile_plans, resolve, room, tokenize


def add_generation_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        return await _chat(served, body, http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await _completions(served, body, http)

    @app.post("/v1/canvas/score")
    async def canvas_score(body: CanvasScoreRequest):
        return await _canvas_score(served, body)


async def _canvas_score(served: Served, body: CanvasScoreRequest) -> dict:
    """A read-only denoising pass over a given canvas: each canvas token's log-probability under the
    denoiser, and the top alternatives (a dgemma extension; vLLM's "read-only" read)."""
    check_model(served, body.model)
    ids = {}
    vocab = served.model.text_config.vocab_size
    for name in ("prompt", "canvas"):
        value = getattr(body, name)
        if isinstance(value, str):
            check_chars(served, len(value), name)
            value = await tokenize(served, served.tokenizer.encode, value, param=name, add_special_tokens=False)
        bad = [t for t in value if not 0 <= t < vocab]
        if not value:
            raise ApiError(400, f"{name} has no tokens", name)
        if bad:
            raise ApiError(400, f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", name)
        ids[name] = value
    budget(served, None, len(ids["prompt"]), "canvas", "prompt")
    program = canvas_logprobs_program(served.model, ids["prompt"], ids["canvas"], body.top_logprobs)
    try:
        chosen, tops = await runs.outcome(served.engine, program, served.request_timeout)
    except ApiError as e:
        if e.status != 400:
            raise
        raise ApiError(400, e.message, "canvas") from None
    block = logprob_blocks.legacy(served.tokenizer, ids["canvas"], chosen, tops)
    return {
        "object": "canvas.score",
        "model": served.name,
        "token_ids": ids["canvas"],
        **block,
        "usage": {"prompt_tokens": len(ids["prompt"]), "canvas_tokens": len(ids["canvas"])},
    }


async def _chat(served: Served, body: ChatCompletionRequest, http: Request):
    check_model(served, body.model)
    tok = served.tokenizer
    if not tok.chat_template:
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    use_tools = bool(body.tools) and body.tool_choice != "none"
    takes_tools = "tools" in tok.chat_template
    if use_tools and not takes_tools:
        raise ApiError(400, "this model's chat template has no tool support", "tools")
    for i, m in enumerate(body.messages):
        if (m.role == "tool" or m.tool_calls) and not takes_tools:
            raise ApiError(400, "this model's chat template has no tool support", f"messages.{i}")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if use_tools else None
    calls = [d.get("tool_calls", []) for d in messages]
    chars = sum(len(m.text()) for m in body.messages) + len(json.dumps(calls))
    check_chars(served, chars + len(json.dumps(tools or [])), "messages")
    messages = await media.decode_image_parts(served.model, body, messages)
    budget_ = body.max_soft_tokens or DEFAULT_BUDGET
    thinking = True if body.reasoning else None
    prompt, pixels = await tokenize(
        served, chat_prompt, tok, served.model.config, messages, budget_, param="messages",
        enable_thinking=thinking, tools=tools,
    )  # fmt: skip
    requested, param = body.requested_tokens
    if body.choices is not None:
        if pixels is not None:
            raise ApiError(400, "choices: options are scored on text prompts (leave out the images)", "choices")
        choices = await _chosen(served, body, [prompt], requested, param)
    elif body.forced_call:
        choices = await _call_choices(served, body, prompt, pixels, tools, http)
    elif use_tools and _decides(body):
        choices = await _auto_choices(served, body, prompt, pixels, tools, http)
    else:
        choices = await _json_choices(served, body, [prompt], (requested, param, "messages"), http, pixels)
        choices = choices or _chat_choices(served, body, prompt, pixels)
    pieces = runs.run(choices, served.tokenizer, http.is_disconnected)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = answers.Chunks(served, chat=True)
        opening = [answers.sse({**chunks.head, "choices": [answers.role_delta(c.index)]}) for c in choices]
        most = answers.call_limit(body)
        stream = answers.event_stream(chunks, pieces, choices, opening, len(prompt), usage, use_tools, most)
        return StreamingResponse(stream, media_type="text/event-stream")
    return await answers.chat_answer(served, body, pieces, choices, len(prompt), use_tools)


def _chat_choices(served: Served, body: ChatCompletionRequest, prompt: list[int], pixels) -> list[runs.Choice]:
    """A plain chat answer: the canvas loop's program per choice."""
    requested, param = body.requested_tokens
    params = resolve(served, body.sampling(budget(served, requested, len(prompt), param, "messages")))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    runner = served.engine.runner

    def build(_j: int, seed: int | None):
        return generate_program(runner, [prompt], replace(params, seed=seed), logprobs=logprobs, pixels=pixels)

    return _submit(served, body, build, params, [len(prompt)], stops=body.stop, reasoning=body.reasoning)


def _submit(served: Served, body, build, params, prompt_tokens: list[int], stops=None, reasoning=False):
    want_drafts = body.include_drafts and body.stream
    return runs.submit(
        served.engine, len(prompt_tokens), body.n, build, seed=params.seed, stops=stops, reasoning=reasoning,
        prompt_tokens=prompt_tokens, want_drafts=want_drafts, reference=params.mode == "exact",
        timeout=served.request_timeout,
    )  # fmt: skip


async def _json_choices(served: Served, body, prompts: list[list[int]], asked: tuple, http, pixels=None):
    """With a json_object / json_schema response_format: the JSON program per prompt and choice (None
    otherwise). `asked`: the length requested, its field, and the prompt's field."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if getattr(body, "tools", None) and getattr(body, "tool_choice", None) != "none":
        raise ApiError(400, "response_format: a JSON answer does not go with tools (use tool_choice 'none')", "tools")
    if getattr(body, "reasoning", False) or getattr(body, "suffix", None) is not None:
        other = "reasoning" if getattr(body, "reasoning", False) else "suffix"
        raise ApiError(400, f"{other}: does not go with a JSON response_format (the answer is the JSON)", other)
    requested, param, prompt_param = asked
    longest = max(len(p) for p in prompts)
    schema = None if fmt.type == "json_object" else fmt.json_schema.schema_
    length = budget(served, requested, longest, param, prompt_param) if schema is None else 0
    where = "response_format.json_schema.schema"  # what a plan that cannot be laid out names
    plan = await compile_plans(served, http, json_plan, served.model, served.tokenizer, schema, length, param=where)
    params, limit = _shaped_params(served, body, [plan], longest, asked)
    runner = served.engine.runner

    def build(j: int, seed: int | None):
        given = dict(retries=_retries(body), pixels=pixels, limit=limit)
        return json_program(runner, plan, prompts[j], replace(params, seed=seed), **given)

    return _submit(served, body, build, params, [len(p) for p in prompts])


def _retries(body) -> int:
    return DEFAULT_RETRIES if body.retries is None else body.retries


def _shaped_params(served: Served, body, plans: list, longest: int, asked: tuple):
    """The settings and the token limit of an answer laid out by plans (JSON, a tool call): `max_tokens` is
    an upper bound, as for text (without it, what the context leaves); refused only when even the shortest
    valid answer does not fit it."""
    requested, param, prompt_param = asked
    n = max(p.smallest for p in plans)
    if requested is not None and requested < n:
        raise ApiError(400, f"{param} is {requested}, but the shortest valid answer takes {n} tokens", param)
    left = room(served, longest)
    if n > left:
        message = (
            f"the shortest valid answer takes {n} tokens, but with a prompt of {longest} tokens at most {left} "
            f"fit in the context of {served.context} (whole canvases of {served.canvas})"
        )
        raise ApiError(400, message, prompt_param, code="context_length_exceeded")
    limit = left if requested is None else min(requested, left)  # an upper bound: above the room, the room
    return resolve(served, body.sampling(limit)), limit


async def _call_choices(served: Served, body: ChatCompletionRequest, prompt: list[int], pixels, tools: list, http):
    """tool_choice "required" or a named function: each choice is a call of the function (the named one,
    the only one, or the one the model scores best), its arguments filled under the function's parameters
    schema, read back and validated (dgemma.programs.tool_call_program)."""
    for name in ("reasoning", "logprobs", "stop"):
        if getattr(body, name):
            raise ApiError(400, f"{name}: does not go with a required tool call (the answer is the call)", name)
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(400, "response_format: a required tool call is the answer's format", "response_format")
    named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    plans = await _tool_plans(served, tools, http)
    callable_ = [p for n, p in plans if named is None or n == named]
    requested, param = body.requested_tokens
    params, limit = _shaped_params(served, body, callable_, len(prompt), (requested, param, "messages"))
    runner, tok = served.engine.runner, served.tokenizer

    def build(_j: int, seed: int | None):
        given = dict(tokenizer=tok, name=named, retries=_retries(body), pixels=pixels, limit=limit)
        return tool_call_program(runner, prompt, plans, replace(params, seed=seed), **given)

    return _submit(served, body, build, params, [len(prompt)])


async def _tool_plans(served: Served, tools: list[dict], http):
    """Each tool's call plan; a 400 naming the tool (`tools.i...`) that cannot be called."""
    try:
        return await compile_plans(served, http, tool_plans, served.model, served.tokenizer, tools, param="tools")
    except ApiError as e:  # the message names the tool: "tools.i...: why"
        raise ApiError(400, e.message.partition(": ")[2], e.message.partition(": ")[0]) from None


def _decides(body: ChatCompletionRequest) -> bool:
    """Whether tool_choice "auto" is the model's choice between text and a call by its scores
    (`auto_program`): an answer that starts with either (no thinking first), no JSON format, no stop
    strings or logprobs (those are for text); otherwise the answer is free text, calls read out of it."""
    plain = body.response_format is None or body.response_format.type == "text"
    return plain and not (body.reasoning or body.stop or body.logprobs)


async def _auto_choices(served: Served, body: ChatCompletionRequest, prompt: list[int], pixels, tools: list, http):
    """tool_choice "auto": per choice, the model's scores decide between text and a call (a call's
    arguments by construction, within max_tokens as text's tokens are)."""
    plans = await _tool_plans(served, tools, http)
    requested, param = body.requested_tokens
    params = resolve(served, body.sampling(budget(served, requested, len(prompt), param, "messages")))
    runner, tok = served.engine.runner, served.tokenizer

    def build(_j: int, seed: int | None):
        given = dict(tokenizer=tok, retries=_retries(body), limit=params.max_new_tokens, pixels=pixels)
        return auto_program(runner, prompt, plans, replace(params, seed=seed), **given)

    return _submit(served, body, build, params, [len(prompt)])


async def _chosen(served: Served, body, prompts: list[list[int]], requested: int | None, param: str):
    """`choices`: each prompt's best-scored option (dgemma.programs.choose_program), within the context and
    the length asked for; one choice per prompt (scoring draws nothing)."""
    tok = served.tokenizer
    check_chars(served, sum(len(o) for o in body.choices), "choices")
    options = await tokenize(served, _encode_all, tok, body.choices, param="choices")
    lengths = [len(ids) for ids in options]
    if requested is not None and max(lengths) > requested:
        raise ApiError(400, f"{param} is {requested}, but an option has {max(lengths)} tokens", param)
    longest = max(len(p) for p in prompts)
    if longest + max(lengths) + 1 > served.context:
        raise ApiError(400, f"the prompt and the longest option exceed the context of {served.context}", "choices")
    runner = served.engine.runner

    def build(j: int, _seed: int | None):
        return choose_program(runner, prompts[j], body.choices, options)

    prompt_tokens = [len(p) for p in prompts]
    return runs.submit(
        served.engine, len(prompts), 1, build, seed=None, stops=None, reasoning=False,
        prompt_tokens=prompt_tokens, timeout=served.request_timeout,
    )  # fmt: skip


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


# ------------------------------------------------------------------------------------------------
# /v1/completions


async def _completion_prompts(served: Served, body: CompletionRequest) -> list[list[int]]:
    """Token ids of every prompt (an empty text becomes the BOS token)."""
    vocab = served.model.text_config.vocab_size
    check_chars(served, sum(len(p) for p in body.prompt if isinstance(p, str)), "prompt")
    out = []
    for i, p in enumerate(body.prompt):
        if isinstance(p, list):
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ApiError(
                    400, f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt"
                )
            out.append(list(p))
        elif p:
            out.append(await tokenize(served, served.tokenizer.encode, p, param="prompt"))
        else:
            out.append([served.model.text_config.bos_token_id or 2])
    return out


async def _infill_choices(served: Served, body: CompletionRequest, prompt: list[int]):
    """For `suffix`: the infill program per choice (dgemma.editing.plan_infill lays it out: max_tokens is
    the middle's length, at most the longest middle that still sees the suffix; without it the length is
    chosen). A middle that needs fewer tokens ends at its first end-of-text token."""
    check_chars(served, len(body.suffix), "suffix")
    suffix = await tokenize(served, served.tokenizer.encode, body.suffix, param="suffix", add_special_tokens=False)
    length = "auto" if body.max_tokens is None else body.max_tokens
    try:
        plan = plan_infill(served.model, prompt, suffix, length)
    except ValueError as e:
        if "middle_length" in str(e):
            raise ApiError(400, f"max_tokens is the infill middle's length; {e}", "max_tokens") from e
        raise ApiError(400, str(e), "suffix") from e
    budget(served, len(plan.templates[0]), len(plan.prompt), "max_tokens", "prompt")
    params = resolve(served, replace(body.sampling(len(plan.templates[0])), early_commit=False))
    runner = served.engine.runner

    def build(_j: int, seed: int | None):
        return infill_program(runner, plan, replace(params, seed=seed), logprobs=body.logprobs)

    return plan, _submit(served, body, build, params, [len(plan.prompt) * len(plan.lengths)], stops=body.stop)


async def _completions(served: Served, body: CompletionRequest, http: Request):
    check_model(served, body.model)
    prompts = await _completion_prompts(served, body)
    plan = None
    if body.choices is not None:
        choices = await _chosen(served, body, prompts, body.max_tokens, "max_tokens")
    else:
        choices = await _json_choices(served, body, prompts, (body.max_tokens, "max_tokens", "prompt"), http)
    if choices is None and body.suffix is not None:  # one prompt (the request model says so)
        plan, choices = await _infill_choices(served, body, prompts[0])
    elif choices is None:
        longest = max(len(p) for p in prompts)
        params = resolve(served, body.sampling(budget(served, body.max_tokens, longest, "max_tokens", "prompt")))
        runner = served.engine.runner

        def build(j: int, seed: int | None):
            return generate_program(runner, prompts[j], replace(params, seed=seed), logprobs=body.logprobs)

        choices = _submit(served, body, build, params, [len(p) for p in prompts], stops=body.stop)
    pieces = runs.run(choices, served.tokenizer, http.is_disconnected)
    return await answers.completion_reply(served, body, choices, pieces, prompts, plan)
