"""LoRA over a quantized frozen base learns as LoRA over the unquantized one does: Sudoku, side by side.

recipes/sudoku-qlora-tiny.yaml (LoRA rank 8 on the shipped Sudoku model's attention and MLP) is trained
three times from the same seed, over the fp32 weights and over the same weights quantized to int4 and
to NVFP4 (model.quant: the base stays quantized, only the adapters train). For each: the training loss
(mean over windows of steps), the held-out loss at the recipe's eval steps, and the exact-solve rate on
held-out puzzles before and after, with the default sampler and the same seeds (paired).

    python recipes/sudoku_data.py --train 20000 --validation 500 --test 0
    python recipes/sudoku_data.py --train 0 --validation 0 --test 1000 --seed 777 --out /tmp/sudoku-test
    python benchmarks/qlora_sudoku.py --test /tmp/sudoku-test/test.jsonl [--steps 400] [--batch-size 32]
        [--bases fp32 int4 nvfp4] [--puzzles 1000]

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml

import dgemma
from dgemma.tasks import sudoku
from dgemma.train.config import TrainConfig
from dgemma.train.lora import base_model, load_adapter
from dgemma.train.trainer import train

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "sudoku-qlora-tiny.yaml"


def solve_rate(model, tok, puzzles: list[dict]) -> float:
    solved = 0
    for a in range(0, len(puzzles), 50):
        group = [p["puzzle"] for p in puzzles[a : a + 50]]
        solved += sum(s.solved for s in sudoku.solve_batch(model, tok, group, seed=0))
    return solved / len(puzzles)


def run(base: str, steps: int, batch_size: int, out: Path, puzzles: list[dict], tok) -> dict:
    """Train the recipe over `base` ("fp32" or a quantization mode); its curves and solve rates."""
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["model"]["quant"] = None if base == "fp32" else base
    recipe["train"] |= {"steps": steps, "batch_size": batch_size, "save_every": steps, "out_dir": str(out / base)}
    result = train(TrainConfig.from_dict(recipe, base_dir=RECIPE.parent), progress=False)
    log = [json.loads(line) for line in (out / base / "log.jsonl").read_text().splitlines()]
    quant = None if base == "fp32" else base
    torch.set_grad_enabled(False)
    before = solve_rate(dgemma.load(sudoku.MODEL_DIR, quant=quant), tok, puzzles)
    # the adapters unmerged, over the base as it was trained (quantized or not)
    adapted = base_model(load_adapter(dgemma.load(sudoku.MODEL_DIR, quant=quant), result.final_dir, merge=False))
    after = solve_rate(adapted.eval(), tok, puzzles)
    torch.set_grad_enabled(True)
    return {
        "losses": result.losses,
        "eval": {r["step"]: r["eval_loss"] for r in log if "eval_loss" in r},
        "solve_before": before,
        "solve_after": after,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--test", type=Path, required=True, help="held-out puzzles (jsonl with puzzle, solution)")
    ap.add_argument("--puzzles", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--bases", nargs="+", default=["fp32", "int4", "nvfp4"])
    ap.add_argument("--window", type=int, default=25, help="training steps per row of the loss table")
    args = ap.parse_args()
    puzzles = [json.loads(line) for line in args.test.read_text().splitlines()][: args.puzzles]
    tok = dgemma.Tokenizer.from_dir(sudoku.MODEL_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for base in args.bases:
            runs[base] = run(base, args.steps, args.batch_size, Path(tmp), puzzles, tok)
            print(f"{base}: solve {runs[base]['solve_before']:.1%} -> {runs[base]['solve_after']:.1%}", file=sys.stderr)
    print("| steps | " + " | ".join(f"train loss, {b} base" for b in args.bases) + " |")
    print("|---|" + "---:|" * len(args.bases))
    for a in range(0, args.steps, args.window):
        means = [sum(r["losses"][a : a + args.window]) / len(r["losses"][a : a + args.window]) for r in runs.values()]
        print(f"| {a + 1}-{min(a + args.window, args.steps)} | " + " | ".join(f"{m:.4f}" for m in means) + " |")
    print()
    print("| held-out | " + " | ".join(args.bases) + " |")
    print("|---|" + "---:|" * len(args.bases))
    for step in runs[args.bases[0]]["eval"]:
        print(f"| eval loss at step {step} | " + " | ".join(f"{r['eval'][step]:.4f}" for r in runs.values()) + " |")
    for key, label in (("solve_before", "solve rate, base alone"), ("solve_after", "solve rate, base + LoRA")):
        print(f"| {label} ({len(puzzles)} puzzles) | " + " | ".join(f"{r[key]:.1%}" for r in runs.values()) + " |")
    print(json.dumps({"benchmark": "qlora_sudoku", "steps": args.steps, "runs": runs}))


if __name__ == "__main__":
    main()
