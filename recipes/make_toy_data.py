"""Write recipes/data/sort-{train,eval}.jsonl: sort four digits (token ids 10-19), answer three times."""

from __future__ import annotations

import json
import random
from pathlib import Path


def main() -> None:
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    rng = random.Random(0)
    for split, n in (("train", 2000), ("eval", 64)):
        with (out / f"sort-{split}.jsonl").open("w") as f:
            for _ in range(n):
                digits = [rng.randint(10, 19) for _ in range(4)]
                f.write(json.dumps({"prompt_ids": [2, *digits, 3], "completion_ids": sorted(digits) * 3}) + "\n")
    print(f"wrote {out}/sort-train.jsonl and sort-eval.jsonl")


if __name__ == "__main__":
    main()
