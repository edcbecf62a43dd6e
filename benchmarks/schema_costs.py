"""What structured output costs per schema class: the client matrix's nine Pydantic models (nested,
Optional, Enum, Literal, a list of models, a union, dates and UUIDs, a recursive model, email/IPv4/pattern)
through the library on the shipped extraction model, against free generation of the same prompt.

Per model and way (`draft`: the values sized by a free draft, the default; `schema`: by the schema's
bounds, its unions chosen by the encoder's scores): the share of answers Pydantic accepts, the answer's
template in tokens, fills run (1 + retries), denoising steps (the draft's included) and seconds per answer;
`free` is dgemma.generate of a canvas on the same prompt (its steps and seconds: what one unconstrained
answer costs). Each over `--seeds` seeds, one after another on this machine's cores.

    python benchmarks/schema_costs.py [--seeds 5] [--steps 6]

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from client_schemas import MODELS, PROMPT

import dgemma
from dgemma.generation.programs import generate_json
from dgemma.structured import StructuredOutputError
from dgemma.tasks.extract import MODEL_DIR


def measure(model, tok, prompt: list[int], model_class, size: str, seeds: int, steps: int) -> dict:
    """One row: `size` ("draft", "schema", or "free") of `model_class` over `seeds` seeds."""
    valid = tokens = fills = denoising = 0
    t0 = time.perf_counter()
    for seed in range(seeds):
        if size == "free":
            r = dgemma.generate(model, prompt, seed=seed, max_denoising_steps=steps)
            denoising += sum(r.stats.steps_per_canvas[0])
            continue
        try:
            out = generate_json(
                model, prompt, model_class.model_json_schema(), tokenizer=tok, seed=seed, size=size,
                max_denoising_steps=steps,
            )  # fmt: skip
        except StructuredOutputError as e:
            denoising += e.steps
            continue
        valid += model_class.model_validate(out.value) is not None
        tokens += len(tok.encode(out.text, add_special_tokens=False))
        fills, denoising = fills + out.attempts, denoising + out.steps
    seconds = (time.perf_counter() - t0) / seeds
    row = {"model": model_class.__name__, "way": size, "steps": denoising / seeds, "seconds": round(seconds, 4)}
    if size != "free":
        row |= {"valid": valid / seeds, "answer_tokens": tokens / max(valid, 1), "fills": fills / max(valid, 1)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="answers per model and way")
    parser.add_argument("--steps", type=int, default=6, help="max_denoising_steps")
    args = parser.parse_args()
    model, tok = dgemma.load(MODEL_DIR), dgemma.Tokenizer.from_dir(MODEL_DIR)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    rows = []
    for model_class in MODELS:
        for size in ("draft", "schema", "free"):
            rows.append(measure(model, tok, prompt, model_class, size, args.seeds, args.steps))
            print(rows[-1], flush=True)
    print("\n| model | valid (draft / schema) | answer tokens | fills | steps (draft / schema / free) "
          "| s per answer (draft / schema / free) |\n|---|---|---:|---:|---|---|")  # fmt: skip
    for model_class in MODELS:
        d, s, f = (r for r in rows if r["model"] == model_class.__name__)
        print(f"| {d['model']} | {d['valid']:.0%} / {s['valid']:.0%} | {d['answer_tokens']:.0f} | {d['fills']:.2f} "
              f"| {d['steps']:.1f} / {s['steps']:.1f} / {f['steps']:.1f} "
              f"| {d['seconds']:.3f} / {s['seconds']:.3f} / {f['seconds']:.3f} |")  # fmt: skip
    print(json.dumps({"benchmark": "schema_costs", "seeds": args.seeds, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
