"""The GPU suite: the real 26B-A4B architecture with random bf16 weights on one GPU, measured end to end.

    benchmarks/gpu_suite.sh OUTDIR             # on the GPU machine (wraps this script; see there)
    python benchmarks/gpu_suite.py OUTDIR --dry-run   # the same suite, small preset, on this CPU

Records, into OUTDIR/gpu_suite.json and OUTDIR/gpu_suite.md:
1. the device's measured copy bandwidth and matmul rate, and its nominal figures when known;
2. transformers' DiffusionGemmaForBlockDiffusion built with random weights on the GPU, and a dgemma model
   that shares those very tensors (no second copy); one denoising step checked for equal logits;
3. transformers `generate` (diffusion) on them: seconds per denoising step and tokens/s;
4. dgemma (accelerated: grouped experts, CUDA graphs): time per step, the weight-read bound and achieved
   GB/s, tokens/s at 12 / 16 / 20 / 48 steps per canvas, time to first token, autoregressive decoding of
   the same weights (tokens/s), and the ratios; the same without CUDA graphs;
5. fp8 weights (dgemma.quant, _scaled_mm kernels) when the GPU has fp8: time per step and tokens/s.
Each stage is timed and logged as it goes; a stage that fails is recorded and the suite goes on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test helpers (tests/helpers.py)
from dgemma import accelerate
from dgemma.bench import machine_peaks, random_model, run_bench
from dgemma.model.presets import preset
from dgemma.model.sizes import count_parameters

START = time.perf_counter()


def log(text: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {text}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def same_logits(oracle, model, device: torch.device) -> float:
    """Max |difference| of one denoising step's logits, transformers vs dgemma, on the shared weights."""
    from transformers.cache_utils import DynamicCache

    vocab = model.text_config.vocab_size
    c = model.config.canvas_length
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, vocab, (1, 32), generator=g).to(device)
    canvas = torch.randint(0, vocab, (1, c), generator=g).to(device)
    pkv = DynamicCache(config=oracle.config.text_config)
    oracle.model.encoder(input_ids=ids, past_key_values=pkv)
    ref = oracle(past_key_values=pkv, decoder_input_ids=canvas).logits.float()
    cache = model.new_cache(1, 32 + c)
    model.encode(ids, cache)
    ours = model.denoise(canvas, cache).float()
    return (ours - ref).abs().max().item() / max(ref.abs().max().item(), 1e-9)


