"""A server batch's denoising step: eager stacked caches against the graph of its bucket, side by side.

The engine stacks the caches of the requests it denoises together (each at its own length). On CUDA a
graphed runner copies their prefixes into fixed buffers once per change and replays the graph captured for
that batch size (dgemma/runtime/graphs.py); an eager runner concatenates the prefixes on every step and
launches every kernel. Per batch size: ms per step (median of `--steps`, after a warm-up that captures),
both ways, in one run. The prompts have different lengths (256 to 768 tokens), as a server's do.

    python benchmarks/batched_steps.py [--preset small] [--device cpu|cuda] [--batches 1,4,8,16]

On a CPU there are no graphs: both rows run the same static or stacked steps eagerly, which shows what the
fixed shapes cost. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dgemma import accelerate
from dgemma.bench import random_model
from dgemma.model.kv_cache import StackedCache


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def step_ms(runner, caches, steps: int) -> float:
    """Median ms of one denoising step over the stacked `caches` (a signal after the first step)."""
    model, c = runner.model, runner.model.config.canvas_length
    stacked = StackedCache(caches)
    g = torch.Generator(device=model.device).manual_seed(0)
    canvas = torch.randint(0, model.text_config.vocab_size, (stacked.batch_size, c), generator=g, device=model.device)
    logits = runner.denoise(canvas, stacked)
    times = []
    for _ in range(steps + 2):  # two warm-up steps (the graph's capture) are not counted
        soft = model.soft_embedding(logits)
        sync(model.device)
        t0 = time.perf_counter()
        logits = runner.denoise(canvas, stacked, soft)
        sync(model.device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="fp32 or bf16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    model = random_model(args.preset, device=device, dtype=dtype)
    runners = {
        "eager": accelerate(model, grouped=True, graphs=False),
        "graphed": accelerate(model, grouped=True, graphs=True),
    }
    g = torch.Generator().manual_seed(1)
    rows = []
    with torch.inference_mode():
        for b in (int(x) for x in args.batches.split(",")):
            caches = []
            for i in range(b):
                n = 256 + (512 * i) // max(b - 1, 1)
                cache = model.new_cache(1, n + model.config.canvas_length)
                ids = torch.randint(8, model.text_config.vocab_size, (1, n), generator=g).to(device)
                runners["eager"].encode(ids, cache)
                caches.append(cache)
            rows.append({"batch": b, **{name: step_ms(r, caches, args.steps) for name, r in runners.items()}})
            print(f"batch {b}: {rows[-1]}", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n{args.preset}, {dtype}, {name}: ms per denoising step of a stacked server batch")
    print("| requests | eager ms | graphed ms | speed-up |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['eager']:.2f} | {r['graphed']:.2f} | x{r['eager'] / r['graphed']:.2f} |")
    print(json.dumps({"benchmark": "batched_steps", "preset": args.preset, "device": name, "rows": rows}))


if __name__ == "__main__":
    main()
