"""The shipped vision-language model on held-out Shapes scenes, against baselines that cannot see the image.

For each test scene (dgemma/tasks/shapes.py: 400 scenes, seeds disjoint from training), the model answers
its question (colour or shape). Baselines: the best text-only answer (the most frequent training answer
for that question: the answers are uniform, so this is chance) and the same model shown a blank picture
of the scene's background (what it says when the image carries no information).

Prints a table and ends with one JSON line. Run: python benchmarks/shapes_eval.py [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

import dgemma
from dgemma.tasks import shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=shapes.MODEL_DIR)
    parser.add_argument("--scenes", type=int, default=shapes.SPLITS["test"][1])
    args = parser.parse_args()
    from PIL import Image

    model = dgemma.load(args.model)
    tok = dgemma.Tokenizer.from_dir(args.model)
    runner = dgemma.accelerate(model)
    train_first, train_count = shapes.SPLITS["train"]
    majority = {}
    for kind in shapes.QUESTIONS:
        seeds = [s for s in range(train_first, train_first + train_count) if shapes.question_of(s) == kind]
        answers = Counter(shapes.scene(s)[2] if kind == "colour" else shapes.scene(s)[1] for s in seeds)
        majority[kind] = answers.most_common(1)[0][0]
    right = {k: Counter() for k in shapes.QUESTIONS}
    t0 = time.perf_counter()
    first = shapes.SPLITS["test"][0]
    with torch.no_grad():
        for seed in range(first, first + args.scenes):
            image, shape, colour = shapes.scene(seed)
            kind = shapes.question_of(seed)
            truth = colour if kind == "colour" else shape
            blank = Image.new("RGB", image.size, image.getpixel((0, 0)))
            right[kind]["n"] += 1
            right[kind]["model"] += shapes.answer(runner, tok, image, kind) == truth
            right[kind]["blank"] += shapes.answer(runner, tok, blank, kind) == truth
            right[kind]["text-only"] += majority[kind] == truth
    seconds = time.perf_counter() - t0
    rows = {}
    print(f"model: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
    print(f"{'question':10s} {'scenes':>6s} {'model':>7s} {'blank image':>12s} {'text-only':>10s}")
    for kind, c in right.items():
        rows[kind] = {k: c[k] / max(c["n"], 1) for k in ("model", "blank", "text-only")} | {"scenes": c["n"]}
        r = rows[kind]
        print(f"{kind:10s} {c['n']:6d} {r['model']:7.1%} {r['blank']:12.1%} {r['text-only']:10.1%}")
    n = sum(c["n"] for c in right.values())
    overall = {k: sum(c[k] for c in right.values()) / n for k in ("model", "blank", "text-only")}
    print(f"{'all':10s} {n:6d} {overall['model']:7.1%} {overall['blank']:12.1%} {overall['text-only']:10.1%}")
    print(f"({seconds:.0f} s for {2 * n} answers)")
    print(
        json.dumps(
            {"benchmark": "shapes_eval", "model": str(args.model), "rows": rows, "all": overall, "seconds": seconds}
        )
    )


if __name__ == "__main__":
    main()
