"""How much weight-only quantization changes a model: each mode and file format against full precision.

Modes: dgemma's own int8, int4, fp8 and nvfp4 (quantized while loading; int8 dequantized for fp32
products, as on CPUs without int8 dot products, where `--quant int8` runs `int8-w8a8` instead); `ct-*`, a
round trip through a compressed-tensors checkpoint (quantized, written with --format compressed-tensors,
loaded back: what vLLM would serve; int4 there is W4A16, q * scale); `gguf-*`, a round trip through a
GGUF file of that type (written from the fp32 model by gguf's quantizers, loaded back); `nvfp4-w4a4`,
nvfp4 weights with the activations quantized to NVFP4 too, as the native FP4 kernel runs on Blackwell
(emulated here); `bf16`, weights and compute in bf16 (not a quantization: what `--dtype bf16` runs);
`int8-w8a8`, int8 weights with the activations quantized per token, as the integer matmul
(`torch._int_mm`) runs them.

1. The `small` preset with random weights (73M parameters): per-position KL(full || quantized) of the
   denoising logits and argmax agreement, on random prompts and half-noised canvases.
2. The shipped Sudoku model: the same logit measures, and the exact-solve rate on held-out puzzles with
   the default sampler (same seeds for every mode, so the comparison is paired).
3. The shipped code model: the logit measures on validation canvases, and held-out infilling (exact
   match and parse rate of the reassembled file, the spans of benchmarks/code_eval.py, given length).

    python benchmarks/quant_quality.py [--puzzles 1000] [--spans 20] [--modes int8 int4 fp8 nvfp4 ...]

Needs the data of recipes/sudoku_data.py and recipes/code_data.py for parts 2 and 3 (skipped without).
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dgemma
from dgemma.checkpoints.gguf_file import write as write_gguf
from dgemma.quant import QuantSpec, quantize_model, use_kernels
from dgemma.tasks import code, sudoku

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


@torch.no_grad()
def denoise_logits(model, cases: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Logits of one denoising pass for each (prompt, canvas) case, concatenated over positions."""
    out = []
    for prompt, canvas in cases:
        cache = model.new_cache(batch_size=1, max_length=len(prompt) + len(canvas))
        model.encode(torch.tensor([prompt]), cache)
        out.append(model.denoise(torch.tensor([canvas]), cache)[0])
    return torch.cat(out)


