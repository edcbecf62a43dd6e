"""Early-commit streaming: how much sooner the first text appears, and how much the output changes.

Early commit streams a canvas's leading tokens once their argmax has held for a few steps with low entropy,
and freezes them. This script compares, on the same prompts and seeds, the normal fast mode with early commit (and the
exact mode, as a check that fast mode behaves the same on a trained model): time to first token (in
denoising steps and seconds), total steps, accuracy on a task with a known answer, and token agreement
between the normal and early-commit outputs.

The model: a checkpoint directory (--model), or by default a small DiffusionGemma trained here for 250
steps (about 40 s) on a synthetic task (continue an arithmetic progression of digits: the prompt holds
three terms, the canvas of 32 the next 28 and the end-of-text fill). Trained this briefly it is right
about half the time and needs about ten steps per canvas, which is where early commit has something to
show; random weights never settle, and a fully trained toy settles in two steps.

Prints a table and ends with one JSON line. Run: python benchmarks/early_commit.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import dgemma
from dgemma.generation.engine import DoneEvent, DraftEvent, TokensEvent
from dgemma.model.config import DiffusionGemmaConfig, TextConfig

BOS, EOS, SEP, DIGIT0 = 2, 1, 3, 10
TERMS, PROMPT_TERMS, CANVAS = 28, 3, 32


def toy_config() -> DiffusionGemmaConfig:
    text = TextConfig(
        vocab_size=32,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        global_head_dim=24,
        num_global_key_value_heads=2,
        sliding_window=64,
        max_position_embeddings=256,
        num_experts=None,
        top_k_experts=None,
        moe_intermediate_size=None,
    )
    return DiffusionGemmaConfig(
        text_config=text, canvas_length=CANVAS, boi_token_id=None, eoi_token_id=None, image_token_id=None
    )


def task(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [n, 1 + 3 + 1] (BOS, three terms, SEP) and answers [n, CANVAS] (the next terms, EOS fill)."""
    start = torch.randint(0, 10, (n, 1), generator=g)
    step = torch.randint(1, 10, (n, 1), generator=g)
    terms = (start + step * torch.arange(PROMPT_TERMS + TERMS)) % 10 + DIGIT0
    prompts = torch.cat([torch.full((n, 1), BOS), terms[:, :PROMPT_TERMS], torch.full((n, 1), SEP)], 1)
    answers = torch.cat([terms[:, PROMPT_TERMS:], torch.full((n, CANVAS - TERMS), EOS)], 1)
    return prompts, answers


