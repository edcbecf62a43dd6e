"""`dgemma serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted."""
    try:
        import uvicorn

        from .server.app import create_app
    except ImportError as e:
        raise ImportError("the server needs FastAPI and uvicorn: pip install 'dgemma[serve]'") from e
    from .cli_generate import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(args)
    name = args.served_model_name or Path(args.model).resolve().name
    app = create_app(
        model,
        tokenizer,
        model_name=name,
        api_key=args.api_key,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
    )
    where = f"http://{args.host}:{args.port}"
    print(f"dgemma serve: {name} on {where} (playground: {where}/, API: {where}/v1)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def register(sub) -> None:
    from .cli_generate import add_model_args, positive_int

    s = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve a model over HTTP: /v1/chat/completions and /v1/completions (OpenAI "
        "format, streaming at token granularity, `suffix` for infilling), /v1/models, /health, "
        "/metrics (Prometheus) and a playground page at /. Concurrent requests share denoising "
        "passes. Diffusion settings (max_denoising_steps, entropy_bound, t_min, t_max, ...) are "
        "accepted as extra request fields.",
    )
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--max-batch", type=positive_int, default=8, help="requests denoised together (default 8)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting before 429 (default 64)")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is dropped")
    s.add_argument("--served-model-name", default=None, help="model id in the API (default: directory name)")
    s.add_argument("--mode", default="fast", choices=["fast", "exact"], help="forward paths (exact: reference)")
    s.add_argument("--compile", action="store_true", help="torch.compile the denoising pass")
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)
