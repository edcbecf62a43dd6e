"""Training throughput and memory: full training and LoRA on the `small` preset (~70M parameters).

One optimizer step = the block-diffusion loss of a batch (encoder pass with the next-token co-loss, two
decoder passes) + backward + AdamW. Tokens are the encoder sequence plus the denoised canvas. Peak memory
is the most tensor storage alive at once during a step (activations, gradients, optimizer state created
in the step), counted op by op; the weights are not included. Random token data; fp32 on CPU.

Prints a table and ends with one JSON line. Run: python benchmarks/train_speed.py [--preset small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _measure import peak_tensor_mb

import dgemma
from dgemma.train.data import Example
from dgemma.train.lora import apply_lora
from dgemma.train.objective import ObjectiveConfig, assemble, block_diffusion_loss, draw_sample


def make_examples(n: int, prompt: int, response: int, vocab: int) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    return [
        Example(
            torch.randint(3, vocab, (prompt,), generator=g).tolist(),
            torch.randint(3, vocab, (response,), generator=g).tolist(),
        )
        for _ in range(n)
    ]


def run(mode: str, args) -> dict:
    config = dgemma.preset(args.preset)
    model = dgemma.build(config, seed=0).train()
    model.gradient_checkpointing = args.gradient_checkpointing
    for layer in model.layers:
        if layer.router is not None:
            layer.router.requires_grad_(False)
    if mode == "lora":
        model = apply_lora(model, r=16, alpha=32)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.95, 0.99), weight_decay=1e-4)
    cfg = ObjectiveConfig()
    c, vocab = config.canvas_length, config.text_config.vocab_size
    examples = make_examples(args.batch_size * (args.steps + 1), args.prompt, args.response, vocab)

    def step(i: int) -> int:
        group = examples[i * args.batch_size : (i + 1) * args.batch_size]
        samples = [draw_sample(e, i * args.batch_size + j, 0, c, vocab, cfg) for j, e in enumerate(group)]
        batch = assemble(samples, c, eos_id=1, pad_id=0)
        loss, _ = block_diffusion_loss(model, batch, cfg)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return batch.tokens

    step(0)  # warm-up (also creates the optimizer state)
    peak = peak_tensor_mb(lambda: step(1))
    times, tokens = [], 0
    for i in range(2, args.steps + 1):
        t0 = time.perf_counter()
        tokens = step(i)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {
        "mode": mode,
        "trainable_params": sum(p.numel() for p in params),
        "tokens_per_step": tokens,
        "seconds_per_step": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_mb": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per example")
    parser.add_argument("--response", type=int, default=192, help="response tokens per example")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up and one measured)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [run(mode, args) for mode in ("full", "lora")]
    params = dgemma.count_parameters(dgemma.preset(args.preset))["total"]
    print(
        f"preset {args.preset} ({params / 1e6:.1f}M parameters), batch {args.batch_size} x (prompt "
        f"{args.prompt} + response {args.response}), fp32, {args.threads} threads"
    )
    print(f"{'mode':6s} {'trainable':>12s} {'tokens/step':>12s} {'s/step':>8s} {'tokens/s':>9s} {'peak MB':>8s}")
    for r in rows:
        print(
            f"{r['mode']:6s} {r['trainable_params']:12,d} {r['tokens_per_step']:12d} {r['seconds_per_step']:8.2f} "
            f"{r['tokens_per_s']:9.0f} {r['peak_mb']:8.0f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "train_speed",
                "preset": args.preset,
                "batch_size": args.batch_size,
                "prompt": args.prompt,
                "response": args.response,
                "threads": args.threads,
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
