"""Does the shipped code model need its 48 steps? Held-out infilling (the spans of benchmarks/code_eval.py,
at their true length) under several sampler settings: exact match, parse rate, denoising steps per
canvas and tokens per forward, side by side on the same spans and seeds.

The code model's canvases never satisfy the checkpoint's stop rule (mean entropy under 0.005 with a
stable argmax): they run to the 48-step cap. The settings tried cap the steps, or loosen the stop rule's
entropy threshold so that a canvas stops once its draft is stable and its mean entropy low enough.

    python benchmarks/code_settle.py [--spans 40] [--code-data recipes/data/code] [--after CHECKPOINT]
        [--settings NAME ...]

`--after` adds a checkpoint (a stage-2 run, recipes/code-stage2-settle.yaml) measured on the same spans.

Needs the test files of recipes/code_data.py (or collects the test split from this Python's standard
library). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import code_eval
import torch

import dgemma
from dgemma.tasks import code

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "checkpoint (48-step cap, entropy < 0.005)": {},
    "cap 24": {"max_denoising_steps": 24},
    "cap 12": {"max_denoising_steps": 12},
    "cap 8": {"max_denoising_steps": 8},
    "stop at entropy < 0.1": {"confidence_threshold": 0.1},
    "stop at entropy < 0.3": {"confidence_threshold": 0.3},
    "cap 12, stop at entropy < 0.3": {"max_denoising_steps": 12, "confidence_threshold": 0.3},
    "cap 12, cooler (t 0.4 -> 0.2)": {"max_denoising_steps": 12, "t_max": 0.4, "t_min": 0.2},
    "cap 12, entropy bound 0.5": {"max_denoising_steps": 12, "entropy_bound": 0.5},
    "cap 12, cooler, bound 0.5": {"max_denoising_steps": 12, "t_max": 0.4, "t_min": 0.2, "entropy_bound": 0.5},
    "cap 12, warmer (t 1.0 -> 0.5)": {"max_denoising_steps": 12, "t_max": 1.0, "t_min": 0.5},
    "cap 12, entropy bound 0.05": {"max_denoising_steps": 12, "entropy_bound": 0.05},
    "cap 12, entropy bound 0.25": {"max_denoising_steps": 12, "entropy_bound": 0.25},
    "cap 12, entropy bound 1.0": {"max_denoising_steps": 12, "entropy_bound": 1.0},
}


def measure(model, tok, cases, settings: dict) -> dict:
    """Exact match, parse rate, steps per canvas, tokens per forward and seconds of `model` on `cases`."""
    exact = parses = steps = tokens = 0
    t0 = time.perf_counter()
    for _kind, text, a, b in cases:
        left, middle, suffix = code_eval.infill_inputs(tok, text, a, b, 192)
        r = dgemma.infill(model, left, suffix, middle_length=len(middle), tokenizer=tok, seed=0, **settings)
        exact += r.middle_text.strip() == text[a:b].strip()
        parses += code_eval.fill_parses(text, a, b, r.middle_text)
        steps += sum(r.result.stats.steps_per_canvas[0])
        tokens += len(middle)
    return {
        "exact": exact / len(cases),
        "parses": parses / len(cases),
        "steps_per_canvas": steps / len(cases),
        "tokens_per_forward": tokens / steps,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spans", type=int, default=40, help="spans per kind (line, expression, body)")
    ap.add_argument("--code-data", type=Path, default=ROOT / "recipes" / "data" / "code")
    ap.add_argument("--after", type=Path, action="append", default=[], help="another checkpoint to compare")
    ap.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS), metavar="NAME")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    tok = dgemma.Tokenizer.from_dir(code.MODEL_DIR)
    files = code_eval.load_test_files(args.code_data / "test.jsonl")
    chosen = code_eval.held_out_cases(files, random.Random(0), tok, 24, args.spans)
    cases = [c for group in chosen.values() for c in group]
    rows = {}
    for directory in [code.MODEL_DIR, *args.after]:
        model = dgemma.accelerate(dgemma.load(directory))
        label = "shipped" if directory == code.MODEL_DIR else str(directory)
        for name in args.settings:
            rows[f"{label}: {name}"] = measure(model, tok, cases, SETTINGS[name])
            print(f"  {label}: {name}: {rows[f'{label}: {name}']}", flush=True)
    print(f"\n{'model: settings':60s} {'exact':>7s} {'parses':>7s} {'steps':>6s} {'tok/fwd':>8s}")
    for name, r in rows.items():
        steps, tpf = r["steps_per_canvas"], r["tokens_per_forward"]
        print(f"{name:60s} {r['exact']:7.1%} {r['parses']:7.1%} {steps:6.1f} {tpf:8.2f}")
    print(json.dumps({"benchmark": "code_settle", "spans": len(cases), "rows": rows}))


if __name__ == "__main__":
    main()
