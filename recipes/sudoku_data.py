"""Build the Sudoku datasets: graded puzzles (train / validation / test, no solution grid shared between
splits), the training records of the small model's format (see dgemma/tasks/sudoku.py), and chat records
for fine-tuning the real model (recipes/sudoku-lora-26b.yaml).

    python recipes/sudoku_data.py [--train 100000] [--validation 1000] [--test 1000] [--out recipes/data/sudoku]
    python recipes/sudoku_data.py --augment 8     # + train-aug-records.jsonl: 8 symmetric copies of each
    python recipes/sudoku_data.py --levels medium,hard  # + train-medium-hard-records.jsonl: those levels only

Deterministic for a given --seed; about 20 minutes for 100k puzzles on 2 cores. Existing puzzle files are
kept (pass --force to regenerate them); --augment and --levels then only add their training records.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from dgemma.tasks import sudoku


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=100_000)
    parser.add_argument("--validation", type=int, default=1_000)
    parser.add_argument("--test", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "sudoku")
    parser.add_argument("--augment", type=int, default=0, help="also write K symmetric copies of each train puzzle")
    parser.add_argument(
        "--levels", default=None, help="also write the training puzzles of these levels only (comma-separated)"
    )
    parser.add_argument("--force", action="store_true", help="regenerate puzzles even if the files exist")
    args = parser.parse_args()
    levels = args.levels.split(",") if args.levels else []
    unknown = sorted(set(levels) - set(sudoku.LEVELS))
    if unknown:
        parser.error(f"unknown level(s) {unknown}: choose from {list(sudoku.LEVELS)}")
    start = time.time()
    if args.force or not (args.out / "train-records.jsonl").is_file():
        build(args, start)
    if args.augment:
        n = augment(args.out, args.augment, args.seed)
        print(f"{n} augmented training records in {time.time() - start:.0f} s", file=sys.stderr)
    if levels:
        n = select_levels(args.out, levels)
        print(f"{n} training records of levels {levels}", file=sys.stderr)


def select_levels(out: Path, levels: list[str]) -> int:
    """train-LEVELS.jsonl / train-LEVELS-records.jsonl: the training puzzles of the given levels, in order."""
    name = "train-" + "-".join(levels)
    n = 0
    with (out / "train.jsonl").open() as src, (out / f"{name}.jsonl").open("w") as dst:
        for line in src:
            if json.loads(line)["level"] in levels:
                dst.write(line)
                n += 1
    sudoku.to_training_jsonl(out / f"{name}.jsonl", out / f"{name}-records.jsonl", sudoku.make_tokenizer())
    return n


def augment(out: Path, copies: int, seed: int) -> int:
    """train-aug.jsonl / train-aug-records.jsonl: `copies` random symmetries of every training puzzle (the
    first copy is the puzzle itself), a deterministic function of the seed."""
    rng = random.Random(seed + 1)
    n = 0
    with (out / "train.jsonl").open() as src, (out / "train-aug.jsonl").open("w") as dst:
        for line in src:
            p = json.loads(line)
            for k in range(copies):
                puzzle, solution = (
                    (p["puzzle"], p["solution"]) if k == 0 else sudoku.transform(p["puzzle"], p["solution"], rng)
                )
                dst.write(json.dumps(p | {"puzzle": puzzle, "solution": solution}) + "\n")
                n += 1
    sudoku.to_training_jsonl(out / "train-aug.jsonl", out / "train-aug-records.jsonl", sudoku.make_tokenizer())
    return n


def build(args: argparse.Namespace, start: float) -> None:
    """Generate the puzzles and write every split's files."""

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total} puzzles, {time.time() - start:.0f} s", end="", file=sys.stderr, flush=True)

    counts = sudoku.build_dataset(
        args.out, args.train, args.validation, args.test, seed=args.seed, processes=args.processes, progress=progress
    )
    print(file=sys.stderr)
    tokenizer = sudoku.make_tokenizer()
    tokenizer.save(args.out / "tokenizer")
    for split in counts:
        sudoku.to_training_jsonl(args.out / f"{split}.jsonl", args.out / f"{split}-records.jsonl", tokenizer)
        sudoku.to_chat_jsonl(args.out / f"{split}.jsonl", args.out / f"{split}-chat.jsonl")  # the 26B LoRA
    print(f"{counts} in {time.time() - start:.0f} s -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