def train_toy(steps: int, seed: int = 0) -> tuple[dgemma.DiffusionGemma, dict]:
    """The block-diffusion objective in brief: uniform-noise corruption at a random level t per example,
    cross-entropy on every canvas position, half the examples self-conditioned on a first no-grad pass."""
    g = torch.Generator().manual_seed(seed)
    model = dgemma.build(toy_config(), seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    start = time.perf_counter()
    for _ in range(steps):
        prompts, answers = task(64, g)
        cache = model.new_cache(64, prompts.shape[1])
        model.encode(prompts, cache)
        t = torch.rand(64, 1, generator=g).clamp(1e-4, 1 - 1e-4)
        noisy = torch.where(
            torch.rand(answers.shape, generator=g) < t, torch.randint(0, 32, answers.shape, generator=g), answers
        )
        with torch.no_grad():
            first = model.denoise(noisy, cache)
        use_sc = torch.rand(64, generator=g) < 0.5
        logits = model.denoise(noisy, cache, model.soft_embedding(first) * use_sc[:, None, None])
        loss = F.cross_entropy(logits.reshape(-1, 32), answers.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, {"steps": steps, "seconds": time.perf_counter() - start, "final_loss": loss.item()}


def run(model, prompt: list[int], seed: int, **kw) -> dict:
    t0 = time.perf_counter()
    steps_before_first, first_s, steps = None, None, 0
    result = None
    for event in dgemma.stream(model, prompt, seed=seed, max_new_tokens=TERMS, stop_token_ids=[EOS], **kw):
        if isinstance(event, DraftEvent):
            steps += 1
        elif isinstance(event, TokensEvent) and steps_before_first is None:
            steps_before_first, first_s = steps, time.perf_counter() - t0
        elif isinstance(event, DoneEvent):
            result = event.result
    return {"tokens": result.tokens[0], "steps": steps, "first_step": steps_before_first, "ttft_s": first_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory trained on this task (default: train the toy)")
    parser.add_argument("--save", help="save the trained toy model to this directory")
    parser.add_argument("--train-steps", type=int, default=250, help="training steps of the toy model (~40 s)")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--steps", type=int, default=24, help="max denoising steps per canvas")
    parser.add_argument("--early-commit-steps", type=int, default=2)
    parser.add_argument("--early-commit-entropy", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.model:
        model, summary = dgemma.load(args.model), {"steps": 0, "seconds": 0.0, "final_loss": float("nan")}
    else:
        model, summary = train_toy(args.train_steps)
        if args.save:
            dgemma.save(model, args.save)
    model = dgemma.accelerate(model)
    prompts, answers = task(args.prompts, torch.Generator().manual_seed(12345))
    modes = {
        "exact": {"mode": "exact"},
        "normal": {},
        "early commit": {
            "early_commit": True,
            "early_commit_steps": args.early_commit_steps,
            "early_commit_entropy": args.early_commit_entropy,
        },
    }
    stats = {}
    outputs = {}
    for name, extra in modes.items():
        runs = [run(model, p.tolist(), seed=i, max_denoising_steps=args.steps, **extra) for i, p in enumerate(prompts)]
        outputs[name] = [r["tokens"] for r in runs]
        correct = [r["tokens"] == a[:TERMS].tolist() for r, a in zip(runs, answers, strict=True)]
        stats[name] = {
            "accuracy": sum(correct) / len(correct),
            "mean_steps": statistics.mean(r["steps"] for r in runs),
            "mean_steps_to_first_token": statistics.mean(r["first_step"] for r in runs),
            "mean_ttft_ms": 1000 * statistics.mean(r["ttft_s"] for r in runs),
        }
    same = [
        sum(a == b for a, b in zip(x, y, strict=False)) / TERMS
        for x, y in zip(outputs["normal"], outputs["early commit"], strict=True)
    ]
    agreement = statistics.mean(same)
    identical = sum(x == y for x, y in zip(outputs["normal"], outputs["early commit"], strict=True)) / len(same)
    print(
        f"toy model: {summary['steps']} training steps in {summary['seconds']:.0f} s, final loss "
        f"{summary['final_loss']:.3f}; {args.prompts} prompts, up to {args.steps} steps per canvas"
    )
    print(f"{'mode':14s} {'accuracy':>9s} {'steps':>7s} {'steps to 1st token':>19s} {'TTFT ms':>8s}")
    for name, s in stats.items():
        print(
            f"{name:14s} {s['accuracy']:9.2%} {s['mean_steps']:7.1f} {s['mean_steps_to_first_token']:19.1f} "
            f"{s['mean_ttft_ms']:8.1f}"
        )
    gain = stats["normal"]["mean_ttft_ms"] / stats["early commit"]["mean_ttft_ms"]
    print(
        f"early commit: first token {gain:.2f}x sooner; token agreement with normal mode {agreement:.1%}, "
        f"identical outputs {identical:.1%}"
    )
    print(
        json.dumps(
            {
                "benchmark": "early_commit",
                "training": summary,
                "modes": stats,
                "ttft_gain": gain,
                "token_agreement": agreement,
                "identical_outputs": identical,
                "early_commit_steps": args.early_commit_steps,
                "early_commit_entropy": args.early_commit_entropy,
            }
        )
    )


if __name__ == "__main__":
    main()
