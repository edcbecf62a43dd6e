"""The generation routes of the OpenAI dialect. Each one is: parse (the request model, protocol.py) ->
tokenize -> `to_task`, the one place the body becomes a task (dgemma/generation/programs.py: what
`max_tokens` means, the defaults and limits live there) -> the task checked (a 400 naming the field,
before anything is queued or streamed) -> one program per choice on the engine -> the choices' pieces
streamed or gathered (runs.py, answers.py).

The task per body (docs/server.md has the table): `choices` -> Choose; `tool_choice` "required" or a named
function -> Call; "auto" when the model may decide by its scores -> Auto; a json_object / json_schema
`response_format` -> Json; `suffix` -> Infill; else Generate. `max_tokens` (or `max_completion_tokens`)
is each task's `max_new_tokens`, in that task's meaning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..checkpoints.tokenizer import chat_prompt
from ..generation.choose import Auto, Call, Choose
from ..generation.engine import DoneEvent, Engine, EngineRequest, Program, QueueFull, ShuttingDown
from ..generation.programs import CONTEXT, Generate, Infill, Json, Score, Task
from ..generation.sampling import RequestError
from ..images import DEFAULT_BUDGET
from . import answers, media
from . import logprobs as logprob_blocks
from .output import StreamText
from .protocol import ApiError, CanvasScoreRequest, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .runs import Choice, Piece, Served, as_api_error, run

SCHEMA = "response_format.json_schema.schema"  # where a schema that cannot be laid out is named


def add_generation_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/chat/completions", summary="OpenAI Chat Completions: a chat answer, whole or streamed")
    async def chat(body: ChatCompletionRequest, http: Request):
        return await _chat(served, body, http)

    @app.post("/v1/completions", summary="OpenAI Completions: text after a prompt, or between it and a suffix")
    async def completions(body: CompletionRequest, http: Request):
        return await _completions(served, body, http)

    @app.post("/v1/canvas/score", summary="dgemma: each token of a given canvas scored by the denoiser")
    async def canvas_score(body: CanvasScoreRequest):
        return await _canvas_score(served, body)


# ------------------------------------------------------------------------------------------------
# What every route does before and as it submits: checks, the task checked, its choices queued


def check_model(served: Served, name: str | None) -> None:
    if name is not None and name != served.name:
        raise ApiError(
            404, f"the model {name!r} does not exist; this server has {served.name!r}", "model", code="model_not_found"
        )


def check_chars(served: Served, chars: int, param: str) -> None:
    """A text of more characters than the context could hold even at the longest token is refused
    before it is tokenised."""
    limit = served.context * served.tokenizer.max_token_chars
    if chars > limit:
        raise ApiError(
            400,
            f"{param} has {chars} characters, more than the context of {served.context} tokens can hold",
            param,
            code="context_length_exceeded",
        )


async def tokenize(served: Served, fn, *args, param: str, **kwargs):
    """Run a tokenizer or image call on a worker thread (a few at a time); its ValueErrors are 400s naming
    `param`."""
    async with served.tokenizing:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ValueError as e:
            raise ApiError(400, str(e), param) from e


async def checked(served: Served, task: Task, http, names: dict[str, str]) -> Task:
    """`task.check` against the served model and context, as the task says it runs: a schema's compile on a
    worker thread, one compile at a time (a compile holds the GIL that the engine's step loop needs between
    its passes) and not at all for a client that left while it waited (a repeated schema is a cache hit:
    dgemma.structured.plans); options' tokenizing on the tokenizer's threads; the rest inline. What is
    wrong is a 400 naming the request's field (`names` maps the task's fields to the route's)."""
    try:
        if task.work == "compile":
            async with served.compiling:
                if http is not None and await http.is_disconnected():
                    raise ApiError(499, "the client closed the request")
                return await asyncio.to_thread(task.check, served.model, served.context)
        if task.work == "tokenize":
            async with served.tokenizing:
                return await asyncio.to_thread(task.check, served.model, served.context)
        return task.check(served.model, served.context)
    except RequestError as e:
        named = e.named(names)
        hint = " (dgemma serve --max-context)" if named.code == CONTEXT else ""
        raise ApiError(400, named.message + hint, named.param, code=named.code) from None


