"""Sudoku evaluation: the diffusion model against its autoregressive twin on held-out puzzles.

For each difficulty bucket (easy / medium / hard, by the techniques a logical solver needs): exact-solve
rate, cell accuracy on the blanks, mean denoising steps per puzzle and puzzles/s, for the diffusion model
with the default sampler (up to 48 steps, adaptive stop) and with small fixed step budgets, and for the AR
twin (greedy, one token per forward, clues forced), verified retries (an unsolved grid is denoised
again with the next seed, up to --attempts canvases; steps count every attempt) and self-verified
restarts (a canvas the model's own stop rule did not end before the step cap is started again; no rule
check). Clue preservation is checked on every output. Writes a PNG plot (solve rate vs steps per puzzle,
with the AR twin) and ends with one JSON line.

    python benchmarks/sudoku_eval.py [--model DIR] [--ar-model DIR] [--data recipes/data/sudoku/test.jsonl]

By default: the model shipped inside dgemma, the AR twin in models/sudoku-ar (if present; it is kept
out of the package), and the test split made by recipes/sudoku_data.py.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from dgemma.tasks import sudoku

ROOT = Path(__file__).resolve().parent.parent
BUDGETS = (1, 2, 4, 8, 16)  # fixed step budgets besides the default sampler


def cell_accuracy(puzzle: str, grid: str, solution: str) -> float:
    blanks = [i for i, ch in enumerate(puzzle) if ch == sudoku.BLANK]
    return sum(grid[i] == solution[i] for i in blanks) / max(len(blanks), 1)


@torch.no_grad()
def solve_ar(model, tokenizer, puzzles: list[str]) -> list[str]:
    """Greedy next-token decoding of the 81 cells, the clue cells forced to their given digit."""
    prompts = torch.tensor([sudoku.prompt_ids(tokenizer, p) for p in puzzles])
    clue_ids = torch.tensor([[-1 if t is None else t for t in sudoku.template(tokenizer, p)] for p in puzzles])
    cache = model.new_cache(len(puzzles), prompts.shape[1] + 81)
    logits = model.encode(prompts, cache, return_logits=True).logits[:, -1]
    out = []
    for i in range(81):
        nxt = torch.where(clue_ids[:, i] >= 0, clue_ids[:, i], logits.argmax(-1))
        out.append(nxt)
        if i < 80:
            logits = model.encode(nxt[:, None], cache, return_logits=True).logits[:, -1]
    ids = torch.stack(out, 1).tolist()
    return [sudoku.decode_grid(tokenizer, row) for row in ids]


def evaluate(name: str, solve, puzzles: list[dict], batch: int) -> dict:
    """Run `solve(list of puzzles) -> (grids, steps)` over all puzzles; aggregate per level."""
    per_level = defaultdict(lambda: {"n": 0, "solved": 0, "cells": 0.0, "steps": 0, "clues_kept": 0})
    start = time.perf_counter()
    for a in range(0, len(puzzles), batch):
        group = puzzles[a : a + batch]
        grids, steps = solve([p["puzzle"] for p in group])
        for p, grid, s in zip(group, grids, steps, strict=True):
            for key in (p["level"], "all"):
                row = per_level[key]
                row["n"] += 1
                row["solved"] += sudoku.is_solution(grid, p["puzzle"])
                row["cells"] += cell_accuracy(p["puzzle"], grid, p["solution"])
                row["steps"] += s
                row["clues_kept"] += all(c == sudoku.BLANK or c == g for c, g in zip(p["puzzle"], grid, strict=True))
    seconds = time.perf_counter() - start
    levels = {}
    for key, row in per_level.items():
        n = row["n"]
        levels[key] = {
            "puzzles": n,
            "solve_rate": row["solved"] / n,
            "cell_accuracy": row["cells"] / n,
            "mean_steps": row["steps"] / n,
            "clues_kept": row["clues_kept"] / n,
        }
    return {"name": name, "levels": levels, "puzzles_per_s": len(puzzles) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="diffusion model (default: the shipped one)")
    parser.add_argument("--ar-model", type=Path, default=ROOT / "models" / "sudoku-ar")
    parser.add_argument("--data", type=Path, default=ROOT / "recipes" / "data" / "sudoku" / "test.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N puzzles only")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "sudoku_eval.png")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--attempts",
        type=int,
        default=4,
        help="also measure verified retries: an unsolved grid is denoised again with the next seed, up to N "
        "canvases; steps count every attempt (default 4; 1 skips it)",
    )
    parser.add_argument(
        "--short-attempts",
        type=int,
        default=sudoku.SOLVER_DEFAULTS["invalid"]["attempts"],
        help="also measure verified retries of short canvases (<= 8 steps each), up to N (default 40; 1 skips it)",
    )
    parser.add_argument(
        "--self-attempts",
        type=int,
        default=sudoku.SOLVER_DEFAULTS["unsettled"]["attempts"],
        help="also measure self-verified restarts of short canvases (<= 8 steps each): a canvas the model's own "
        "stop rule (made stricter: sudoku.SOLVER_DEFAULTS) did not end is started again, up to N canvases; no rule "
        "check (default 64; 1 skips it)",
    )
    parser.add_argument(
        "--self-confidence",
        type=float,
        default=sudoku.SOLVER_DEFAULTS["unsettled"]["confidence_threshold"],
        help="the stop rule's mean-entropy threshold for self-verified restarts (default 0.002; the model's own "
        "default is 0.005): a stricter rule settles on fewer wrong grids",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.data.is_file():
        raise SystemExit(f"{args.data} not found: build the splits with python recipes/sudoku_data.py")
    puzzles = [json.loads(line) for line in args.data.read_text().splitlines()][: args.limit]
    model, tok = sudoku.load_model(args.model)
    import dgemma

    model = dgemma.accelerate(model)

    def diffusion(**kw):
        def solve(batch):
            out = sudoku.solve_batch(model, tok, batch, seed=0, **kw)
            return [o.solution for o in out], [o.steps for o in out]

        return solve

    runs = [evaluate("diffusion (default sampler, <= 48 steps)", diffusion(), puzzles, args.batch)]
    for k in BUDGETS:
        runs.append(evaluate(f"diffusion, {k} steps", diffusion(max_denoising_steps=k), puzzles, args.batch))
    if args.attempts > 1:
        name = f"retries: default sampler, <= {args.attempts} attempts"
        runs.append(evaluate(name, diffusion(attempts=args.attempts), puzzles, args.batch))
    if args.short_attempts > 1:
        name = f"retries: <= 8 steps, <= {args.short_attempts} attempts"
        kw = {**sudoku.SOLVER_DEFAULTS["invalid"], "attempts": args.short_attempts}
        runs.append(evaluate(name, diffusion(**kw), puzzles, args.batch))
    if args.self_attempts > 1:
        name = f"restarts: <= 8 steps, <= {args.self_attempts}, self-verified"
        kw = {**sudoku.SOLVER_DEFAULTS["unsettled"], "retry_on": "unsettled"}
        kw.update(attempts=args.self_attempts, confidence_threshold=args.self_confidence)
        runs.append(evaluate(name, diffusion(**kw), puzzles, args.batch))
    if args.ar_model and (args.ar_model / "config.json").is_file():
        ar_model, ar_tok = sudoku.load_model(args.ar_model)
        ar_model = dgemma.accelerate(ar_model)
        runs.append(
            evaluate(
                "AR twin (greedy, 81 forwards)",
                lambda batch: (solve_ar(ar_model, ar_tok, batch), [81] * len(batch)),
                puzzles,
                args.batch,
            )
        )
    header = f"{'model':46s} {'level':7s} {'solve':>7s} {'cells':>7s} {'steps':>6s} {'clues':>6s} {'puz/s':>7s}"
    print(f"{len(puzzles)} test puzzles from {args.data}")
    print(header)
    for r in runs:
        for level in ("easy", "medium", "hard", "all"):
            if level not in r["levels"]:
                continue
            v = r["levels"][level]
            rate = f"{r['puzzles_per_s']:7.1f}" if level == "all" else ""
            print(
                f"{r['name']:46s} {level:7s} {v['solve_rate']:7.1%} {v['cell_accuracy']:7.1%} "
                f"{v['mean_steps']:6.1f} {v['clues_kept']:6.1%} {rate}"
            )
    _plot(runs, args.plot)
    print(f"plot: {args.plot}")
    print(json.dumps({"benchmark": "sudoku_eval", "puzzles": len(puzzles), "runs": runs}))


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 5.2), dpi=120)
    for level, marker in (("easy", "o"), ("medium", "s"), ("hard", "^"), ("all", "D")):
        pts = [
            (r["levels"][level]["mean_steps"], r["levels"][level]["solve_rate"])
            for r in runs
            if r["name"].startswith("diffusion") and level in r["levels"]
        ]
        pts.sort()
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker=marker, label=f"diffusion, {level}")
    for r in runs:
        if r["name"].startswith(("retries", "restarts")):
            v = r["levels"]["all"]
            marker = "k*" if "default" in r["name"] else ("kP" if r["name"].startswith("retries") else "kX")
            ax.plot(v["mean_steps"], 100 * v["solve_rate"], marker, markersize=10, label=f"{r['name']}, all")
        if r["name"].startswith("AR"):
            ax.axhline(
                100 * r["levels"]["all"]["solve_rate"],
                color="k",
                linestyle="--",
                label=f"AR twin, all ({r['levels']['all']['mean_steps']:.0f} forwards)",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("mean denoising steps per puzzle")
    ax.set_ylabel("exact solves (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax.set_title("Sudoku: dgemma's diffusion model vs its AR twin")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
