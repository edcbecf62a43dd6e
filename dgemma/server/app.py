"""The HTTP server: OpenAI-compatible routes over the batching engine, SSE streaming, metrics, playground.

GET  /                      the playground (static page)
GET  /health                liveness
GET  /metrics               Prometheus text
GET  /v1/models             the served model
POST /v1/chat/completions   chat (messages), streaming or not; diffusion settings as extra fields
POST /v1/completions        text completion; with `suffix`, infilling between prompt and suffix
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from ..engine import Engine, EngineRequest, QueueFull, RequestTimeout
from ..generate import DoneEvent, DraftEvent, TokensEvent
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    StreamText,
    extract_tool_calls,
    find_stop,
    new_id,
    split_reasoning,
)

log = logging.getLogger("dgemma.server")
STATIC = Path(__file__).parent / "static"


class _Sink:
    """Lets the engine thread hand events to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self):
        return await self.queue.get()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The OpenAI usage block."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def create_app(
    model,
    tokenizer,
    *,
    model_name: str = "dgemma",
    api_key: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    request_timeout: float = 600.0,
) -> FastAPI:
    """A FastAPI app serving `model` (its engine thread starts now and stops with the app)."""
    engine = Engine(model, max_batch=max_batch, max_queue=max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="dgemma", version="1", docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.engine = engine
    http_counts: dict[tuple[str, int], int] = {}
    context = model.text_config.max_position_embeddings
    default_max = model.generation_config.max_new_tokens

    # -- plumbing -------------------------------------------------------------------------------------
    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if api_key and path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if header != f"Bearer {api_key}":
                err = ApiError(
                    401,
                    "a valid API key is required (Authorization: Bearer KEY)",
                    kind="authentication_error",
                    code="invalid_api_key",
                )
                return JSONResponse(err.body(), status_code=401)
        try:
            response = await call_next(request)
        except Exception:  # never a traceback to the client
            log.exception("unhandled error on %s", path)
            response = JSONResponse(ApiError(500, "internal server error", kind="server_error").body(), 500)
        key = (
            path if path.startswith("/v1/") or path in ("/", "/health", "/metrics") else "other",
            response.status_code,
        )
        http_counts[key] = http_counts.get(key, 0) + 1
        return response

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        return JSONResponse(ApiError(400, f"{param}: {message}" if param else message, param).body(), 400)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server has {model_name!r}",
                "model",
                code="model_not_found",
            )

    def budget(requested: int | None, prompt_len: int, param: str) -> int:
        max_tokens = requested or default_max
        room = context - prompt_len
        needed = math.ceil(max_tokens / model.config.canvas_length) * model.config.canvas_length
        if room <= 0:
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens, more than the model's context of {context}",
                "messages" if param == "max_tokens" else "prompt",
                code="context_length_exceeded",
            )
        if needed > room:
            raise ApiError(
                400,
                f"{param} is too large: the prompt ({prompt_len} tokens) leaves room for "
                f"{room} tokens (whole canvases of {model.config.canvas_length})",
                param,
                code="context_length_exceeded",
            )
        return max_tokens

    async def run_choices(http: Request, prompt: list[int], settings, sampling: dict, pins=None):
        """Submit one engine request per choice; returns the requests and their event sinks."""
        loop = asyncio.get_running_loop()
        requests = []
        for i in range(settings.n):
            seed = None if settings.seed is None else settings.seed + i
            req = EngineRequest(
                prompt,
                {**sampling, "seed": seed},
                pins=pins,
                want_drafts=settings.include_drafts,
                timeout=request_timeout,
            )
            req.events = _Sink(loop)
            try:
                engine.submit(req)
            except QueueFull as e:
                for r in requests:
                    r.cancel()
                raise ApiError(
                    429, str(e), kind="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
                ) from e
            requests.append(req)
        return requests

    def check_event(ev):
        if isinstance(ev, RequestTimeout):
            raise ApiError(504, str(ev), kind="timeout_error")
        if isinstance(ev, ValueError):
            raise ApiError(400, str(ev))
        if isinstance(ev, Exception):
            log.error("generation failed: %r", ev)
            raise ApiError(500, "generation failed", kind="server_error")
        return ev

    async def collect(http: Request, req: EngineRequest):
        """Wait for a request's result, cancelling it if the client goes away."""
        while True:
            try:
                ev = await asyncio.wait_for(req.events.get(), timeout=1.0)
            except TimeoutError:
                if await http.is_disconnected():
                    req.cancel()
                    raise ApiError(499, "client closed the request") from None
                continue
            check_event(ev)
            if isinstance(ev, DoneEvent):
                return ev.result

    def finish(tokens: list[int], reason: str, stops, reasoning: bool, tools: bool):
        text = tokenizer.decode(tokens)
        cut = find_stop(text, stops)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        thought, answer = split_reasoning(text)
        calls, answer = extract_tool_calls(answer) if tools else ([], answer)
        message = {"role": "assistant", "content": answer}
        if reasoning and thought is not None:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = calls
            reason = "tool_calls"
        return message, reason

    # -- routes ---------------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse((STATIC / "playground.html").read_text())

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "active": engine.active, "queued": engine.queue_depth}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        s = engine.stats
        lines = [
            "# TYPE dgemma_requests_total counter",
            f"dgemma_requests_total {s.requests}",
            "# TYPE dgemma_requests_finished_total counter",
            f"dgemma_requests_finished_total {s.requests_finished}",
            "# TYPE dgemma_requests_rejected_total counter",
            f"dgemma_requests_rejected_total {s.requests_rejected}",
            "# TYPE dgemma_requests_cancelled_total counter",
            f"dgemma_requests_cancelled_total {s.requests_cancelled}",
            "# TYPE dgemma_requests_failed_total counter",
            f"dgemma_requests_failed_total {s.requests_failed}",
            "# TYPE dgemma_tokens_generated_total counter",
            f"dgemma_tokens_generated_total {s.tokens_generated}",
            "# TYPE dgemma_denoising_steps_total counter",
            f"dgemma_denoising_steps_total {s.denoising_steps}",
            "# TYPE dgemma_canvas_steps_total counter",
            f"dgemma_canvas_steps_total {s.row_steps}",
            "# TYPE dgemma_tokens_per_forward gauge",
            f"dgemma_tokens_per_forward {s.tokens_generated / s.row_steps if s.row_steps else 0.0:.4f}",
            "# TYPE dgemma_queue_depth gauge",
            f"dgemma_queue_depth {engine.queue_depth}",
            "# TYPE dgemma_batch_size gauge",
            f"dgemma_batch_size {engine.active}",
            "# TYPE dgemma_last_batch_size gauge",
            f"dgemma_last_batch_size {s.last_batch_size}",
            "# TYPE dgemma_http_requests_total counter",
        ]
        lines += [
            f'dgemma_http_requests_total{{path="{p}",status="{c}"}} {n}' for (p, c), n in sorted(http_counts.items())
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dgemma"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        check_model(body.model)
        messages = []
        for i, m in enumerate(body.messages):
            if isinstance(m.content, list):
                for part in m.content:
                    if part.type != "text":
                        raise ApiError(
                            400,
                            f"messages[{i}] has {part.type} content; this model takes text only",
                            f"messages.{i}.content",
                        )
            messages.append(m.model_dump(exclude_none=True))
        if not tokenizer.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            prompt = tokenizer.apply_chat_template(
                messages, enable_thinking=True if body.reasoning else None, tools=body.tools
            )
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from e
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = budget(
            requested, len(prompt), "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        )
        requests = await run_choices(http, prompt, body, body.sampling(max_tokens))
        if body.stream:
            return StreamingResponse(stream_chat(http, requests, body, len(prompt)), media_type="text/event-stream")
        try:
            results = [await collect(http, r) for r in requests]
        finally:
            for r in requests:
                r.cancel()
        choices, completion_tokens = [], 0
        for i, result in enumerate(results):
            message, reason = finish(
                result.tokens[0], result.finish_reasons[0], body.stop, body.reasoning, bool(body.tools)
            )
            choices.append({"index": i, "message": message, "finish_reason": reason})
            completion_tokens += len(result.tokens[0])
        return {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(len(prompt), completion_tokens),
            "dgemma": {
                "steps_per_canvas": [r.stats.steps_per_canvas[0] for r in results],
                "tokens_per_forward": [round(r.stats.tokens_per_forward[0], 3) for r in results],
            },
        }

    async def stream_chat(http: Request, requests: list[EngineRequest], body: ChatCompletionRequest, prompt_len: int):
        cid, created = new_id("chatcmpl"), int(time.time())

        def chunk(index: int, delta: dict, reason=None, extra=None) -> str:
            payload = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [{"index": index, "delta": delta, "finish_reason": reason}],
            }
            if extra:
                payload.update(extra)
            return f"data: {json.dumps(payload)}\n\n"

        texts = [StreamText(body.stop, body.reasoning) for _ in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        completion = 0
        try:
            for i in range(len(requests)):
                yield chunk(i, {"role": "assistant", "content": ""})
            pending = {i: asyncio.ensure_future(r.events.get()) for i, r in enumerate(requests)}
            while pending:
                done, _ = await asyncio.wait(pending.values(), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    if await http.is_disconnected():
                        return
                    continue
                for i, fut in list(pending.items()):
                    if fut not in done:
                        continue
                    ev = fut.result()
                    if isinstance(ev, Exception):
                        try:
                            check_event(ev)
                        except ApiError as err:
                            yield f"data: {json.dumps(err.body())}\n\n"
                        del pending[i]
                        continue
                    if isinstance(ev, DraftEvent):
                        draft = tokenizer.decode(ev.drafts[0].tolist())
                        yield chunk(
                            i, {}, extra={"dgemma_draft": {"canvas": ev.canvas_index, "step": ev.step, "text": draft}}
                        )
                    elif isinstance(ev, TokensEvent):
                        tokens[i].extend(ev.tokens)
                        for kind, piece in texts[i].feed(tokenizer.decode(tokens[i])):
                            yield chunk(i, {"reasoning_content" if kind == "reasoning" else "content": piece})
                        if texts[i].stopped:
                            requests[i].cancel()
                            completion += len(tokens[i])
                            yield chunk(i, {}, "stop")
                            del pending[i]
                            continue
                    elif isinstance(ev, DoneEvent):
                        for kind, piece in texts[i].feed(tokenizer.decode(tokens[i]), final=True):
                            yield chunk(i, {"reasoning_content" if kind == "reasoning" else "content": piece})
                        completion += len(tokens[i])
                        reason = "stop" if texts[i].stopped else ev.result.finish_reasons[0]
                        yield chunk(i, {}, reason)
                        del pending[i]
                        continue
                    pending[i] = asyncio.ensure_future(requests[i].events.get())
            if body.stream_options and body.stream_options.include_usage:
                last = {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": _usage(prompt_len, completion),
                }
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away, or we are done: stop any work still running
            for r in requests:
                r.cancel()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model)
        if isinstance(body.prompt, list):
            bad = [t for t in body.prompt if not 0 <= t < model.text_config.vocab_size]
            if bad:
                raise ApiError(400, f"prompt has token ids outside the vocabulary: {bad[:5]}", "prompt")
            prompt = list(body.prompt)
        else:
            prompt = tokenizer.encode(body.prompt) if body.prompt else [model.text_config.bos_token_id or 2]
        pins = None
        if body.suffix is not None:
            if body.stream:
                raise ApiError(400, "infilling (suffix) is not streamed; set stream to false", "stream")
            from ..editing import _end_token, _infill_template

            middle = body.max_tokens or 16
            if middle > model.config.canvas_length:
                raise ApiError(
                    400,
                    f"with a suffix, max_tokens is the middle's length and may not exceed the canvas "
                    f"({model.config.canvas_length})",
                    "max_tokens",
                )
            suffix = tokenizer.encode(body.suffix, add_special_tokens=False)
            tpl, _ = _infill_template(middle, suffix, model.config.canvas_length, _end_token(model))
            pins = torch.tensor([[-1 if t is None else t for t in tpl]])
            max_tokens = len(tpl)
            budget(max_tokens, len(prompt), "max_tokens")
            sampling = {**body.sampling(max_tokens), "stop_token_ids": [], "early_commit": False}
        else:
            max_tokens = budget(body.max_tokens, len(prompt), "max_tokens")
            sampling = body.sampling(max_tokens)
        requests = await run_choices(http, prompt, body, sampling, pins=pins)
        if body.stream:
            return StreamingResponse(
                stream_completion(http, requests, body, len(prompt)), media_type="text/event-stream"
            )
        try:
            results = [await collect(http, r) for r in requests]
        finally:
            for r in requests:
                r.cancel()
        choices, completion_tokens = [], 0
        for i, result in enumerate(results):
            toks = result.tokens[0][: (body.max_tokens or 16)] if pins is not None else result.tokens[0]
            reason = "length" if pins is not None else result.finish_reasons[0]
            text = tokenizer.decode(toks)
            cut = find_stop(text, body.stop)
            if cut >= 0:
                text, reason = text[:cut], "stop"
            choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None})
            completion_tokens += len(toks)
        return {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(len(prompt), completion_tokens),
        }

    async def stream_completion(http: Request, requests: list[EngineRequest], body: CompletionRequest, prompt_len: int):
        cid, created = new_id("cmpl"), int(time.time())
        try:
            for i, req in enumerate(requests):
                text = StreamText(body.stop, reasoning=False)
                tokens: list[int] = []
                while True:
                    ev = await req.events.get()
                    if isinstance(ev, Exception):
                        try:
                            check_event(ev)
                        except ApiError as err:
                            yield f"data: {json.dumps(err.body())}\n\n"
                        break
                    if isinstance(ev, TokensEvent):
                        tokens.extend(ev.tokens)
                    final = isinstance(ev, DoneEvent)
                    for _, piece in text.feed(tokenizer.decode(tokens), final=final):
                        payload = {
                            "id": cid,
                            "object": "text_completion",
                            "created": created,
                            "model": model_name,
                            "choices": [{"index": i, "text": piece, "finish_reason": None}],
                        }
                        yield f"data: {json.dumps(payload)}\n\n"
                    if final or text.stopped:
                        reason = "stop" if text.stopped else ev.result.finish_reasons[0]
                        req.cancel()
                        payload = {
                            "id": cid,
                            "object": "text_completion",
                            "created": created,
                            "model": model_name,
                            "choices": [{"index": i, "text": "", "finish_reason": reason}],
                        }
                        yield f"data: {json.dumps(payload)}\n\n"
                        break
            yield "data: [DONE]\n\n"
        finally:
            for r in requests:
                r.cancel()

    return app