@torch.no_grad()
def transformers_generate(oracle, device: torch.device, steps: int, canvases: int, repeats: int) -> dict:
    """transformers' generate with exactly `steps` denoising steps per canvas: seconds per step, tokens/s."""
    c = oracle.config.canvas_length
    vocab = oracle.config.text_config.vocab_size
    prompt = torch.randint(8, vocab, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
    settings = dict(max_new_tokens=canvases * c, max_denoising_steps=steps, confidence_threshold=1e-30)

    def run(n_steps: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        oracle.generate(input_ids=prompt, **(settings | {"max_denoising_steps": n_steps}))
        sync(device)
        return time.perf_counter() - t0

    run(2)  # warm-up
    low = statistics.median(run(2) for _ in range(repeats))
    high = statistics.median(run(steps) for _ in range(repeats))
    step_s = (high - low) / (canvases * (steps - 2))
    return {"steps_per_canvas": steps, "seconds": high, "step_s": step_s, "tokens_per_s": canvases * c / high}


def stage(results: dict, name: str, fn):
    """Run one stage; record its result (or its error) and how long it took."""
    log(f"{name} ...")
    t0 = time.perf_counter()
    try:
        results[name] = fn()
        log(f"{name} done in {time.perf_counter() - t0:.1f} s")
    except Exception as e:  # a failed stage is recorded, the others still run
        results[name] = {"error": f"{type(e).__name__}: {e}"}
        log(f"{name} FAILED: {e}\n{traceback.format_exc()}")
    results.setdefault("stage_seconds", {})[name] = time.perf_counter() - t0
    return results[name]


def bench_row(r) -> dict:
    out = r.to_json()
    out["bound_s"] = r.step_bytes["total"] / (1e9 * (r.peaks.get("nominal_gbps") or r.peaks["copy_gbps"]))
    return out


def markdown(results: dict) -> str:
    """The suite's results as a markdown section for BENCHMARKS.md."""
    m = results["machine"]
    lines = [
        f"### {results['preset']} (random {results['dtype']} weights), {m['device']}, {results['date']}",
        "",
        f"torch {results['torch']}, transformers {results.get('transformers', '-')}; batch 1, canvas "
        f"{results['canvas']}, prompt 64 tokens; {results['params'] / 1e9:.2g}B parameters "
        f"({results['active_params'] / 1e9:.2g}B active). Device: copy {m['copy_gbps']:.0f} GB/s, "
        f"{m['matmul_dtype']} matmul {m['matmul_tflops']:.3g} TFLOP/s (measured)"
        + (f"; nominal {m['nominal_gbps']:.0f} GB/s" if m.get("nominal_gbps") else "")
        + f". Logits vs transformers on the shared weights: max |diff| / max |logit| = {results.get('parity', '-')}.",
        "",
        "| engine | ms / step | weight-read bound | x bound | GB/s | "
        + " | ".join(f"tok/s @{s}" for s in results["steps"])
        + " | AR tok/s | TTFT @16 s |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(results["steps"]) + "---:|---:|",
    ]
    for name in ("dgemma", "dgemma (no CUDA graphs)", "dgemma fp8"):
        r = results.get(name)
        if not isinstance(r, dict) or "error" in r:
            if isinstance(r, dict):
                lines.append(f"| {name} | failed: {r['error'][:80]} |")
            continue
        tps = {p["steps"]: p for p in r["points"]}
        lines.append(
            f"| {name} | {1000 * r['step_s']:.2f} | {1000 * r['bound_s']:.2f} | {r['step_s'] / r['bound_s']:.2f} | "
            f"{r['step_gbps']:.0f} | "
            + " | ".join(f"{tps[s]['tokens_per_s']:.0f}" if s in tps else "-" for s in results["steps"])
            + f" | {r['ar_tokens_per_s']:.0f} | "
            + (f"{tps[16]['time_to_first_token']:.3f}" if 16 in tps else "-")
            + " |"
        )
    hf = results.get("transformers generate")
    if isinstance(hf, dict) and "error" not in hf:
        lines.append(
            f"| transformers generate | {1000 * hf['step_s']:.2f} | | | | "
            + " | ".join(f"{hf['tokens_per_s']:.0f}" if s == hf["steps_per_canvas"] else "-" for s in results["steps"])
            + " | | |"
        )
    ours = results.get("dgemma")
    if isinstance(ours, dict) and "error" not in ours:
        lines += ["", f"- crossover: diffusion beats AR below {ours['crossover_steps']:.1f} steps per canvas"]
        at16 = {p["steps"]: p for p in ours["points"]}.get(16)
        if at16:
            lines.append(f"- at 16 steps per canvas: {at16['tokens_per_s'] / ours['ar_tokens_per_s']:.2f}x AR tokens/s")
        if isinstance(hf, dict) and "error" not in hf:
            lines.append(f"- time per step vs transformers generate: {hf['step_s'] / ours['step_s']:.1f}x faster")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--dry-run", action="store_true", help="small preset on this machine's CPU")
    parser.add_argument("--preset", default=None, help="default: 26b-a4b (small with --dry-run)")
    parser.add_argument("--steps", default="12,16,20,48", help="fixed steps per canvas to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--engines", default="graphs,eager,fp8", help="dgemma stages to run: graphs, eager (no CUDA graphs), fp8"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.dry_run:
        sys.exit("gpu_suite: no CUDA device; use --dry-run to exercise the suite on CPU")
    name = args.preset or ("small" if args.dry_run else "26b-a4b")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    steps = sorted({int(s) for s in args.steps.split(",")})
    if args.dry_run:
        steps, args.repeats = [1, 2, 4], 1
    config = preset(name)
    counts = count_parameters(config)
    results: dict = {
        "benchmark": "gpu_suite",
        "date": time.strftime("%Y-%m-%d"),
        "preset": name,
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "canvas": config.canvas_length,
        "params": counts["total"],
        "active_params": counts["active"],
        "steps": steps,
        "dry_run": args.dry_run,
    }
    stage(results, "machine", lambda: machine_peaks(device, dtype))
    if "error" in results["machine"]:
        sys.exit("gpu_suite: could not measure the device (see the log above)")

    model = oracle = None
    if not args.skip_transformers:
        import transformers

        results["transformers"] = transformers.__version__
        from helpers import model_sharing_oracle_weights, oracle_from_config

        def build_pair():
            nonlocal model, oracle
            oracle = oracle_from_config(config, device=device, dtype=dtype)
            model = model_sharing_oracle_weights(oracle, config)
            return {"gib_allocated": torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None}

        stage(results, "build (transformers, shared with dgemma)", build_pair)
        if model is not None:
            results["parity"] = stage(results, "parity", lambda: f"{same_logits(oracle, model, device):.2e}")
            stage(
                results,
                "transformers generate",
                lambda: transformers_generate(oracle, device, 16 if not args.dry_run else 4, 2, args.repeats),
            )
    if model is None:

        def build_ours():
            nonlocal model
            model = random_model(name, device=device, dtype=dtype)
            return {"gib_allocated": torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None}

        stage(results, "build (dgemma)", build_ours)
        if model is None:
            sys.exit("gpu_suite: could not build the model (see the log above)")
    oracle = None
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def measure(label: str, **accel):
        runner = accelerate(model, **accel)
        r = run_bench(runner, steps=steps, canvases=2, repeats=args.repeats, progress=log)
        r.peaks = results["machine"]
        return bench_row(r)

    engines = set(args.engines.split(","))
    if "graphs" in engines:
        stage(results, "dgemma", lambda: measure("dgemma"))
    if "eager" in engines:
        stage(results, "dgemma (no CUDA graphs)", lambda: measure("no graphs", graphs=False))
    fp8 = "fp8" in engines and (device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9))
    if fp8:

        def quantized():
            from dgemma.quant import quantize_model

            quantize_model(model, "fp8")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            r = run_bench(
                accelerate(model),
                steps=[s for s in steps if s in (16, 48)] or steps,
                canvases=2,
                repeats=1,
                progress=log,
            )
            r.peaks = results["machine"]
            return bench_row(r)

        stage(results, "dgemma fp8", quantized)
    results["total_seconds"] = time.perf_counter() - START
    table = markdown(results)
    (args.out / "gpu_suite.md").write_text(table)
    (args.out / "gpu_suite.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
