"""Concurrent prefills on the engine: encodes one request at a time against batched encodes, side by side.

16 requests arrive at once, each with a 512-token prompt, and each generates one canvas. The engine runs
every model call of their programs; with `batch_encodes=False` it answers their prompt encodes (and
commits) one request at a time (what it did before issue 41), with `batch_encodes=True` it groups the
encodes of equal shape (caches at the same length, as many new tokens) into one forward pass. Per
setting: the median and p95 time to first token (submit -> first final tokens), the median total time,
and the wall time until the last request ends. Both settings run the same requests and seeds, in one run,
best of `--repeats`.

Without --model it runs the `small` preset with random weights (73M parameters): the figures measure the
engine's scheduling, not text. Prints a table and ends with one JSON line.

    python benchmarks/batched_encodes.py [--model DIR] [--requests 16] [--prompt 512] [--repeats 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _measure import until_done

from dgemma import accelerate
from dgemma.bench import random_model
from dgemma.generation.engine import Engine, EngineRequest
from dgemma.generation.programs import Generate
from dgemma.generation.sampling import SamplingParams


def _program(runner, prompt: list[int], params: SamplingParams):
    """The checked generation program of one request (what the server submits)."""
    return Generate([prompt], params).check(runner.model).program(runner.model, runner.canvas_stats)


def run_once(runner, prompts: list[list[int]], batch_encodes: bool, steps: int) -> dict:
    """All requests submitted at once; per request, seconds to its first final tokens and to its end."""
    engine = Engine(runner, max_batch=len(prompts), batch_encodes=batch_encodes)
    try:
        params = dict(max_new_tokens=runner.model.config.canvas_length, max_denoising_steps=steps, stop_token_ids=[])
        t0 = time.perf_counter()
        requests = [
            engine.submit(EngineRequest(_program(runner, p, SamplingParams(**params, seed=i))))
            for i, p in enumerate(prompts)
        ]
        first, total = [], []
        for r in requests:
            seen, end, _ = until_done(r, t0)
            first.append(seen)
            total.append(end)
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    first.sort()
    return {
        "ttft_p50_s": statistics.median(first),
        "ttft_p95_s": first[min(len(first) - 1, round(0.95 * (len(first) - 1)))],
        "total_p50_s": statistics.median(total),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory (default: the small preset, random weights)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per canvas")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.model:
        import dgemma

        model = dgemma.load(args.model, device=args.device)
    else:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = random_model("small", device=args.device, dtype=dtype)
    runner = accelerate(model)
    g = torch.Generator().manual_seed(0)
    vocab = model.text_config.vocab_size
    prompts = [torch.randint(8, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    run_once(runner, prompts[:2], True, 1)  # warm up both paths' kernels
    run_once(runner, prompts[:2], False, 1)
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, batched in (("one at a time", False), ("batched", True)):
            r = run_once(runner, prompts, batched, args.steps)
            if name not in best or r["wall_s"] < best[name]["wall_s"]:
                best[name] = r
    print(f"{args.requests} concurrent requests, {args.prompt}-token prompts, one canvas of "
          f"{model.config.canvas_length} at {args.steps} steps; {torch.get_num_threads()} threads")  # fmt: skip
    print("| encodes | TTFT p50 s | TTFT p95 s | total p50 s | last request ends s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in best.items():
        print(
            f"| {name} | {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | {r['total_p50_s']:.2f} | {r['wall_s']:.2f} |"
        )
    a, b = best["one at a time"], best["batched"]
    print(f"- batched / one at a time: TTFT p50 x{a['ttft_p50_s'] / b['ttft_p50_s']:.2f}, "
          f"last request x{a['wall_s'] / b['wall_s']:.2f} faster")  # fmt: skip
    print(json.dumps({"benchmark": "batched_encodes", "requests": args.requests, "prompt": args.prompt,
                      "steps": args.steps, "model": args.model or "small (random)", **{
                          k.replace(" ", "_"): v for k, v in best.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
