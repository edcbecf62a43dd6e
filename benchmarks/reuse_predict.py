"""Predicted outputs on the shipped models: what a prediction saves, and what a wrong one costs.

- Sudoku (dgemma/models/sudoku, one canvas, the model's own sampler: up to 48 steps, adaptive stop): the
  puzzles solved with no prediction, with the solution as the prediction, with the solution but 10 of its
  blank cells wrong, and with a random valid grid (wrong almost everywhere, yet self-consistent); steps per
  puzzle, solve rate, and the share of placed prediction tokens the answers kept.
- Code edit (dgemma/models/code): held-out standard-library files whose prompt (the file's first ~320
  tokens) has one identifier renamed, the edit; the answer is the next 256 tokens, and the prediction the
  original file's. Forwards per token with and without the prediction, the share of the prediction kept,
  and the new name written in the answer.

`benchmarks/reuse.py` imports both functions; run alone it prints a table and ends with one JSON line:

    python benchmarks/reuse_predict.py [--puzzles 200] [--files 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
from collections import Counter

import torch
from _measure import print_flat

from dgemma.checkpoints.tokenizer import Tokenizer
from dgemma.checkpoints.weights import load
from dgemma.generation.programs import generate
from dgemma.tasks import code, sudoku

BATCH = 50  # puzzles per batch (rows that stop leave it)


def _wrong_cells(solution: str, puzzle: str, k: int, rng: random.Random) -> str:
    """`solution` with `k` of the puzzle's blank cells (at most all of them) set to another digit."""
    cells = list(solution)
    blanks = [i for i, ch in enumerate(puzzle) if ch == sudoku.BLANK]
    for i in rng.sample(blanks, min(k, len(blanks))):
        cells[i] = rng.choice([d for d in sudoku.DIGITS if d != cells[i]])
    return "".join(cells)


def _solve_all(model, tok, puzzles: list[sudoku.Puzzle], grids: list[str] | None) -> dict:
    """One canvas per puzzle with `grids` as the predictions (None: none): steps, solves, tokens kept."""
    steps, solved, kept, placed = [], [], 0, 0
    for a in range(0, len(puzzles), BATCH):
        group = puzzles[a : a + BATCH]
        pins = torch.tensor([[-1 if t is None else t for t in sudoku.template(tok, p.puzzle)] for p in group])
        prompts = [sudoku.prompt_ids(tok, p.puzzle) for p in group]
        prediction = None if grids is None else [sudoku.solution_ids(tok, g) for g in grids[a : a + BATCH]]
        r = generate(model, prompts, pins=pins, prediction=prediction, stop_token_ids=[], seed=a)
        steps += [s[0] for s in r.stats.steps_per_canvas]
        solved += [
            sudoku.is_solution(sudoku.decode_grid(tok, t), p.puzzle) for t, p in zip(r.tokens, group, strict=True)
        ]
        if grids is not None:
            kept += sum(r.accepted_prediction_tokens)
            placed += sum(r.accepted_prediction_tokens) + sum(r.rejected_prediction_tokens)
    out = {"steps": statistics.mean(steps), "solve_rate": sum(solved) / len(solved)}
    return out if grids is None else {**out, "kept": kept / max(placed, 1)}


def sudoku_predictions(n_puzzles: int, seed: int) -> dict:
    """Steps per puzzle and solve rate on `n_puzzles` generated puzzles (from `seed`) with no prediction, the
    solution, the solution with 10 blank cells wrong, and a random valid grid, as a flat dict of numbers."""
    model, tok = sudoku.load_model()
    puzzles = [sudoku.generate(seed * 1_000_003 + i) for i in range(n_puzzles)]
    rng = random.Random(seed)
    cases = {
        "none": None,
        "right": [p.solution for p in puzzles],
        "wrong10": [_wrong_cells(p.solution, p.puzzle, 10, rng) for p in puzzles],
        "random": [sudoku.random_solution(rng) for _ in puzzles],
    }
    out: dict = {"sudoku_puzzles": n_puzzles}
    for name, grids in cases.items():
        for key, value in _solve_all(model, tok, puzzles, grids).items():
            out[f"sudoku_{name}_{key}"] = value
    out["sudoku_right_steps_ratio"] = out["sudoku_right_steps"] / out["sudoku_none_steps"]
    return out


def _edit_cases(tok, n_files: int, prompt_tokens: int, answer_tokens: int) -> list[tuple[list[int], list[int], str]]:
    """(prompt, original continuation, new name) of up to `n_files` held-out stdlib files: the prompt is the
    file's first `prompt_tokens`-odd tokens (cut at a line start) with its most used identifier that the
    continuation uses too renamed (the edit); the continuation, the original's next `answer_tokens`."""
    root = code.stdlib_dir()

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    cases = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if code.split_of(path.name) != "test" or len(text) < 4 * (prompt_tokens + answer_tokens):
            continue
        cut = next((s for s in code.line_starts(text) if len(encode(text[:s])) >= prompt_tokens), None)
        if cut is None:
            continue
        before, after = text[:cut], encode(text[cut:])[:answer_tokens]
        names = Counter(re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", before))
        rest = tok.decode(after)
        name = next((n for n, _ in names.most_common() if n != "self" and re.search(rf"\b{n}\b", rest)), None)
        if name is None or len(after) < answer_tokens:
            continue
        cases.append((encode(re.sub(rf"\b{name}\b", name + "_new", before)), after, name + "_new"))
        if len(cases) == n_files:
            break
    return cases


def code_edit_prediction(n_files: int = 8, prompt_tokens: int = 320, answer_tokens: int = 256) -> dict:
    """Forwards per token of a code edit with the original file as the prediction, against none, as a flat
    dict of numbers (dgemma/models/code, held-out standard-library files)."""
    model, tok = load(code.MODEL_DIR), Tokenizer.from_dir(code.MODEL_DIR)
    cases = _edit_cases(tok, n_files, prompt_tokens, answer_tokens)
    out: dict = {"code_edit_files": len(cases), "code_edit_tokens": answer_tokens}
    for name in ("none", "prediction"):
        forwards = tokens = kept = renamed = 0
        for prompt, original, new_name in cases:
            seeds = original if name == "prediction" else None
            r = generate(model, prompt, max_new_tokens=answer_tokens, prediction=seeds, stop_token_ids=[], seed=0)
            forwards, tokens = forwards + r.stats.decoder_forward_passes[0], tokens + len(r.tokens[0])
            kept += sum(a == b for a, b in zip(r.tokens[0], original, strict=False))  # the original's tokens kept
            renamed += new_name in tok.decode(r.tokens[0])
        out[f"code_edit_{name}_forwards_per_token"] = forwards / tokens
        out[f"code_edit_{name}_original_kept"] = kept / max(tokens, 1)
        out[f"code_edit_{name}_new_name_written"] = renamed / max(len(cases), 1)
    out["code_edit_forwards_ratio"] = (
        out["code_edit_prediction_forwards_per_token"] / out["code_edit_none_forwards_per_token"]
    )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--puzzles", type=int, default=200)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = {**sudoku_predictions(args.puzzles, args.seed), **code_edit_prediction(args.files)}
    print_flat("reuse_predict", out)


if __name__ == "__main__":
    main()
