"""How far an adapted model has learned to denoise (docs/adaptation.md): on held-out records
(recipes/adapt_data.py's test split), the denoiser's accuracy at a fixed noise level and the tokens per
forward of the checkpoint's own sampler.

- denoising accuracy at t: each canvas of a record corrupted at rate t (uniform random tokens, a fixed seed
  per record, as training corrupts), one denoiser pass after the clean prompt with no self-conditioning; the
  share of corrupted positions whose argmax is the clean token (and of all positions);
- tokens per forward: dgemma.generate of one canvas after each prompt, canvas tokens / denoising steps.

    python benchmarks/adapt_eval.py CHECKPOINT [CHECKPOINT ...] [--records recipes/data/gemma3-270m/test-records.jsonl]
        [--n 32] [--t 0.5]

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import dgemma

DEFAULT_RECORDS = Path(__file__).resolve().parent.parent / "recipes" / "data" / "gemma3-270m" / "test-records.jsonl"


def read_records(path: Path, n: int) -> list[tuple[list[int], list[int]]]:
    """The first `n` (prompt, completion) records of a prompt_ids / completion_ids JSONL file."""
    out = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            out.append((record["prompt_ids"], record["completion_ids"]))
            if len(out) == n:
                break
    return out


@torch.no_grad()
def denoising_accuracy(model, records, t: float, seed: int = 0) -> dict:
    """The denoiser's argmax accuracy on canvases corrupted at rate `t` (see the module docstring)."""
    c, vocab = model.config.canvas_length, model.text_config.vocab_size
    right = corrupted_right = corrupted = total = 0
    for i, (prompt, completion) in enumerate(records):
        clean = torch.tensor([completion[:c] + [model.text_config.eos_token_ids[0]] * (c - len(completion[:c]))])
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        flip = torch.rand(1, c, generator=g) < t
        noisy = torch.where(flip, torch.randint(0, vocab, (1, c), generator=g), clean).to(model.device)
        cache = model.new_cache(1, len(prompt) + c)
        model.encode(torch.tensor([prompt], device=model.device), cache)
        guess = model.denoise(noisy, cache).argmax(-1).cpu()
        hits = guess == clean
        right, total = right + int(hits.sum()), total + c
        corrupted_right, corrupted = corrupted_right + int(hits[flip].sum()), corrupted + int(flip.sum())
    return {"accuracy_corrupted": corrupted_right / max(corrupted, 1), "accuracy_all": right / max(total, 1)}


def tokens_per_forward(model, records, n: int = 8) -> float:
    """Canvas tokens per denoising step of dgemma.generate (the checkpoint's sampler) after `n` prompts."""
    tokens = steps = 0
    for i, (prompt, _) in enumerate(records[:n]):
        r = dgemma.generate(model, [prompt], max_new_tokens=model.config.canvas_length, seed=i)
        tokens += model.config.canvas_length
        steps += sum(r.stats.steps_per_canvas[0])
    return tokens / max(steps, 1)


def evaluate(checkpoint: Path, records, t: float, generations: int = 8) -> dict:
    """One table row: a checkpoint's denoising accuracy at `t` and its tokens per forward over `generations`
    prompts."""
    model = dgemma.load(checkpoint, dtype="fp32")
    start = time.perf_counter()
    row = {"checkpoint": str(checkpoint), "t": t, **denoising_accuracy(model, records, t)}
    row["tokens_per_forward"] = tokens_per_forward(model, records, generations)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", type=Path, nargs="+")
    parser.add_argument("--records", type=Path, default=DEFAULT_RECORDS)
    parser.add_argument("--n", type=int, default=32, help="held-out records")
    parser.add_argument("--t", type=float, default=0.5, help="noise level")
    parser.add_argument("--generations", type=int, default=8, help="prompts for tokens per forward")
    args = parser.parse_args()
    records = read_records(args.records, args.n)
    rows = [evaluate(c, records, args.t, args.generations) for c in args.checkpoints]
    print(f"| checkpoint | accuracy at t={args.t} (corrupted / all) | tokens per forward |\n|---|---|---:|")
    for r in rows:
        print(f"| {r['checkpoint']} | {r['accuracy_corrupted']:.1%} / {r['accuracy_all']:.1%} | "
              f"{r['tokens_per_forward']:.2f} |")  # fmt: skip
    print(json.dumps({"benchmark": "adapt_eval", "n": len(records), "rows": rows}))


if __name__ == "__main__":
    main()
