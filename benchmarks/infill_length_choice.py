"""How `dgemma infill` should pick the middle's length: an experiment on the shipped code model.

`middle_length="auto"` fills the middle at 2, 4, 8, 16, 32 tokens and keeps one. This script compares
three ways of choosing, on the first --spans held-out spans of each kind of benchmarks/code_eval.py:
the denoiser's score of each completed canvas (`length_score="denoiser"`), and the encoder's own
next-token log-likelihood of the middle and the first 32 suffix tokens after the prefix, summed or
averaged per token (the mean is infill's default, `length_score="encoder"`). Prints exact / parses per
kind and method, then one JSON line.

    python benchmarks/infill_length_choice.py [--spans 40]      # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import code_eval

import dgemma
from dgemma import editing
from dgemma.generation.engine import score
from dgemma.tasks import code

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("denoiser", "encoder_sum", "encoder_mean")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "dgemma" / "models" / "code")
    ap.add_argument("--data", type=Path, default=ROOT / "recipes" / "data" / "code" / "test.jsonl")
    ap.add_argument("--spans", type=int, default=40, help="spans per kind (default 40)")
    args = ap.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"{args.data} not found: build it with python recipes/code_data.py")
    model, tok = dgemma.load(args.model), dgemma.Tokenizer.from_dir(args.model)
    model = dgemma.accelerate(model)
    files = [json.loads(line) for line in args.data.read_text().splitlines()]
    # the same spans, in the same order, as code_eval.py (its default seed and longest middle)
    by_kind = code_eval.held_out_cases(files, random.Random(0), tok, 24, args.spans)
    chosen = [c for group in by_kind.values() for c in group]
    res = {k: {m: [0, 0, 0] for m in METHODS} for k in code.SPAN_KINDS}  # exact, parses, n
    t0 = time.perf_counter()
    for kind, text, a, b in chosen:
        prompt, _, suffix = code_eval.infill_inputs(tok, text, a, b, 192)
        # every candidate in one batch, and the denoiser's pick
        r = dgemma.infill(model, prompt, suffix, middle_length="auto", length_score="denoiser", seed=0)
        lengths = list(r.scores)
        # each candidate as infill scores it: cut at its first end-of-text, then the suffix and the end
        fills = [editing.cut_at_end(model, r.result.tokens[i][:n]) for i, n in enumerate(lengths)]
        after = suffix + editing.end_of_text_ids(model)[:1]
        suffixed = [f + after[: editing.SCORED_SUFFIX] for f in fills]
        enc = score(model, prompt, suffixed).logprobs
        picks = {
            "denoiser": lengths.index(r.middle_length),
            "encoder_sum": max(range(len(lengths)), key=lambda i: float(enc[i].sum())),
            "encoder_mean": max(range(len(lengths)), key=lambda i: float(enc[i].mean())),
        }
        for method, i in picks.items():
            s = code_eval._score(text, a, b, tok.decode(fills[i]), text[a:b].strip(), r.result.stats)
            row = res[kind][method]
            row[0], row[1], row[2] = row[0] + s["exact"], row[1] + s["parses"], row[2] + 1
    print(f"{len(chosen)} spans, {time.perf_counter() - t0:.0f} s\n")
    print("| span | n | " + " | ".join(METHODS) + " |")
    print("|---|---:|" + "---:|" * len(METHODS))
    for kind in code.SPAN_KINDS:
        n = res[kind][METHODS[0]][2]
        print(f"| {kind} | {n} | " + " | ".join(f"{res[kind][m][0]} / {res[kind][m][1]}" for m in METHODS) + " |")
    print("(exact matches / files that parse)")
    print(json.dumps({"benchmark": "infill_length_choice", "results": res}))


if __name__ == "__main__":
    main()
