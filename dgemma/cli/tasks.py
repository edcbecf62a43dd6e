"""`dgemma sudoku`: solve a puzzle with the Sudoku model shipped inside dgemma (or another)."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path


def _read_puzzle(args: argparse.Namespace) -> str:
    from ..tasks import sudoku

    if args.puzzle_file is not None:
        if not args.puzzle_file.is_file():
            raise FileNotFoundError(f"puzzle file {args.puzzle_file} not found")
        return sudoku.parse(args.puzzle_file.read_text())
    if args.puzzle:
        return sudoku.parse(" ".join(args.puzzle))
    return sudoku.generate_level(args.level, args.seed if args.seed is not None else int(time.time())).puzzle


def grid_text(tokenizer, puzzle: str, event):
    """One draft of a Sudoku canvas as rich Text: clues bold, cells accepted this step green, the rest dim."""
    from rich.text import Text

    from ..tasks import sudoku

    grid = sudoku.decode_grid(tokenizer, event.drafts[0].tolist())
    accepted = event.accepted[0].tolist()
    text = Text()
    for r in range(9):
        for c in range(9):
            i = r * 9 + c
            style = "bold" if puzzle[i] != sudoku.BLANK else ("green" if accepted[i] else "dim")
            text.append(("." if grid[i] == sudoku.BLANK else grid[i]) + " ", style=style)
            if c in (2, 5):
                text.append("| ")
        text.append("\n")
        if r in (2, 5):
            text.append("------+-------+------\n")
    text.append(f"step {event.step}", style="cyan")
    return text


def _live_grid(tokenizer, puzzle: str):
    """Shows the grid as the canvas denoises (rich), redrawn in place."""
    from rich.console import Console
    from rich.live import Live

    live = Live(console=Console(stderr=True), refresh_per_second=20)
    return live, lambda event: live.update(grid_text(tokenizer, puzzle, event))


def cmd_sudoku(args: argparse.Namespace) -> int:
    """Solve one Sudoku puzzle with the model and print the grid (or JSON)."""
    from ..generation.engine import DraftEvent
    from ..tasks import sudoku

    puzzle = _read_puzzle(args)
    sudoku.solve(puzzle)  # refuses contradictory, unsolvable and ambiguous puzzles with a clear message
    model, tokenizer = sudoku.load_model(args.model, args.quant, args.group_size)
    sampling = {"seed": args.seed if args.seed is not None else 0}
    if args.one_canvas:  # the model's first answer, with its own sampler unless told otherwise
        if args.attempts not in (None, 1) or args.retry_on is not None:
            raise ValueError("--one-canvas denoises a single canvas: drop --attempts and --retry-on")
        sampling["attempts"] = 1
    else:
        retry_on = args.retry_on or "invalid"
        sampling.update(sudoku.SOLVER_DEFAULTS[retry_on], retry_on=retry_on)
    given = {
        "attempts": args.attempts,
        "max_denoising_steps": args.max_denoising_steps,
        "confidence_threshold": args.confidence_threshold,
    }
    sampling.update({k: v for k, v in given.items() if v is not None})
    if sampling["attempts"] < 1:
        raise ValueError(f"--attempts must be at least 1, got {sampling['attempts']}")
    if args.show_canvas:  # redraw the grid at every draft, across the attempts
        live, show = _live_grid(tokenizer, puzzle)
        sampling["on_event"] = lambda event: show(event) if isinstance(event, DraftEvent) else None
    else:
        live = contextlib.nullcontext()
    start = time.perf_counter()
    with live:
        solved = sudoku.solve_batch(model, tokenizer, [puzzle], **sampling)[0]
    seconds = time.perf_counter() - start
    if args.json:
        print(
            json.dumps(
                {
                    "puzzle": puzzle,
                    "solution": solved.solution,
                    "solved": solved.solved,
                    "clues_kept": solved.clues_kept,
                    "steps": solved.steps,
                    "attempts": solved.attempts,
                    "settled": solved.settled,
                    "seconds": round(seconds, 4),
                }
            )
        )
    else:
        left, right = sudoku.pretty(puzzle).splitlines(), sudoku.pretty(solved.solution).splitlines()
        print("puzzle                     solution")
        for a, b in zip(left, right, strict=True):
            print(f"{a:26s} {b}")
        verdict = "solved" if solved.solved else "NOT solved (the model's grid breaks a rule)"
        tries = f" over {solved.attempts} attempts" if solved.attempts > 1 else ""
        print(f"{verdict} in {solved.steps} denoising steps{tries}, {seconds:.2f} s")
    return 0 if solved.solved else 1


def _add_sudoku_search_args(s) -> None:
    """How many canvases a solve may take, what starts a new one, and when one has settled."""
    from .common import add_old_name

    s.add_argument(
        "--attempts",
        type=int,
        default=None,
        help="denoise up to N canvases (seeds SEED, SEED+1, ...), a new one while the last is not accepted "
        "(--retry-on); steps count every canvas (default 40; 64 with --retry-on unsettled)",
    )
    s.add_argument(
        "--retry-on",
        default=None,
        choices=["invalid", "unsettled"],
        help="what starts a new canvas: 'invalid' (default; verified retries): the grid fails the rule check "
        "(a repeated digit; not a solver: every grid is the model's); 'unsettled' (self-verified restarts): "
        "the model's own stop rule did not end the last canvas before the step cap, nothing outside the "
        "model is consulted",
    )
    s.add_argument(
        "--confidence-threshold",
        type=float,
        default=None,
        help="the stop rule's mean-entropy threshold: a canvas settles when its draft is stable and its mean "
        "entropy is below this (default: the model's own 0.005; 0.002 with --retry-on unsettled, which also "
        "asks the draft to stay unchanged for 2 steps rather than 1)",
    )
    add_old_name(s, "--stop-entropy", "--confidence-threshold", dest="confidence_threshold", type=float)


def register(sub) -> None:
    from .common import add_old_name, add_quant_args

    s = sub.add_parser(
        "sudoku",
        help="solve a Sudoku with the shipped diffusion model",
        description="Solve a Sudoku puzzle with the small DiffusionGemma trained by dgemma (shipped "
        "inside the package). The puzzle is 81 cells, digits with 0 or . for blanks; spaces and "
        "| - + separators are ignored. With no puzzle, a random one of --level is made. Exit "
        "status 1 if the model's grid is not a valid solution.",
    )
    s.add_argument("puzzle", nargs="*", help="the puzzle (81 cells; may be split over several arguments)")
    s.add_argument("--puzzle-file", type=Path, help="read the puzzle from a file")
    add_old_name(s, "--file", "--puzzle-file", dest="puzzle_file", type=Path)
    s.add_argument(
        "--level",
        default="medium",
        choices=["easy", "medium", "hard"],
        help="difficulty of the random puzzle made when none is given (default medium)",
    )
    s.add_argument("--model", "-m", type=Path, default=None, help="another Sudoku model directory")
    add_quant_args(s)
    s.add_argument(
        "--max-denoising-steps",
        type=int,
        default=None,
        help="denoising steps per canvas at most (default 8; with --one-canvas, the model's own 48)",
    )
    add_old_name(s, "--steps", "--max-denoising-steps", dest="max_denoising_steps", type=int)
    s.add_argument("--seed", type=int, default=None, help="random seed (puzzle choice and sampling)")
    _add_sudoku_search_args(s)
    s.add_argument(
        "--one-canvas",
        action="store_true",
        help="the model's first answer only: one canvas with the model's own sampler (up to 48 steps, adaptive stop)",
    )
    s.add_argument("--show-canvas", action="store_true", help="watch the grid fill in, step by step")
    s.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: puzzle, solution, solved, clues_kept, steps, attempts, settled, seconds",
    )
    s.set_defaults(func=cmd_sudoku)
