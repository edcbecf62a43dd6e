"""Stage 1 vs stage 2: quality against tokens per forward, before and after RL + sampler distillation.

    python benchmarks/stage2_eval.py --task sudoku --after runs/sudoku-stage2/final [--before DIR]
    python benchmarks/stage2_eval.py --task code --after runs/code-stage2/final [--before DIR]

Sudoku (held-out test puzzles): solve rate, cell accuracy, mean denoising steps per puzzle, tokens per
forward (blank cells / steps: the mean over puzzles, and pooled: all blank cells / all steps) and wall
time per puzzle, with the default sampler (<= 48 steps, adaptive stop) and with <= 16, <= 8 and <= 4
steps. Code (held-out files, the spans of benchmarks/code_eval.py): infill exact match and parse rate,
steps per canvas, tokens per forward, wall time per canvas. Both models run the same sampler settings,
in one process. Prints a table, writes a PNG (quality against tokens per forward, one line per model)
and ends with one JSON line. `--before` defaults to the stage-1 model: models/sudoku-stage1 (the shipped
Sudoku model is stage 2) or the shipped code model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

import dgemma
from dgemma.tasks import sudoku

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "default (<= 48)": {},
    "<= 16 steps": {"max_denoising_steps": 16},
    "<= 8 steps": {"max_denoising_steps": 8},
    "<= 4 steps": {"max_denoising_steps": 4},
}


def measure(score) -> list[dict]:
    """One row per sampler setting: `score(sampling overrides)` returns per-item dicts of numbers; the
    row holds their means and the wall time per item. Where items count their `tokens`, the row also
    gets the pooled tokens per forward (all tokens / all forwards: the throughput ratio), beside the mean
    of the per-item ratios (which weighs a puzzle solved in 3 steps as much as one that took 48)."""
    rows = []
    for label, kw in SETTINGS.items():
        t0 = time.perf_counter()
        items = score(kw)
        seconds = time.perf_counter() - t0
        row = {"setting": label} | {key: statistics.fmean(i[key] for i in items) for key in items[0]}
        if "tokens" in row:
            row["pooled_tokens_per_forward"] = row["tokens"] / row["steps"]
        rows.append(row | {"ms_per_item": 1000 * seconds / len(items)})
    return rows


def sudoku_rows(model_dir: Path, puzzles: list[dict], batch: int = 100) -> list[dict]:
    model, tok = sudoku.load_model(model_dir)
    model = dgemma.accelerate(model)

    def score(kw: dict) -> list[dict]:
        items = []
        for a in range(0, len(puzzles), batch):
            group = puzzles[a : a + batch]
            solves = sudoku.solve_batch(model, tok, [q["puzzle"] for q in group], seed=0, **kw)
            for p, o in zip(group, solves, strict=True):
                blanks = [i for i, ch in enumerate(p["puzzle"]) if ch == sudoku.BLANK]
                correct = sum(o.solution[i] == p["solution"][i] for i in blanks)
                items.append(
                    {
                        "quality": o.solved,
                        "cells": correct / max(1, len(blanks)),
                        "steps": o.steps,
                        "tokens": len(blanks),
                        "tokens_per_forward": len(blanks) / max(1, o.steps),
                    }
                )
        return items

    return measure(score)


def code_rows(model_dir: Path, data: Path, n: int, seed: int = 0) -> list[dict]:
    import code_eval

    model, tok = dgemma.load(model_dir), dgemma.Tokenizer.from_dir(model_dir)
    model = dgemma.accelerate(model)
    files = [json.loads(line) for line in data.read_text().splitlines()]
    rng = random.Random(seed)
    cases = [(f["text"], a, b) for f in files for _, a, b in code_eval.spans(f["text"], rng, tok, 24, per_kind=3)]
    rng.shuffle(cases)
    cases = cases[:n]

    def score(kw: dict) -> list[dict]:
        items = []
        for text, a, b in cases:
            left = code_eval._tail(tok.encode(text[:a], add_special_tokens=False), 192) or [tok.bos_token_id]
            suffix = tok.encode(text[b:], add_special_tokens=False)
            r = dgemma.infill(model, left, suffix, middle_length="auto", tokenizer=tok, seed=0, **kw)
            result = code_eval._score(text, a, b, r.middle_text, text[a:b].strip(), r.result.stats)
            stats = r.result.stats
            items.append(
                {
                    "quality": result["exact"],
                    "parses": result["parses"],
                    "steps": statistics.fmean(stats.steps_per_canvas[0]),
                    "tokens_per_forward": stats.tokens_per_forward[0],
                }
            )
        return items

    return measure(score)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["sudoku", "code"], required=True)
    ap.add_argument("--before", type=Path, default=None, help="stage-1 model (default: see above)")
    ap.add_argument("--after", type=Path, required=True, help="stage-2 model")
    ap.add_argument("--data", type=Path, default=None, help="default: the task's test split under recipes/data")
    ap.add_argument("--limit", type=int, default=None, help="Sudoku: the first N test puzzles (default all)")
    ap.add_argument("--spans", type=int, default=60, help="code: infill spans (default 60)")
    ap.add_argument("--plot", type=Path, default=None, help="default: docs/stage2_TASK.png")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = args.data or ROOT / "recipes" / "data" / args.task / "test.jsonl"
    if not data.is_file():
        raise SystemExit(f"{data} not found: build it with python recipes/{args.task}_data.py")
    before = args.before or ROOT / ("models/sudoku-stage1" if args.task == "sudoku" else "dgemma/models/code")
    models = {"stage 1": before, "stage 2": args.after}
    results = {}
    for name, path in models.items():
        if args.task == "sudoku":
            puzzles = [json.loads(line) for line in data.read_text().splitlines()][: args.limit]
            results[name] = sudoku_rows(path, puzzles)
        else:
            results[name] = code_rows(path, data, args.spans)
    quality = "solve rate" if args.task == "sudoku" else "infill exact"
    extra = "cells" if args.task == "sudoku" else "parses"
    # (header, row key, format); the pooled figure exists where the rows counted their tokens (Sudoku)
    columns = [(quality, "quality", ".1%"), (extra, extra, ".1%"), ("steps", "steps", ".1f")]
    columns += [("tokens/forward", "tokens_per_forward", ".2f")]
    if "pooled_tokens_per_forward" in results["stage 1"][0]:
        columns += [("pooled tokens/forward", "pooled_tokens_per_forward", ".2f")]
    columns += [("ms per item", "ms_per_item", ".1f")]
    print("| model | sampler | " + " | ".join(h for h, _, _ in columns) + " |")
    print("|---|---|" + "---:|" * len(columns))
    for name, rows in results.items():
        for r in rows:
            print(f"| {name} | {r['setting']} | " + " | ".join(format(r[k], f) for _, k, f in columns) + " |")
    plot = args.plot or ROOT / "docs" / f"stage2_{args.task}.png"
    _plot(results, quality, plot)
    print(f"plot: {plot}")
    print(
        json.dumps(
            {
                "benchmark": "stage2_eval",
                "task": args.task,
                "models": {k: str(v) for k, v in models.items()},
                "results": results,
            }
        )
    )


def _plot(results: dict, quality: str, path: Path) -> None:
    """Quality against tokens per forward (pooled where measured), one line per model; code gets a second
    panel for the parse rate (its exact-match rate is often 0 for both models, which says nothing about
    speed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("quality", quality)] + ([("parses", "reassembled file parses")] if quality == "infill exact" else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    first = next(iter(results.values()))[0]
    x = "pooled_tokens_per_forward" if "pooled_tokens_per_forward" in first else "tokens_per_forward"
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        for name, rows in results.items():
            ax.plot([r[x] for r in rows], [r[key] for r in rows], "o-", label=name)
            for r in rows:
                ax.annotate(r["setting"], (r[x], r[key]), fontsize=7, alpha=0.7)
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
