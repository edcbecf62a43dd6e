"""Structured output measured: schema-valid rate and exact-field accuracy on held-out extraction, for the
diffusion fill against free generation + parse and against the same schema decoded left to right.

The task (dgemma/tasks/extract.py): a sentence about an order in, the order as JSON valid against
`extract.SCHEMA` out; the test orders (seeds 2,000,000 on) are never seen in training. Four ways to get
the JSON, on the same weights and prompt (the chat template's user turn):

- `fill`: dgemma.generate_json, the schema laid out as a canvas sized by a free draft, values denoised
  under their types' tokens (docs/structured.md); retried up to twice when a bound fails;
- `fill, schema budgets`: the same with `size="schema"`: holes sized by the schema's bounds alone;
- `free + parse`: dgemma.generate (the default sampler), then the first JSON object of the text,
  validated with jsonschema;
- `AR + schema`: dgemma.structured.generate_json_ar, the causal encoder decoding greedily under the
  schema's grammar, each token the likeliest that keeps the text a valid prefix (what a grammar engine
  does);
- `AR free + parse`: dgemma.generate_ar (greedy), then parse.

Per way: the share of answers that are valid JSON for the schema, the share of fields equal to the
truth (an invalid answer counts every field wrong), the share of answers with every field right, model
passes per answer (denoising steps for the diffusion ways, forward passes for the AR ones) and seconds.

    python recipes/extract_data.py && dgemma train recipes/extract-tiny.yaml   # or the shipped model
    python benchmarks/structured_eval.py [--model DIR] [--n 200] [--code-n 30]

`--code-n` also runs the shipped code model (not trained for this: validity is what it can show). Prints
a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

import dgemma
from dgemma.ar import generate_json_ar
from dgemma.generation.programs import generate_json
from dgemma.structured import StructuredOutputError, first_object
from dgemma.tasks import extract
from dgemma.tasks.code import MODEL_DIR as CODE_DIR

WAYS = ("fill", "fill, schema budgets", "free + parse", "AR + schema", "AR free + parse")


def _parsed(text: str):
    """The first JSON object in `text` valid against the schema, or None."""
    start = text.find("{")
    value, error = first_object(text[start:]) if start >= 0 else (None, "no object")
    if error is not None or not jsonschema.Draft202012Validator(extract.SCHEMA).is_valid(value):
        return None
    return value


def answer(way: str, model, tok, prompt: list[int], seed: int):
    """(value or None, model passes) of one way on one prompt."""
    canvas = model.config.canvas_length
    try:
        if way.startswith("fill"):
            size = "schema" if "budgets" in way else "draft"
            out = generate_json(model, prompt, extract.SCHEMA, tokenizer=tok, seed=seed, size=size)
            return out.value, out.steps
        if way == "AR + schema":
            out = generate_json_ar(model, prompt, extract.SCHEMA, tokenizer=tok)
            return out.value, out.steps
    except StructuredOutputError as e:  # no valid answer; the passes it took still count
        return None, e.steps
    if way == "free + parse":
        r = dgemma.generate(model, prompt, seed=seed, max_new_tokens=canvas)
        return _parsed(tok.decode(r.tokens[0])), sum(r.stats.steps_per_canvas[0])
    r = dgemma.generate_ar(model, prompt, canvas)
    return _parsed(tok.decode(r.tokens[0])), r.stats.decoder_forward_passes[0]


def evaluate(model_dir, n: int) -> dict[str, dict]:
    """The table's rows for one model on the first `n` test orders."""
    model, tok = dgemma.load(model_dir, dtype="fp32"), dgemma.Tokenizer.from_dir(model_dir)
    first = extract.SPLITS["test"][0]
    keys = list(extract.SCHEMA["properties"])
    rows = {}
    for way in WAYS:
        valid = fields = whole = passes = 0
        t0 = time.perf_counter()
        for i in range(n):
            sentence, truth = extract.example(first + i)
            prompt = tok.apply_chat_template(extract.messages(sentence), add_generation_prompt=True)
            value, used = answer(way, model, tok, prompt, seed=i)
            passes += used
            if value is None:
                continue
            valid += 1
            right = sum(value.get(k) == truth[k] for k in keys)
            fields += right
            whole += right == len(keys)
        seconds = time.perf_counter() - t0
        rows[way] = {
            "valid": valid / n,
            "field_accuracy": fields / (n * len(keys)),
            "all_fields": whole / n,
            "passes_per_answer": passes / n,
            "seconds_per_answer": seconds / n,
        }
        print(f"  {way}: {rows[way]}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(extract.MODEL_DIR))
    ap.add_argument("--n", type=int, default=200, help="held-out orders")
    ap.add_argument("--code-n", type=int, default=0, help="also the shipped code model, on this many")
    args = ap.parse_args()
    results = {"extract": evaluate(args.model, args.n)}
    if args.code_n:
        results["code"] = evaluate(CODE_DIR, args.code_n)
    print(f"\n{'model':8} {'way':21} {'valid':>7} {'fields':>7} {'all':>7} {'passes':>7} {'s/answer':>9}")
    for name, rows in results.items():
        for way, r in rows.items():
            print(
                f"{name:8} {way:21} {r['valid']:7.1%} {r['field_accuracy']:7.1%} {r['all_fields']:7.1%} "
                f"{r['passes_per_answer']:7.1f} {r['seconds_per_answer']:9.3f}"
            )
    print(json.dumps({"n": args.n, "code_n": args.code_n, **results}))


if __name__ == "__main__":
    main()