class _Sink:
    """Lets the engine thread hand events to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def submit(
    served: Served,
    tasks: list[Task],
    n: int,
    *,
    stops: list[str] | None = None,
    reasoning: bool = False,
    want_drafts: bool = False,
    cache_prompt: bool = True,
) -> list[Choice]:
    """One engine request per checked task (one per prompt) and choice: choice i of task j has index
    j * n + i and the task's seed + i; `cache_prompt` False keeps them out of the prefix cache."""
    if len(tasks) * n > served.engine.capacity:
        message = f"{len(tasks) * n} choices exceed what this server holds at once ({served.engine.capacity})"
        raise ApiError(400, message, "n")
    loop = asyncio.get_running_loop()
    choices: list[Choice] = []
    runner = served.engine.runner
    for j, task in enumerate(tasks):
        for i in range(n):
            program = _seeded(task, i).program(served.model, runner.canvas_stats)
            req = EngineRequest(program, want_drafts, served.request_timeout, reuse=cache_prompt)
            try:
                _enqueue(served.engine, req, loop)
            except ApiError:
                for c in choices:
                    c.request.cancel()
                raise
            choices.append(Choice(j * n + i, req, StreamText(stops, reasoning)))
    return choices


def _seeded(task: Task, i: int) -> Task:
    """Choice i of a task: its seed + i (a task without a seed, or without settings, as it is)."""
    params = getattr(task, "params", None)
    if i == 0 or params is None or params.seed is None:
        return task
    return dataclasses.replace(task, params=dataclasses.replace(params, seed=(params.seed + i) % 2**63))


