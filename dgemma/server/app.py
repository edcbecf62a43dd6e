"""The HTTP server: OpenAI-compatible routes over the batching engine, SSE streaming, metrics, playground.

GET  /                      the playground (static page)
GET  /health                liveness
GET  /metrics               Prometheus text
GET  /v1/models             the served model
POST /v1/chat/completions   chat (messages), streaming or not; diffusion settings as extra fields
POST /v1/completions        text completion (one prompt or several); with `suffix`, infilling

A request crosses one path: the guard (host, key, body bounds; guard.py), the request model (types and
ranges; protocol.py), then its route (routes.py): the fields that do not go together refused, the prompt
bounded in characters and tokenised (on a worker thread, not the event loop), the body mapped to one task
(dgemma/generation/programs.py) and checked (a 400 naming the field before anything is queued or
streamed), a program per choice submitted to the engine, and the pieces (runs.py) sent as SSE chunks or
gathered into one JSON answer (answers.py). This module makes the app: the engine, the guard, the error
shapes, the info routes and /docs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

try:
    import fastapi_offline  # Swagger UI's files, for an offline /docs
except ImportError:  # pragma: no cover - a dependency of dgemma[serve]
    fastapi_offline = None

from ..generation.engine import Engine
from ..model.kv_cache import PrefixCache
from ..runtime.runner import as_runner
from .dialects import llamacpp, messages, ollama, responses
from .guard import Guard
from .limits import Limits
from .metrics import CONTENT_TYPE, Metrics
from .protocol import ApiError, validation_error
from .routes import add_generation_routes, check_model
from .runs import Served

STATIC = Path(__file__).parent / "static"
TOKENIZE_AT_ONCE = 2  # prompts tokenised at the same time (each on a worker thread)
DEFAULT_MAX_CONTEXT = 32768  # positions per request unless --max-context says otherwise (each has its own cache)


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
    prefix_cache_gb: float | None = None,
) -> FastAPI:
    """A FastAPI app serving `model`, a DiffusionGemma or a Runner of one (`dgemma.accelerate(model)`:
    fast requests on the fast modules); its engine thread starts now and stops with the app.

    `check_host` answers only requests addressed to localhost (set it when serving on loopback without
    a key); `limits` bounds the body (see guard.Limits); `max_context` bounds the positions (prompt and
    generated tokens) of one request, and so its KV cache (default: the model's context, at most 32768);
    `prefix_cache_gb` bounds the prefix cache that prompts and committed canvases are kept in for later
    requests (0: none; default: kv_cache.DEFAULT_SHARE of the memory free now)."""
    runner = as_runner(model)
    model_context = runner.model.text_config.max_position_embeddings
    context = min(model_context, DEFAULT_MAX_CONTEXT) if max_context is None else max_context
    if not 0 < context <= model_context:
        raise ValueError(f"max_context must be in [1, {model_context}] (the model's context); got {context}")
    limits = limits or Limits()
    if prefix_cache_gb is not None and not 0 <= prefix_cache_gb < 1 << 20:
        raise ValueError(f"prefix_cache_gb must be a number of GiB >= 0; got {prefix_cache_gb}")
    size = None if prefix_cache_gb is None else int(prefix_cache_gb * (1 << 30))
    prefix = None if size == 0 else PrefixCache.for_model(runner.model, size)
    queued = limits.max_queued_tokens
    engine = Engine(runner, max_batch=max_batch, max_queue=max_queue, max_queued_tokens=queued, prefix_cache=prefix)
    semaphore = asyncio.Semaphore(TOKENIZE_AT_ONCE)
    served = Served(runner.model, tokenizer, engine, model_name, request_timeout, semaphore, context)

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
    add_generation_routes(app, served)
    for dialect in (responses, messages, ollama, llamacpp):
        dialect.add_routes(app, served)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        return _error_response(validation_error(exc.errors()), request.url.path)

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
        return _error_response(ApiError(exc.status_code, message, kind=kind, headers=headers), request.url.path)


def _error_response(err: ApiError, path: str) -> JSONResponse:
    return JSONResponse(err.body(path), status_code=err.status, headers=err.headers)


def _add_info_routes(app: FastAPI, served: Served, metrics: Metrics) -> None:
    get = functools.partial(_get_and_head, app)

    @get("/", response_class=HTMLResponse, summary="the playground")
    async def playground():
        return HTMLResponse((STATIC / "playground.html").read_text())

    @get("/health", summary="liveness")
    async def health():
        e = served.engine
        return {"status": "ok", "model": served.name, "active": e.active, "queued": e.queue_depth}

    @get("/metrics", summary="Prometheus metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    card = {"id": served.name, "object": "model", "created": 0, "owned_by": "dgemma"}

    @get("/v1/models", summary="OpenAI: the served model")
    async def models():
        return {"object": "list", "data": [card]}

    @get("/v1/models/{model_id:path}", summary="OpenAI: one model's card")
    async def model(model_id: str):
        check_model(served, model_id)
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
