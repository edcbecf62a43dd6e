"""Load test of `dgemma serve`: many streaming clients on loopback, measured from the client side.

Starts the real server (`dgemma serve`, a subprocess) on a model directory, then for each concurrency
level runs that many `openai` clients at once, each streaming chat completions in a loop. Per level:
requests/s, generated tokens/s, p50/p95 time to first token and total latency, errors (must be 0), and
the server's peak resident memory so far (VmHWM). Then the batching gain: the same load at 8 clients
with `--max-batch 8` against `--max-batch 1` (requests one at a time), in the same run.

Without --model it serves a random-weight model of the `tiny` preset with a small BPE tokenizer: the
figures then measure the serving machinery (queueing, batching, SSE), not text quality.

Prints a table and ends with one JSON line. Run: python benchmarks/serve_load.py [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test helpers (tests/helpers.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toy_model_dir(root: Path) -> Path:
    """A random-weight `tiny` model with a BPE tokenizer, saved as a checkpoint directory."""
    import torch
    from helpers import make_tokenizer

    import dgemma

    torch.manual_seed(0)
    model = dgemma.build(dgemma.preset("tiny"))
    path = root / "tiny-random"
    dgemma.save(model, path)
    make_tokenizer(model.text_config.vocab_size).save(path)
    return path


class Server:
    """`dgemma serve` in a subprocess, ready when /health answers."""

    def __init__(self, model: Path, max_batch: int, max_queue: int = 128):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = shutil.which("dgemma", path=str(Path(sys.executable).parent)) or "dgemma"
        cmd = [exe, "serve", "--model", str(model), "--port", str(self.port), "--max-batch", str(max_batch)]
        cmd += ["--max-queue", str(max_queue), "--served-model-name", "bench"]
        # the server's log goes to a file: a pipe nobody reads would fill and stall the server
        self.log = tempfile.NamedTemporaryFile("w+", prefix="dgemma-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True)

    def __enter__(self):
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("the server did not answer /health within 120 s")

    def log_tail(self, chars: int = 2000) -> str:
        return Path(self.log.name).read_text()[-chars:]

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, steps: int) -> dict:
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    stream = await client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "max_denoising_steps": steps},
    )
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else latency, "latency": latency, "tokens": tokens}


async def _level(url: str, clients: int, per_client: int, max_tokens: int, steps: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    results: list[dict] = []
    errors: list[str] = []

    async def worker(i: int) -> None:
        for j in range(per_client):
            try:
                results.append(await _one(client, f"Client {i} asks question {j}.", max_tokens, steps))
            except Exception as e:  # counted and reported: the goal is zero
                errors.append(f"{type(e).__name__}: {e}"[:200])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()

    def pct(key: str, q: float) -> float:
        values = sorted(r[key] for r in results)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(errors),
        "error_examples": errors[:3],
        "req_per_s": len(results) / wall,
        "tok_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": statistics.median(r["ttft"] for r in results) if results else float("nan"),
        "ttft_p95_s": pct("ttft", 0.95),
        "latency_p50_s": statistics.median(r["latency"] for r in results) if results else float("nan"),
        "latency_p95_s": pct("latency", 0.95),
        "wall_s": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: a random-weight tiny model)")
    ap.add_argument("--levels", default="1,4,16,32", help="concurrent clients per level (default 1,4,16,32)")
    ap.add_argument("--requests", type=int, default=64, help="requests per level, split over its clients")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos: exactly this)")
    ap.add_argument("--steps", type=int, default=8, help="max denoising steps per canvas (default 8)")
    ap.add_argument("--max-batch", type=int, default=8, help="server --max-batch for the levels (default 8)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _toy_model_dir(Path(tmp))
        rows = []
        with Server(model, args.max_batch) as server:
            asyncio.run(_level(server.url, 2, 1, args.max_tokens, args.steps))  # warm-up
            for clients in levels:
                per = max(1, args.requests // clients)
                row = asyncio.run(_level(server.url, clients, per, args.max_tokens, args.steps))
                row["server_peak_rss_mb"] = server.peak_rss_mb()
                rows.append(row)
                print(f"  {clients:3d} clients: {row['tok_per_s']:.0f} tok/s, {row['errors']} errors", file=sys.stderr)
        gain = {}
        for batch in (8, 1):
            with Server(model, batch) as server:
                asyncio.run(_level(server.url, 2, 1, args.max_tokens, args.steps))
                gain[batch] = asyncio.run(_level(server.url, 8, 4, args.max_tokens, args.steps))

    print(f"\nserve_load: {args.model or 'tiny preset, random weights'}; {args.max_tokens} tokens per request,")
    print(f"<= {args.steps} denoising steps per canvas, server --max-batch {args.max_batch}, {os.cpu_count()} CPUs")
    print("(server RSS: the server process's peak resident memory so far)\n")
    print(
        "| clients | requests | errors | req/s | tok/s | TTFT p50 / p95 (s) | latency p50 / p95 (s) | server RSS (MB) |"
    )
    print("|---:|---:|---:|---:|---:|---|---|---:|")
    for r in rows:
        print(
            f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['req_per_s']:.2f} | {r['tok_per_s']:.0f} | "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | "
            f"{r['server_peak_rss_mb']:.0f} |"
        )
    ratio = gain[8]["tok_per_s"] / gain[1]["tok_per_s"]
    print(
        f"\nbatching gain at 8 clients: --max-batch 8 {gain[8]['tok_per_s']:.0f} tok/s vs --max-batch 1 "
        f"{gain[1]['tok_per_s']:.0f} tok/s = {ratio:.2f}x"
    )
    errors = sum(r["errors"] for r in rows) + gain[8]["errors"] + gain[1]["errors"]
    summary = {
        "benchmark": "serve_load",
        "model": str(args.model) if args.model else "tiny-random",
        "levels": [{k: v for k, v in r.items() if k != "error_examples"} for r in rows],
        "batching_gain_8_vs_1": ratio,
        "errors": errors,
    }
    if errors:
        print("errors:", [e for r in [*rows, *gain.values()] for e in r["error_examples"]], file=sys.stderr)
    print(json.dumps(summary))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