def logit_gap(full: torch.Tensor, quant: torch.Tensor) -> dict:
    kl = F.kl_div(quant.log_softmax(-1), full.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return {"kl": kl.mean().item(), "argmax_agreement": (full.argmax(-1) == quant.argmax(-1)).float().mean().item()}


def noised(canvas: list[int], vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(vocab) if rng.random() < 0.5 else t for t in canvas]


def random_cases(vocab: int, canvas: int, n: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    return [
        ([rng.randrange(vocab) for _ in range(32)], [rng.randrange(vocab) for _ in range(canvas)]) for _ in range(n)
    ]


CT = {
    "ct-fp8": QuantSpec.of("fp8"),
    "ct-int4": QuantSpec.of("int4", 32, "symmetric"),
    "ct-nvfp4": QuantSpec.of("nvfp4"),
}
MODES = [
    "int8",
    "int4",
    "fp8",
    "nvfp4",
    "nvfp4-w4a4",
    *CT,
    "gguf-bf16",
    "gguf-q8_0",
    "gguf-q5_0",
    "gguf-q4_0",
    "bf16",
    "int8-w8a8",
]


def load_mode(path: Path, mode: str):
    """The model at `path` as `mode` gives it (see the module docstring)."""
    if mode == "fp32":
        return dgemma.load(path)
    if mode in CT:
        with tempfile.TemporaryDirectory() as tmp:
            dgemma.save(dgemma.load(path, quant=CT[mode]), tmp, format="compressed-tensors")
            return dgemma.load(tmp)
    if mode.startswith("gguf-"):
        with tempfile.TemporaryDirectory() as tmp:
            return dgemma.load(write_gguf(dgemma.load(path), Path(tmp) / "m.gguf", mode.removeprefix("gguf-")))
    if mode == "nvfp4-w4a4":
        return use_kernels(dgemma.load(path, quant="nvfp4"), fp4=True)
    if mode == "bf16":  # not a quantization: weights and compute in bf16 (the CPU's bf16 matmuls, where it has them)
        return dgemma.load(path, dtype="bf16")
    if mode == "int8-w8a8":  # int8 weights and per-token int8 activations: the integer matmul (torch._int_mm)
        return use_kernels(dgemma.load(path, quant="int8"))
    return dgemma.load(path, quant=mode)


def quantize_random(config, mode: str):
    """The random `small` model in `mode` (file formats by a round trip through a checkpoint)."""
    if mode == "nvfp4-w4a4":
        return use_kernels(quantize_model(dgemma.build(config, seed=0), "nvfp4"), fp4=True)
    if mode == "bf16":
        return dgemma.build(config, seed=0).to(torch.bfloat16)
    if mode == "int8-w8a8":
        return use_kernels(quantize_model(dgemma.build(config, seed=0), "int8"))
    if mode not in CT and not mode.startswith("gguf-"):
        return quantize_model(dgemma.build(config, seed=0), mode)
    with tempfile.TemporaryDirectory() as tmp:
        dgemma.save(dgemma.build(config, seed=0), tmp)
        return load_mode(Path(tmp), mode)


def per_mode(name: str, path: Path, modes: list[str], cases, task) -> dict[str, dict]:
    """For each mode: load the model so, its logit gap to the first mode (fp32) and `task(model)`."""
    out, full = {}, None
    for mode in modes:
        model = dgemma.accelerate(load_mode(path, mode))
        if mode == "int8":  # dequantized, as the docstring says: the twin runs W8A8 where the CPU can
            use_kernels(model.fast, enable=False)
        logits = denoise_logits(model, cases)
        full = logits if full is None else full
        out[mode] = ({} if logits is full else logit_gap(full, logits)) | task(model)
        print(f"{name} {mode}: {out[mode]}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--puzzles", type=int, default=1000, help="held-out Sudoku puzzles (default 1000)")
    ap.add_argument("--spans", type=int, default=20, help="infilling spans per kind (default 20)")
    ap.add_argument("--canvases", type=int, default=32, help="canvases for the logit measures")
    ap.add_argument("--sudoku-data", type=Path, default=ROOT / "recipes" / "data" / "sudoku" / "test.jsonl")
    ap.add_argument("--code-data", type=Path, default=ROOT / "recipes" / "data" / "code")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    modes = ["fp32", *args.modes]
    rows: dict[str, dict[str, dict]] = {}
    rng = random.Random(0)

    # 1. small preset, random weights
    config = dgemma.preset("small")
    cases = random_cases(config.text_config.vocab_size, config.canvas_length, 4, rng)
    full = denoise_logits(dgemma.build(config, seed=0), cases)
    rows["small (random)"] = {}
    for mode in args.modes:
        rows["small (random)"][mode] = logit_gap(full, denoise_logits(quantize_random(config, mode), cases))
    print("small preset done", file=sys.stderr)

    # 2. the Sudoku model
    if args.sudoku_data.is_file():
        puzzles = [json.loads(line) for line in args.sudoku_data.read_text().splitlines()][: args.puzzles]
        tok = dgemma.Tokenizer.from_dir(sudoku.MODEL_DIR)
        cases = [
            (sudoku.prompt_ids(tok, p["puzzle"]), noised(sudoku.solution_ids(tok, p["solution"]), 15, rng))
            for p in puzzles[: args.canvases]
        ]

        def solve_rate(model) -> dict:
            t = time.perf_counter()
            solved = 0
            for a in range(0, len(puzzles), 50):
                group = [p["puzzle"] for p in puzzles[a : a + 50]]
                solved += sum(s.solved for s in sudoku.solve_batch(model, tok, group, seed=0))
            return {"solve_rate": solved / len(puzzles), "puzzles": len(puzzles), "seconds": time.perf_counter() - t}

        rows["sudoku"] = per_mode("sudoku", sudoku.MODEL_DIR, modes, cases, solve_rate)

    # 3. the code model
    if (args.code_data / "test.jsonl").is_file():
        import code_eval

        tok = dgemma.Tokenizer.from_dir(code.MODEL_DIR)
        records = [json.loads(line) for line in (args.code_data / "validation-records.jsonl").open()][: args.canvases]
        cases = [(r["prompt_ids"], noised(r["completion_ids"], 4096, rng)) for r in records]
        files = [json.loads(line) for line in (args.code_data / "test.jsonl").read_text().splitlines()]
        srng = random.Random(0)
        spans = [
            (f["text"], a, b) for f in files for kind, a, b in code_eval.spans(f["text"], srng, tok, 24, per_kind=3)
        ]
        srng.shuffle(spans)
        spans = spans[: 3 * args.spans]

        def infill_score(model) -> dict:
            exact = parses = 0
            for text, a, b in spans:
                middle = tok.encode(text[a:b], add_special_tokens=False)
                left = tok.encode(text[:a], add_special_tokens=False)[-192:] or [tok.bos_token_id]
                suffix = tok.encode(text[b:], add_special_tokens=False)
                r = dgemma.infill(model, left, suffix, middle_length=len(middle), tokenizer=tok, seed=0)
                score = code_eval._score(text, a, b, r.middle_text, text[a:b].strip(), r.result.stats)
                exact += score["exact"]
                parses += score["parses"]
            return {"infill_exact": exact / len(spans), "infill_parses": parses / len(spans), "spans": len(spans)}

        rows["code"] = per_mode("code", code.MODEL_DIR, modes, cases, infill_score)

    print("| model | mode | KL (nats/position) | argmax agreement | task score |")
    print("|---|---|---:|---:|---|")
    for name, by_mode in rows.items():
        for mode, e in by_mode.items():
            kl = f"{e['kl']:.4f}" if "kl" in e else "-"
            agree = f"{e['argmax_agreement']:.1%}" if "argmax_agreement" in e else "-"
            if "solve_rate" in e:
                task = f"solve rate {e['solve_rate']:.1%} ({e['puzzles']} puzzles)"
            elif "infill_exact" in e:
                task = f"infill exact {e['infill_exact']:.1%}, parses {e['infill_parses']:.1%} ({e['spans']} spans)"
            else:
                task = "-"
            print(f"| {name} | {mode} | {kl} | {agree} | {task} |")
    print(json.dumps({"benchmark": "quant_quality", "results": rows}))


if __name__ == "__main__":
    main()
