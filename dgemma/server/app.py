"""The HTTP server: OpenAI-compatible routes over the batching engine, SSE streaming, metrics, playground.

GET  /                      the playground (static page)
GET  /health                liveness
GET  /metrics               Prometheus text
GET  /v1/models             the served model
POST /v1/chat/completions   chat (messages), streaming or not; diffusion settings as extra fields
POST /v1/completions        text completion (one prompt or several); with `suffix`, infilling

A request crosses one path: the guard (host, key, body bounds; guard.py), the request model (types and
ranges; protocol.py), then here: the prompt is bounded in characters before it is tokenised (on a worker
thread, not the event loop), checked against the context, its sampling settings resolved against the
checkpoint's defaults (a 400 before anything is queued or streamed), and its choices submitted to the
engine (choices.py), whose pieces are sent as SSE chunks or gathered into one JSON answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

try:
    import fastapi_offline  # Swagger UI's files, for an offline /docs
except ImportError:  # pragma: no cover - a dependency of dgemma[serve]
    fastapi_offline = None

from ..editing import InfillPlan, canvas_logprobs, choose_middle, plan_infill
from ..engine import Engine
from ..images import DEFAULT_BUDGET, chat_prompt
from ..model import DiffusionGemma
from ..runtime.runner import as_runner
from ..settings import SETTINGS, SamplingParams
from ..structured import json_text
from ..tool_calls import CALL_OPEN, call_text
from . import choices as runs
from . import logprobs as logprob_blocks
from . import media
from .guard import Guard
from .limits import Limits
from .metrics import CONTENT_TYPE, Metrics
from .output import extract_tool_calls, new_id
from .protocol import ApiError, CanvasScoreRequest, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .structured import call_plan, chosen_answers, given_answers, json_finish, json_plan, sized_plans

STATIC = Path(__file__).parent / "static"
TOKENIZE_AT_ONCE = 2  # prompts tokenised at the same time (each on a worker thread)
DEFAULT_MAX_CONTEXT = 32768  # positions per request unless --max-context says otherwise (each has its own cache)


@dataclass
class _Served:
    """What the routes share: the model, its tokenizer and engine, and the server's settings."""

    model: DiffusionGemma  # the reference modules (configs); passes run through engine.runner
    tokenizer: object
    engine: Engine
    name: str
    request_timeout: float
    tokenizing: asyncio.Semaphore
    context: int  # the most positions one request may use (prompt + generated): its KV cache's size

    @property
    def canvas(self) -> int:
        return self.model.config.canvas_length

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def create_app(
    model,
    tokenizer,
    *,
    model_name: str = "dgemma",
    api_key: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    request_timeout: float = 600.0,
    limits: Limits | None = None,
    check_host: bool = False,
    max_context: int | None = None,
) -> FastAPI:
    """A FastAPI app serving `model`, a DiffusionGemma or a Runner of one (`dgemma.accelerate(model)`:
    fast requests on the fast modules); its engine thread starts now and stops with the app.

    `check_host` answers only requests addressed to localhost (set it when serving on loopback without
    a key); `limits` bounds the body (see guard.Limits); `max_context` bounds the positions (prompt and
    generated tokens) of one request, and so its KV cache (default: the model's context, at most 32768)."""
    runner = as_runner(model)
    model_context = runner.model.text_config.max_position_embeddings
    context = min(model_context, DEFAULT_MAX_CONTEXT) if max_context is None else max_context
    if not 0 < context <= model_context:
        raise ValueError(f"max_context must be in [1, {model_context}] (the model's context); got {context}")
    limits = limits or Limits()
    engine = Engine(runner, max_batch=max_batch, max_queue=max_queue, max_queued_tokens=limits.max_queued_tokens)
    semaphore = asyncio.Semaphore(TOKENIZE_AT_ONCE)
    served = _Served(runner.model, tokenizer, engine, model_name, request_timeout, semaphore, context)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="dgemma", version="1", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine = engine
    metrics = Metrics(engine)
    paths = frozenset()

    def routes() -> frozenset:
        nonlocal paths
        if not paths:
            paths = frozenset(getattr(r, "path", "") for r in app.routes)
        return paths

    app.add_middleware(Guard, api_key=api_key, limits=limits, check_host=check_host, routes=routes, count=metrics.count)
    _add_error_handlers(app)
    _add_info_routes(app, served, metrics)
    _add_generation_routes(app, served)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError):
        return _error_response(_validation_message(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        messages = {
            404: f"there is no route {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
            400: "the request body could not be parsed: it must be a JSON object",
        }
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = messages.get(exc.status_code, str(exc.detail))
        headers = dict(exc.headers or {})  # a 405's Allow
        return _error_response(ApiError(exc.status_code, message, kind=kind, headers=headers))


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_message(errors: list) -> ApiError:
    """The first validation error as a 400 naming its field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON")
    # field names and list indices; not "body", nor pydantic's names of union members ("function-after[...]")
    loc = [str(x) for x in first.get("loc", []) if x != "body" and (isinstance(x, int) or str(x).isidentifier())]
    param = ".".join(loc) or (first.get("ctx") or {}).get("name")  # a whole-request check names its field
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = "this server does not know this field (see docs/server.md for the fields it takes)"
    if first.get("type") == "model_attributes_type":
        message = "the request body must be a JSON object"
    if param and message.startswith(f"{param}: "):
        return ApiError(400, message, param)
    return ApiError(400, f"{param}: {message}" if param else message, param)


def _add_info_routes(app: FastAPI, served: _Served, metrics: Metrics) -> None:
    get = functools.partial(_get_and_head, app)

    @get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse((STATIC / "playground.html").read_text())

    @get("/health")
    async def health():
        e = served.engine
        return {"status": "ok", "model": served.name, "active": e.active, "queued": e.queue_depth}

    @get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    card = {"id": served.name, "object": "model", "created": 0, "owned_by": "dgemma"}

    @get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(served, model_id)
        return card

    _add_docs(app, get)


def _get_and_head(app: FastAPI, path: str, **options):
    """A GET route that answers HEAD too (load balancers probe with HEAD; the schema lists GET only)."""

    def register(fn):
        app.add_api_route(path, fn, methods=["GET"], **options)
        options["include_in_schema"] = False
        app.add_api_route(path, fn, methods=["HEAD"], **options)
        return fn

    return register


def _add_docs(app: FastAPI, get) -> None:
    """/docs: Swagger UI from files installed with the server (fastapi-offline's copy), not a CDN, so that
    it works offline; without that package it is a 404 that says what to install."""
    if fastapi_offline is None:

        @get("/docs", include_in_schema=False)
        async def no_docs():
            raise ApiError(404, "/docs needs fastapi-offline: pip install 'dgemma[serve]'", kind="not_found_error")

        return
    files = Path(fastapi_offline.__file__).parent / "static"
    assets = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png"}

    @get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="dgemma API",
            swagger_js_url="/docs/swagger-ui-bundle.js",
            swagger_css_url="/docs/swagger-ui.css",
            swagger_favicon_url="/docs/favicon.png",
        )

    @get("/docs/{name}", include_in_schema=False)
    async def docs_asset(name: str):
        if name not in assets:
            raise ApiError(404, f"there is no route /docs/{name}", kind="not_found_error")
        return Response((files / name).read_bytes(), media_type=assets[name])


# ------------------------------------------------------------------------------------------------
# Shared steps of the generation routes


def _check_model(served: _Served, name: str | None) -> None:
    if name is not None and name != served.name:
        raise ApiError(
            404, f"the model {name!r} does not exist; this server has {served.name!r}", "model", code="model_not_found"
        )


async def _tokenize(served: _Served, fn, *args, param: str, **kwargs):
    """Run a tokenizer or image call on a worker thread (a few at a time); its ValueErrors are 400s naming
    `param`."""
    async with served.tokenizing:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ValueError as e:
            raise ApiError(400, str(e), param) from e


def _check_chars(served: _Served, chars: int, param: str) -> None:
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


def _budget(served: _Served, requested: int | None, prompt_len: int, param: str, prompt_param: str) -> int:
    """The tokens to generate: as requested (or the checkpoint's default), within the context."""
    c = served.canvas
    room = (served.context - prompt_len) // c * c  # the engine generates whole canvases
    if room <= 0:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens, which leaves no room for a canvas of {c} in the "
            f"context of {served.context} (dgemma serve --max-context)",
            prompt_param,
            code="context_length_exceeded",
        )
    max_tokens = requested or min(served.model.generation_config.max_new_tokens, room)
    if max_tokens > room:
        raise ApiError(
            400,
            f"{param} is too large: with a prompt of {prompt_len} tokens, at most {room} tokens fit in the "
            f"context of {served.context} (whole canvases of {c}; dgemma serve --max-context)",
            param,
            code="context_length_exceeded",
        )
    return max_tokens


def _resolve(served: _Served, params: SamplingParams) -> SamplingParams:
    """The settings with the checkpoint's defaults filled in; a 400 naming the field if they are invalid."""
    try:
        return params.resolve(served.model.generation_config, served.model.text_config.eos_token_ids)
    except ValueError as e:
        message = str(e)  # the first setting the message names (the longest, where one name starts another)
        named = sorted((message.find(name), -len(name), name) for name in SETTINGS if name in message)
        raise ApiError(400, message, named[0][2] if named else None) from e


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _role_delta(index: int) -> dict:
    """A chat stream's first chunk of each choice: the assistant's role."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# ------------------------------------------------------------------------------------------------
# Routes


def _add_generation_routes(app: FastAPI, served: _Served) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        return await _chat(served, body, http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await _completions(served, body, http)

    @app.post("/v1/canvas/score")
    async def canvas_score(body: CanvasScoreRequest):
        return await _canvas_score(served, body)


async def _canvas_score(served: _Served, body: CanvasScoreRequest) -> dict:
    """A read-only denoising pass over a given canvas: each canvas token's log-probability under the
    denoiser, and the top alternatives (a dgemma extension; vLLM's "read-only" read)."""
    _check_model(served, body.model)
    ids = {}
    vocab = served.model.text_config.vocab_size
    for name in ("prompt", "canvas"):
        value = getattr(body, name)
        if isinstance(value, str):
            _check_chars(served, len(value), name)
            value = await _tokenize(served, served.tokenizer.encode, value, param=name, add_special_tokens=False)
        bad = [t for t in value if not 0 <= t < vocab]
        if not value:
            raise ApiError(400, f"{name} has no tokens", name)
        if bad:
            raise ApiError(400, f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", name)
        ids[name] = value
    _budget(served, None, len(ids["prompt"]), "canvas", "prompt")
    k = body.top_logprobs
    future = served.engine.call(lambda runner: canvas_logprobs(runner, ids["prompt"], ids["canvas"], k))
    try:
        chosen, tops = await asyncio.wrap_future(future)
    except ValueError as e:
        raise ApiError(400, str(e), "canvas") from e
    block = logprob_blocks.legacy(served.tokenizer, ids["canvas"], chosen, tops)
    return {
        "object": "canvas.score",
        "model": served.name,
        "token_ids": ids["canvas"],
        **block,
        "usage": {"prompt_tokens": len(ids["prompt"]), "canvas_tokens": len(ids["canvas"])},
    }


async def _chat(served: _Served, body: ChatCompletionRequest, http: Request):
    _check_model(served, body.model)
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
    _check_chars(served, chars + len(json.dumps(tools or [])), "messages")
    thinking = True if body.reasoning else None
    messages = await media.decode_image_parts(served.model, body, messages)
    budget = body.max_soft_tokens or DEFAULT_BUDGET
    prompt, pixels = await _tokenize(
        served,
        chat_prompt,
        tok,
        served.model.config,
        messages,
        budget,
        param="messages",
        enable_thinking=thinking,
        tools=tools,
    )
    requested, param = body.requested_tokens
    if body.choices is not None:
        if pixels is not None:
            raise ApiError(400, "choices: options are scored on text prompts (leave out the images)", "choices")
        choices, pieces = await _chosen(served, body, [prompt], requested, param)
    elif body.forced_call:
        choices, pieces = await _call_run(served, body, http, prompt, pixels, tools)
    else:
        choices, pieces = await _chat_run(served, body, http, prompt, pixels)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = _Chunks(served, chat=True)
        opening = [_sse({**chunks.head, "choices": [_role_delta(c.index)]}) for c in choices]
        stream = _stream(chunks, pieces, choices, opening, len(prompt), usage, calls=use_tools)
        return StreamingResponse(stream, media_type="text/event-stream")
    return await _chat_answer(served, body, pieces, choices, len(prompt), use_tools)


@dataclass
class _JsonRequest:
    """What a JSON response_format adds to a request: the template's pins, its allowed tokens, the
    settings (the template's length; no stop tokens, no early commit) and the finish that reads it."""

    pins: object  # per prompt: torch.Tensor [1, length]
    allowed: object  # per prompt: constraints.Allowed (or None)
    params: SamplingParams
    finish: object


async def _json_request(
    served: _Served, body, prompts: list[list[int]], requested, param: str, prompt_param: str, pixels=None
):
    """The JSON plan of a request with a json_object / json_schema response_format, or None."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if getattr(body, "tools", None) and getattr(body, "tool_choice", None) != "none":
        raise ApiError(400, "response_format: a JSON answer does not go with tools (use tool_choice 'none')", "tools")
    if getattr(body, "reasoning", False) or getattr(body, "suffix", None) is not None:
        other = "reasoning" if getattr(body, "reasoning", False) else "suffix"
        raise ApiError(400, f"{other}: does not go with a JSON response_format (the answer is the JSON)", other)
    longest = max(len(p) for p in prompts)

    def length() -> int:
        return _budget(served, requested, longest, param, prompt_param)

    plan = await _tokenize(served, json_plan, fmt, served.tokenizer, served.model, length, param="response_format")
    return await _shaped(served, body, plan, prompts, (requested, param, prompt_param), pixels=pixels)


async def _shaped(
    served: _Served, body, plan, prompts: list[list[int]], asked: tuple, write=json_text, pixels=None
) -> _JsonRequest:
    """A plan's request: each prompt's template (sized by a free draft, server/structured.py) within the
    length asked for and the context (`asked`: the tokens requested, their field, the prompt's field), no
    stop tokens, no early commit, and the finish that reads each answer back and writes it (JSON text,
    or a tool call)."""
    requested, param, prompt_param = asked
    longest = max(len(p) for p in prompts)
    n = len(plan.template)
    if requested is not None and requested < n:
        raise ApiError(400, f"{param} is {requested}, but the answer's template takes {n} tokens", param)
    _budget(served, n, longest, param, prompt_param)
    runs.check_capacity(served.engine, len(prompts) * body.n)  # before any draft runs
    draft = _resolve(served, body.sampling(n))
    given = dict(pixels=pixels, timeout=served.request_timeout)
    plans = await sized_plans(served.engine, plan, prompts, draft, served.tokenizer, **given)
    n = max(len(p.template) for p in plans)
    _budget(served, n, longest, param, prompt_param)
    params = replace(body.sampling(n), stop_token_ids=[], early_commit=False)
    finish = json_finish(served.engine, plans, prompts, body.n, served.tokenizer, write)
    return _JsonRequest([p.pins(n) for p in plans], [p.constraints(n) for p in plans], params, finish)


async def _chat_run(
    served: _Served, body: ChatCompletionRequest, http: Request, prompt: list[int], pixels, shaped=None
):
    """The chat request's choices on the engine, and the pieces they give (`shaped`: a required call's
    request; otherwise the response_format's, if any)."""
    requested, param = body.requested_tokens
    if shaped is None:
        shaped = await _json_request(served, body, [prompt], requested, param, "messages", pixels)
    if shaped is None:
        params = _resolve(served, body.sampling(_budget(served, requested, len(prompt), param, "messages")))
    else:
        params = _resolve(served, shaped.params)
    choices = runs.submit(
        served.engine,
        [prompt],
        params,
        body.n,
        stops=body.stop,
        reasoning=body.reasoning,
        pins=None if shaped is None else shaped.pins,
        allowed=None if shaped is None else shaped.allowed,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        pixels=pixels,
        want_drafts=body.include_drafts and body.stream,
        timeout=served.request_timeout,
    )
    finish = None if shaped is None else shaped.finish
    return choices, runs.run(choices, served.decode, http.is_disconnected, finish=finish)


async def _call_run(
    served: _Served, body: ChatCompletionRequest, http: Request, prompt: list[int], pixels, tools: list[dict]
):
    """tool_choice "required" or a named function: each choice is a call of the function, its arguments
    filled under the function's parameters schema (server/structured.py), read back and validated."""
    for name in ("reasoning", "logprobs", "stop"):
        if getattr(body, name):
            raise ApiError(400, f"{name}: does not go with a required tool call (the answer is the call)", name)
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(400, "response_format: a required tool call is the answer's format", "response_format")
    named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    if named is None and len(body.tools) > 1 and pixels is not None:
        raise ApiError(400, "tool_choice: with images, name the function to call", "tool_choice")
    name, plan = await call_plan(served.engine, served.tokenizer, served.model, prompt, tools, named)
    if plan.fixed:  # a function without arguments: nothing to generate
        return given_answers(served.tokenizer, [call_text(name, {})] * body.n)
    requested, param = body.requested_tokens
    write = functools.partial(call_text, name)
    shaped = await _shaped(served, body, plan, [prompt], (requested, param, "messages"), write, pixels)
    return await _chat_run(served, body, http, prompt, pixels, shaped)


async def _chosen(served: _Served, body, prompts: list[list[int]], requested: int | None, param: str):
    """`choices`: each prompt's best-scored option (server/structured.py), within the context and the
    length asked for."""
    tok = served.tokenizer
    _check_chars(served, sum(len(o) for o in body.choices), "choices")
    options = await _tokenize(served, _encode_all, tok, body.choices, param="choices")
    lengths = [len(ids) for ids in options]
    if requested is not None and max(lengths) > requested:
        raise ApiError(400, f"{param} is {requested}, but an option has {max(lengths)} tokens", param)
    longest = max(len(p) for p in prompts)
    if longest + max(lengths) + 1 > served.context:
        raise ApiError(400, f"the prompt and the longest option exceed the context of {served.context}", "choices")
    return await chosen_answers(served.engine, tok, prompts, body.choices, options)


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


async def _gather(pieces) -> tuple[dict[int, dict[str, str]], dict[int, str]]:
    """Non-streaming: the text of every choice by kind, and each one's finish reason (errors raise)."""
    texts: dict[int, dict[str, str]] = {}
    reasons: dict[int, str] = {}
    async for piece in pieces:
        if piece.kind == "end":
            if piece.error is not None:
                raise piece.error
            reasons[piece.index] = piece.finish_reason
        elif piece.kind in ("content", "reasoning"):
            parts = texts.setdefault(piece.index, {})
            parts[piece.kind] = parts.get(piece.kind, "") + piece.text
    return texts, reasons


async def _chat_answer(served, body: ChatCompletionRequest, pieces, choices, prompt_len: int, use_tools: bool):
    texts, reasons = await _gather(pieces)
    if len(reasons) < len(choices):
        raise ApiError(499, "the client closed the request")
    out = []
    for c in choices:
        parts = texts.get(c.index, {})
        message = {"role": "assistant", "content": parts.get("content", "")}
        reason = reasons[c.index]
        if body.reasoning and "reasoning" in parts:
            message["reasoning_content"] = parts["reasoning"]
        if use_tools:
            calls, message["content"] = extract_tool_calls(message["content"])
            if calls:
                message["tool_calls"] = calls if body.parallel_tool_calls is not False else calls[:1]
                reason = "tool_calls"
        entry = {"index": c.index, "message": message, "finish_reason": reason}
        if body.logprobs:
            n = c.returned_tokens
            lps, tops = c.logprobs or ([], [])
            k = body.top_logprobs or 0
            entry["logprobs"] = logprob_blocks.chat(served.tokenizer, c.tokens[:n], lps[:n], tops[:n], k)
        out.append(entry)
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": out,
        "usage": _usage(prompt_len, sum(c.returned_tokens for c in choices)),
        "dgemma": {
            "steps_per_canvas": [c.steps_per_canvas for c in choices],
            "tokens_per_forward": [c.tokens_per_forward for c in choices],
            **({"choices": [c.details for c in choices]} if any(c.details for c in choices) else {}),
        },
    }


class _Chunks:
    """The SSE chunks of one streamed answer: chat deltas (`delta`) or completion text (`text`)."""

    def __init__(self, served: _Served, chat: bool):
        self.chat = chat
        self.head = {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": served.name,
        }

    def choice(self, index: int, kind: str | None = None, text: str = "", reason=None, **extra) -> str:
        """One choice's chunk: `text` of `kind` ("content", "reasoning"; None: nothing), or its end."""
        if self.chat:
            field = "reasoning_content" if kind == "reasoning" else "content"
            body = {"delta": {field: text} if kind else {}}
        else:
            body = {"text": text, "logprobs": None}
        return _sse({**self.head, "choices": [{"index": index, **body, "finish_reason": reason}], **extra})

    def usage(self, prompt_tokens: int, choices) -> str:
        return _sse(
            {**self.head, "choices": [], "usage": _usage(prompt_tokens, sum(c.returned_tokens for c in choices))}
        )


async def _stream(
    chunks: _Chunks, pieces, choices, opening: list[str], prompt_tokens: int, usage: bool, calls: bool = False
):
    """The SSE body of a streamed answer, chat or completion alike: `opening` chunks, then each piece as it
    comes (drafts, text, ends with the choice's `dgemma` details if any, errors), the usage if asked for,
    and [DONE]. With `calls` (tools offered), a choice's text from a tool call's start on is held and
    sent at its end as `tool_calls` deltas (or as text, if it does not parse)."""
    by_index = {c.index: c for c in choices}
    held: dict[int, str] = {}
    for text in opening:
        yield text
    async for piece in pieces:
        if piece.kind == "draft":
            yield chunks.choice(piece.index, dgemma_draft=piece.draft)
        elif piece.kind == "end" and piece.error is not None:
            yield _sse(piece.error.body())
            yield chunks.choice(piece.index, reason="error")
        elif piece.kind == "end":
            reason = piece.finish_reason
            if piece.index in held:
                found, rest = extract_tool_calls(held.pop(piece.index))
                if rest:
                    yield chunks.choice(piece.index, "content", rest)
                if found:
                    deltas = [{"index": k, **call} for k, call in enumerate(found)]
                    yield _sse({**chunks.head, "choices": [{"index": piece.index, "delta": {"tool_calls": deltas}}]})
                    reason = "tool_calls"
            details = by_index[piece.index].details  # set when the choice finished
            yield chunks.choice(piece.index, reason=reason, **({"dgemma": details} if details else {}))
        elif calls and piece.kind == "content" and (piece.index in held or CALL_OPEN in piece.text):
            before, mark, after = ("", "", piece.text) if piece.index in held else piece.text.partition(CALL_OPEN)
            if before:
                yield chunks.choice(piece.index, "content", before)
            held[piece.index] = held.get(piece.index, "") + mark + after
        else:
            yield chunks.choice(piece.index, piece.kind, piece.text)
    if usage:
        yield chunks.usage(prompt_tokens, choices)
    yield _sse("[DONE]")


# ------------------------------------------------------------------------------------------------
# /v1/completions


async def _completion_prompts(served: _Served, body: CompletionRequest) -> list[list[int]]:
    """Token ids of every prompt (an empty text becomes the BOS token)."""
    vocab = served.model.text_config.vocab_size
    _check_chars(served, sum(len(p) for p in body.prompt if isinstance(p, str)), "prompt")
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
            out.append(await _tokenize(served, served.tokenizer.encode, p, param="prompt"))
        else:
            out.append([served.model.text_config.bos_token_id or 2])
    return out


async def _infill_plan(served: _Served, body: CompletionRequest, prompt: list[int]) -> InfillPlan:
    """For `suffix`: the infill laid out by dgemma.editing. With max_tokens the middle has that length;
    without, its length is chosen as `dgemma.infill(middle_length="auto")` chooses it. Either way the middle
    is clamped so that it still sees the suffix: the canvas keeps room for the suffix and its end, up to
    half the canvas (the answer's `dgemma` block says the length used). A middle that needs fewer tokens
    ends at its first end-of-text token."""
    _check_chars(served, len(body.suffix), "suffix")
    suffix = await _tokenize(served, served.tokenizer.encode, body.suffix, param="suffix", add_special_tokens=False)
    canvas = served.canvas
    longest = canvas - min(len(suffix) + 1, canvas // 2)  # >= 1, and below the canvas (max_middle_length)
    length = "auto" if body.max_tokens is None else min(body.max_tokens, longest)
    try:
        plan = plan_infill(served.model, prompt, suffix, length, longest=longest)
    except ValueError as e:
        raise ApiError(400, str(e), "suffix") from e
    _budget(served, len(plan.templates[0]), len(plan.prompt), "max_tokens", "prompt")
    return plan


def _choose_middle(served: _Served, plan: InfillPlan):
    """A choice's finish (server/choices.py) for an infill: the middle chosen on the engine thread, as
    dgemma.infill chooses it (scoring several lengths takes model passes)."""

    async def finish(choice, result) -> tuple[list[int], int]:
        chosen = await asyncio.wrap_future(served.engine.call(lambda runner: choose_middle(runner, plan, result)))
        choice.details = {"middle_length": chosen.middle_length}
        if chosen.scores:
            choice.details["middle_scores"] = {str(n): round(s, 4) for n, s in chosen.scores.items()}
        return chosen.middle, chosen.row

    return finish


async def _completions(served: _Served, body: CompletionRequest, http: Request):
    _check_model(served, body.model)
    prompts = await _completion_prompts(served, body)
    if body.choices is not None:
        choices, pieces = await _chosen(served, body, prompts, body.max_tokens, "max_tokens")
        return await _completion_reply(served, body, choices, pieces, prompts, None)
    rows, pins, allowed, finish, plan = prompts, None, None, None, None
    shaped = await _json_request(served, body, prompts, body.max_tokens, "max_tokens", "prompt")
    if shaped is not None:
        pins, allowed, finish, params = shaped.pins, shaped.allowed, shaped.finish, shaped.params
    elif body.suffix is not None:  # one prompt (the request model says so); its rows are the plan's
        plan = await _infill_plan(served, body, prompts[0])
        rows, pins, finish = [plan.prompts], plan.pins(), _choose_middle(served, plan)
        params = replace(body.sampling(pins.shape[1]), stop_token_ids=[], early_commit=False)
    else:
        params = body.sampling(_budget(served, body.max_tokens, max(len(p) for p in prompts), "max_tokens", "prompt"))
    params = _resolve(served, params)
    choices = runs.submit(
        served.engine,
        rows,
        params,
        body.n,
        stops=body.stop,
        reasoning=False,
        pins=pins,
        allowed=allowed,
        logprobs=body.logprobs,
        want_drafts=body.include_drafts and body.stream,
        timeout=served.request_timeout,
    )
    pieces = runs.run(choices, served.decode, http.is_disconnected, finish=finish)
    return await _completion_reply(served, body, choices, pieces, prompts, plan)


async def _completion_reply(served: _Served, body: CompletionRequest, choices, pieces, prompts, plan):
    """The completion answer, streamed or whole, from the choices' pieces."""
    echoes = [served.decode(prompts[c.index // body.n]) if body.echo else "" for c in choices]
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = _Chunks(served, chat=False)
        opening = [chunks.choice(c.index, "content", echoes[k]) for k, c in enumerate(choices) if echoes[k]]
        prompt_tokens = sum(len(p) for p in prompts) * body.n
        stream = _stream(chunks, pieces, choices, opening, prompt_tokens, usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    return await _completion_answer(served, body, pieces, choices, echoes, prompts, plan)


async def _completion_logprobs(served: _Served, body: CompletionRequest, choices, echoes, prompts) -> list:
    """Each choice's legacy logprobs block (None without `logprobs`): the echoed prompt's (`echoes`: its
    text per choice), by the encoder, then the completion's, by the denoiser."""
    k = body.logprobs
    if k is None:
        return [None] * len(choices)
    tok = served.tokenizer
    scored = await logprob_blocks.echoed(served.engine, prompts, k) if body.echo else None
    blocks = []
    for c, echo in zip(choices, echoes, strict=True):
        head = None
        prompt = prompts[c.index // body.n]
        if scored is not None:
            head = logprob_blocks.legacy(tok, prompt, *scored[c.index // body.n])
        start = len(echo)
        lps, tops = c.logprobs or ([], [])
        n = c.returned_tokens
        blocks.append(logprob_blocks.join(head, logprob_blocks.legacy(tok, c.tokens[:n], lps[:n], tops[:n], start)))
    return blocks


async def _completion_answer(served, body: CompletionRequest, pieces, choices, echoes, prompts, plan):
    texts, reasons = await _gather(pieces)
    if len(reasons) < len(choices):
        raise ApiError(499, "the client closed the request")
    blocks = await _completion_logprobs(served, body, choices, echoes, prompts)
    out = [
        {
            "index": c.index,
            "text": echoes[k] + texts.get(c.index, {}).get("content", ""),
            "finish_reason": reasons[c.index],
            "logprobs": blocks[k],
        }
        for k, c in enumerate(choices)
    ]
    answer = {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": out,
        "usage": _usage(sum(len(p) for p in prompts) * body.n, sum(c.returned_tokens for c in choices)),
    }
    if plan is not None:  # the length given (None: chosen per choice), and each choice's
        fixed = plan.lengths[0] if len(plan.lengths) == 1 else None
        answer["dgemma"] = {"middle_length": fixed, "choices": [c.details for c in choices]}
    elif any(c.details for c in choices):  # `choices` scores, JSON attempts
        answer["dgemma"] = {"choices": [c.details for c in choices]}
    return answer