def _enqueue(engine: Engine, request: EngineRequest, loop: asyncio.AbstractEventLoop) -> None:
    """Queue one request whose events go to an asyncio queue; a full queue is a 429, draining a 503."""
    request.events = _Sink(loop)
    try:
        engine.submit(request)
    except ShuttingDown as e:
        raise as_api_error(e) from e
    except QueueFull as e:
        raise ApiError(429, str(e), kind="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from e


async def outcome(engine: Engine, program: Program, timeout: float | None = None):
    """Run one program that streams nothing (a prompt's logprobs, a canvas's scores) and return its
    result; what the engine reported as the HTTP error, cancelled if this is."""
    request = EngineRequest(program, timeout=timeout)
    _enqueue(engine, request, asyncio.get_running_loop())
    try:
        while True:
            event = await request.events.queue.get()
            if isinstance(event, Exception):
                raise as_api_error(event)
            if isinstance(event, DoneEvent):
                return event.result
    finally:
        request.cancel()


# ------------------------------------------------------------------------------------------------
# /v1/chat/completions


def chat_task(
    body: ChatCompletionRequest,
    prompt: list[int],
    pixels,
    tools: list | None,
    tokenizer,
    prediction: list[int] | None = None,
) -> Task:
    """The task a chat body asks for (its prompt and `prediction` tokenized, `tools` when they are used)."""
    requested, _ = body.requested_tokens
    params = body.sampling(requested)
    retries = {} if body.retries is None else {"retries": body.retries}
    json_format = body.response_format is not None and body.response_format.type != "text"
    if body.choices is not None:
        return Choose(prompt, list(body.choices), tokenizer, max_tokens=requested, pixels=pixels)
    if body.forced_call:
        named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        return Call(prompt, tools, tokenizer, named, params, pixels=pixels, **retries)
    if tools and not (json_format or body.reasoning or body.stop or body.logprobs):  # "auto" by the model's scores
        return Auto(prompt, tools, tokenizer, None, params, pixels=pixels, **retries)
    if json_format:
        return _json_task(body, prompt, params, tokenizer, pixels)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return Generate([prompt], params, logprobs=logprobs, pixels=pixels, prediction=prediction)


def _json_task(body, prompt: list[int], params, tokenizer, pixels=None) -> Json:
    fmt = body.response_format
    schema = None if fmt.type == "json_object" else fmt.json_schema.schema_
    retries = {} if body.retries is None else {"retries": body.retries}
    return Json(prompt, schema, tokenizer, params, pixels=pixels, **retries)


async def prediction_ids(served: Served, body) -> list[int] | None:
    """A body's `prediction` as token ids (its text tokenized without special tokens), or None."""
    if body.prediction is None:
        return None
    content = body.prediction.content
    text = content if isinstance(content, str) else "".join(part.text for part in content)
    check_chars(served, len(text), "prediction")
    return await tokenize(served, served.tokenizer.encode, text, param="prediction", add_special_tokens=False)


def check_body(served: Served, body) -> None:
    """What every route checks first: the model asked for, and the fields that do not go together."""
    check_model(served, body.model)
    conflict = body.conflict()
    if conflict is not None:
        raise ApiError(400, conflict[1], conflict[0])


@dataclass
class Started:
    """A request on the engine: its choices, their pieces as they come (tool calls read out when tools are
    offered: answers.with_calls), the prompt tokens its usage counts, and its prompts and checked tasks."""

    choices: list[Choice]
    pieces: AsyncIterator[Piece]
    prompt_tokens: int
    prompts: list[list[int]]
    tasks: list[Task]


async def start_chat(served: Served, body: ChatCompletionRequest, http: Request) -> Started:
    """A chat body checked, tokenized, mapped to its task, checked again by the task and submitted: every
    chat-like dialect (Chat Completions, Responses, Messages, Ollama's chat) starts here."""
    prompt, pixels, tools = await conversation(served, body)
    tok = served.tokenizer
    names = {"prompt": "messages", "max_tokens": body.requested_tokens[1], "schema": SCHEMA, "options": "choices"}
    predicted = await prediction_ids(served, body)
    task = await checked(served, chat_task(body, prompt, pixels, tools, tok, predicted), http, names)
    want_drafts = body.include_drafts and body.stream
    choices = submit(
        served, [task], body.n, stops=body.stop, reasoning=body.reasoning, want_drafts=want_drafts,
        cache_prompt=body.cache_prompt,
    )  # fmt: skip
    pieces = run(choices, tok, http.is_disconnected)
    pieces = answers.with_calls(pieces, answers.call_limit(body)) if tools else pieces
    return Started(choices, pieces, len(prompt), [prompt], [task])


async def conversation(served: Served, body: ChatCompletionRequest) -> tuple[list[int], object, list | None]:
    """A chat body's prompt: its fields checked together, its messages (images decoded) and tools written by
    the chat template and tokenized. Returns the prompt, its images' pixels and the tools offered."""
    check_body(served, body)
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
    if any(m.image_urls() for m in body.messages):
        messages = await media.decode_image_parts(served.model, body, messages)
    budget = body.max_soft_tokens or DEFAULT_BUDGET
    prompt, pixels = await tokenize(
        served, chat_prompt, tok, served.model.config, messages, budget, param="messages",
        enable_thinking=True if body.reasoning else None, tools=tools,
    )  # fmt: skip
    return prompt, pixels, tools


async def _chat(served: Served, body: ChatCompletionRequest, http: Request):
    started = await start_chat(served, body, http)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = answers.Chunks(served, chat=True)
        opening = [answers.sse({**chunks.head, "choices": [answers.role_delta(c.index)]}) for c in started.choices]
        stream = answers.event_stream(chunks, started.pieces, started.choices, opening, started.prompt_tokens, usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    return await answers.chat_answer(served, body, started)


# ------------------------------------------------------------------------------------------------
# /v1/completions


async def completion_prompts(served: Served, body: CompletionRequest) -> list[list[int]]:
    """Token ids of every prompt (an empty text becomes the BOS token; ids are checked by the task)."""
    check_chars(served, sum(len(p) for p in body.prompt if isinstance(p, str)), "prompt")
    out = []
    for p in body.prompt:
        if isinstance(p, list):
            out.append(list(p))
        elif p:
            out.append(await tokenize(served, served.tokenizer.encode, p, param="prompt"))
        else:
            out.append([served.model.text_config.bos_token_id or 2])
    return out


async def completion_tasks(served: Served, body: CompletionRequest, prompts: list[list[int]]) -> list[Task]:
    """The task of each prompt of a completions body."""
    params = body.sampling(body.max_tokens)
    tok = served.tokenizer
    if body.choices is not None:
        return [Choose(p, list(body.choices), tok, max_tokens=body.max_tokens) for p in prompts]
    if body.response_format is not None and body.response_format.type != "text":
        return [_json_task(body, p, params, tok) for p in prompts]
    if body.suffix is not None:  # one prompt (the request model says so)
        check_chars(served, len(body.suffix), "suffix")
        suffix = await tokenize(served, tok.encode, body.suffix, param="suffix", add_special_tokens=False)
        length = "auto" if body.max_tokens is None else body.max_tokens  # the middle's: not a generation's
        return [Infill(prompts[0], suffix, length, body.sampling(None), logprobs=body.logprobs)]
    predicted = await prediction_ids(served, body)
    return [Generate([p], params, logprobs=body.logprobs, prediction=predicted) for p in prompts]


async def completion_checked(served: Served, body: CompletionRequest, http: Request | None):
    """A completions body's prompts (tokenized) and its tasks, checked: all that comes before a pass."""
    check_body(served, body)
    prompts = await completion_prompts(served, body)
    names = {"schema": SCHEMA, "options": "choices", "middle_length": "max_tokens", "prefix": "prompt"}
    return prompts, [await checked(served, t, http, names) for t in await completion_tasks(served, body, prompts)]


async def start_completion(served: Served, body: CompletionRequest, http: Request) -> Started:
    """A completions body checked, tokenized, mapped to one task per prompt, checked by the tasks and
    submitted: /v1/completions, Ollama's generate and llama.cpp's /infill and /completion start here."""
    prompts, tasks = await completion_checked(served, body, http)
    want_drafts = body.include_drafts and body.stream
    choices = submit(served, tasks, body.n, stops=body.stop, want_drafts=want_drafts, cache_prompt=body.cache_prompt)
    pieces = run(choices, served.tokenizer, http.is_disconnected)
    return Started(choices, pieces, sum(len(p) for p in prompts) * body.n, prompts, tasks)


async def _completions(served: Served, body: CompletionRequest, http: Request):
    started = await start_completion(served, body, http)
    prompts, tasks = started.prompts, started.tasks
    plan = tasks[0].plan if isinstance(tasks[0], Infill) else None
    scored = None
    if body.echo and body.logprobs is not None:  # the prompts' own, by the encoder
        scored = [await outcome(served.engine, Score(p, None, body.logprobs).program(served.model)) for p in prompts]
    return await answers.completion_reply(served, body, started.choices, started.pieces, prompts, plan, scored)


# ------------------------------------------------------------------------------------------------
# /v1/canvas/score


async def _canvas_score(served: Served, body: CanvasScoreRequest) -> dict:
    """A read-only denoising pass over a given canvas: each canvas token's log-probability under the
    denoiser, and the top alternatives (a dgemma extension; vLLM's "read-only" read)."""
    check_model(served, body.model)
    ids = {}
    for name in ("prompt", "canvas"):
        value = getattr(body, name)
        if isinstance(value, str):
            check_chars(served, len(value), name)
            value = await tokenize(served, served.tokenizer.encode, value, param=name, add_special_tokens=False)
        ids[name] = value
    task = await checked(served, Score(ids["prompt"], ids["canvas"], body.top_logprobs), None, {})
    chosen, tops = await outcome(served.engine, task.program(served.model), served.request_timeout)
    block = logprob_blocks.legacy(served.tokenizer, ids["canvas"], chosen, tops)
    return {
        "object": "canvas.score",
        "model": served.name,
        "token_ids": ids["canvas"],
        **block,
        "usage": {"prompt_tokens": len(ids["prompt"]), "canvas_tokens": len(ids["canvas"])},
    }
