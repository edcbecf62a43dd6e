"""The package files a request enters from its arrival to its first forward pass (issue 56: a trip is what
a reader follows to understand a request, so it is the budget, not a file's lines).

In-process, on the shipped code model: every thread is profiled, and each function call whose code lives
in `dgemma/` records its file, on the request's causal path: from the moment the request is sent until it
is handed to the engine (`Engine.submit`; the event loop and the tokenizer's and compiler's worker threads),
then on the engine's threads (`dgemma-engine`, `dgemma-work`) until a Runner is first asked for a pass
(`Runner.encode`, `.denoise`; `runtime/runner.py` counts as the last stop). What the event loop does
meanwhile (waiting for pieces, writing the answer) is not on that path. The trips:

- chat: a plain chat request through the app (`POST /v1/chat/completions`, not streamed, then streamed);
- chat_json: the same with a json_schema response_format;
- completions: a plain `POST /v1/completions`;
- generate_json: `dgemma.generate_json(model, prompt, schema, tokenizer=...)` in the library.

Prints a table (trip, files, the files in order of first entry) and ends with one JSON line.

    python benchmarks/trips.py [--model models/code-ar] [--list]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path

import dgemma

PACKAGE = Path(dgemma.__file__).resolve().parent
ROOT = PACKAGE.parent
STOPS = {"encode", "denoise"}  # Runner methods: the request's first forward pass is asked for
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


class Trip:
    """Records the package files entered, in order, while `on`: every thread until the request is handed
    to the engine, then the engine's threads until the first pass."""

    def __init__(self):
        self.files: list[str] = []
        self.on = self.handed = False
        self.runner_file = str(PACKAGE / "runtime" / "runner.py")
        self.engine_file = str(PACKAGE / "generation" / "engine.py")

    def __call__(self, frame, event, _arg):
        if not self.on or event != "call":
            return
        name = frame.f_code.co_filename
        if not name.startswith(str(PACKAGE)):
            return
        if self.handed and not threading.current_thread().name.startswith("dgemma-"):
            return
        rel = str(Path(name).relative_to(PACKAGE))
        if rel not in self.files:
            self.files.append(rel)
        if name == self.engine_file and frame.f_code.co_name == "submit":
            self.handed = True
        if name == self.runner_file and frame.f_code.co_name in STOPS:
            self.on = False

    def start(self) -> None:
        self.files, self.on, self.handed = [], True, False


def _server_trips(trip: Trip, model, tok) -> dict[str, list[str]]:
    import httpx

    from dgemma.server.app import create_app

    app = create_app(model, tok, model_name="trips")
    user = [{"role": "user", "content": "Write a function that adds two numbers."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    bodies = {
        "chat": ("/v1/chat/completions", {"messages": user, "max_tokens": 8, "max_denoising_steps": 2}),
        "chat_streamed": (
            "/v1/chat/completions",
            {"messages": user, "max_tokens": 8, "max_denoising_steps": 2, "stream": True},
        ),
        "chat_json": ("/v1/chat/completions", {"messages": user, "response_format": fmt, "max_denoising_steps": 2}),
        "completions": ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 8, "max_denoising_steps": 2}),
    }
    out = {}

    async def send(path, body):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            trip.start()
            response = await client.post(path, json=body, timeout=600)
            trip.on = False
            assert response.status_code == 200, response.text

    for name, (path, body) in bodies.items():
        asyncio.run(send(path, body))
        out[name] = list(trip.files)
    return out


def measure(model, tok) -> dict[str, list[str]]:
    """Each trip's files, in order of first entry (the server's trips on a fresh app of `model`)."""
    trip = Trip()
    threading.setprofile(trip)  # threads started from now on: the engine's, the tokenizer's workers
    sys.setprofile(trip)
    try:
        trips = _server_trips(trip, model, tok)
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "city": {"type": "string", "maxLength": 9}}}
        trip.start()
        dgemma.generate_json(model, "Name a person.", schema, tokenizer=tok, max_denoising_steps=2)  # not cached
        trip.on = False
        trips["generate_json"] = list(trip.files)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return trips


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "code-ar"))
    parser.add_argument("--list", action="store_true", help="print each trip's files")
    args = parser.parse_args(argv)
    from dgemma.checkpoints.tokenizer import Tokenizer

    trips = measure(dgemma.load(args.model), Tokenizer.from_dir(args.model))
    print(f"{'trip':<16} {'files':>5}")
    for name, files in trips.items():
        print(f"{name:<16} {len(files):>5}" + (f"  {' > '.join(files)}" if args.list else ""))
    print(json.dumps({"benchmark": "trips", **{name: len(files) for name, files in trips.items()}}))


if __name__ == "__main__":
    main()
