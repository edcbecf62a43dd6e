"""The Shapes task's data (dgemma/tasks/shapes.py): pictures, chat records and the tokenizer.

python recipes/shapes_data.py          # recipes/data/shapes/: pics/, train/validation/test.jsonl, tokenizer/
dgemma train recipes/shapes-tiny.yaml  # the shipped vision-language model
"""

from __future__ import annotations

import sys
from pathlib import Path

from dgemma.tasks import shapes

ROOT = Path(__file__).resolve().parent / "data" / "shapes"


def main() -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    for split in shapes.SPLITS:
        path = shapes.write_split(ROOT, split)
        print(f"{path}: {shapes.SPLITS[split][1]} scenes", file=sys.stderr)
    shapes.make_tokenizer().save(ROOT / "tokenizer")
    print(f"{ROOT / 'tokenizer'}: tokenizer.json + chat template", file=sys.stderr)


if __name__ == "__main__":
    main()
