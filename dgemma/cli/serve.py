"""`dgemma serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted."""
    try:
        from ..server.app import create_app
        from ..server.http import make_server
        from ..server.limits import Limits
    except ImportError as e:
        raise ImportError("the server needs FastAPI, uvicorn and prometheus-client: pip install 'dgemma[serve]'") from e
    import torch

    from ..runtime.cpu import free_cpus
    from .common import load_model_and_tokenizer

    threads = args.threads or free_cpus()
    torch.set_num_threads(threads)
    runner, tokenizer = load_model_and_tokenizer(args)
    name = args.served_model_name or Path(args.model).resolve().name
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    app = create_app(
        runner,
        tokenizer,
        model_name=name,
        api_key=args.api_key,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        limits=limits,
        check_host=loopback and not args.api_key,
        max_context=args.max_context,
        prefix_cache_gb=args.prefix_cache_gb,
    )
    where = f"http://{args.host}:{args.port}"
    print(
        f"dgemma serve: {name} on {where} (playground: {where}/, API: {where}/v1), {threads} CPU threads",
        file=sys.stderr,
    )
    if not loopback and not args.api_key:
        print("dgemma serve: warning: serving beyond this machine without --api-key", file=sys.stderr)
    server = make_server(
        app, args.host, args.port, log_level=args.log_level, limits=limits, shutdown_timeout=args.shutdown_timeout
    )
    server.run()
    return 0


def _old_mode(text: str) -> str:
    """The old `serve --mode fast|exact` as a --kernels value (exact meant the reference modules)."""
    if text not in ("fast", "exact"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from 'fast', 'exact')")
    return "reference" if text == "exact" else "fast"


def _port(text: str) -> int:
    """A TCP port number (1-65535)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 1 and 65535 (got {port})")
    return port


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text})")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (got {text!r})")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and value < 1 << 20):
        raise argparse.ArgumentTypeError(f"must be a number of GiB >= 0 (got {text})")
    return value


def register(sub) -> None:
    from .common import add_model_args, add_old_name, positive_int

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
    s.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but / and /health (without a key on "
        "loopback, only requests addressed to localhost are answered)",
    )
    _add_bound_args(s)
    s.add_argument("--served-model-name", default=None, help="model id in the API (default: directory name)")
    add_old_name(s, "--mode", "--kernels", dest="kernels", type=_old_mode)
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    s.add_argument(
        "--threads", type=positive_int, default=None,
        help="CPU threads for torch (default: the cores not busy with other processes, by the load average)",
    )  # fmt: skip
    s.set_defaults(func=cmd_serve)


def _add_bound_args(s) -> None:
    """The flags that bound what requests may cost: batch, queue, time, context, body, headers, shutdown."""
    from ..server.limits import Limits
    from .common import positive_int

    s.add_argument("--max-batch", type=positive_int, default=8, help="requests denoised together (default 8)")
    s.add_argument("--max-queue", type=_non_negative_int, default=64, help="requests waiting before 429 (default 64)")
    s.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds before a request is dropped with a 504 (default 600)",
    )
    s.add_argument(
        "--max-context",
        type=positive_int,
        default=None,
        help="positions (prompt + generated tokens) one request may use, which sizes its KV cache "
        "(default: the model's context, at most 32768)",
    )
    s.add_argument(
        "--prefix-cache-gb",
        type=_non_negative_float,
        default=None,
        help="GiB of keys and values kept after requests end, so that a later prompt starting with the same "
        "tokens (a system prompt, a conversation, a file) loads them instead of encoding them; least recently "
        "used first out; 0 turns it off (default: a tenth of the memory free at start)",
    )
    for f in dataclasses.fields(Limits):  # one flag per bound, named, typed and explained by its field
        kind = positive_int if f.type in (int, "int") else _positive_float
        flag = "--" + f.name.replace("_", "-")
        s.add_argument(flag, type=kind, default=f.default, help=f"{f.metadata['help']} (default {f.default})")
    s.add_argument(
        "--shutdown-timeout",
        type=_positive_float,
        default=10.0,
        help="on SIGTERM, seconds to wait for connections after every request has been ended (default 10)",
    )
