"""The Extract task's data (dgemma/tasks/extract.py): chat records and the tokenizer.

python recipes/extract_data.py           # recipes/data/extract/: train/validation/test.jsonl, tokenizer/ (seconds)
dgemma train recipes/extract-tiny.yaml   # the shipped extraction model
"""

from __future__ import annotations

import sys
from pathlib import Path

from dgemma.tasks import extract

ROOT = Path(__file__).resolve().parent / "data" / "extract"


def main() -> None:
    for split in extract.SPLITS:
        path = extract.write_split(ROOT, split)
        print(f"{path}: {extract.SPLITS[split][1]} orders", file=sys.stderr)
    extract.make_tokenizer().save(ROOT / "tokenizer")
    print(f"{ROOT / 'tokenizer'}: tokenizer.json + chat template", file=sys.stderr)


if __name__ == "__main__":
    main()
