"""Build the Sudoku datasets: graded puzzles (train / validation / test, no solution grid shared between
splits), the training records of the small model's format (see dgemma/tasks/sudoku.py), and chat records
for fine-tuning the real model (recipes/sudoku-lora-26b.yaml).

    python recipes/sudoku_data.py [--train 100000] [--validation 1000] [--test 1000] [--out recipes/data/sudoku]

Deterministic for a given --seed; about 20 minutes for 100k puzzles on 2 cores.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    start = time.time()

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
