"""Generation speed: dgemma (exact and fast modes) vs transformers' generate, and diffusion vs AR decoding.

Same random weights (built by transformers, loaded by dgemma), same prompt, same settings, one process,
warm, on the `tiny` (canvas 32) and `small` (~70M parameters, 32k vocabulary, canvas 256) presets. The
adaptive stop is disabled (random weights never become confident anyway) so every canvas runs the same
number of denoising steps in every engine. Peak memory is the most tensor storage alive at once during a
generation, counted op by op (a TorchDispatchMode): everything allocated beyond the model's weights,
the KV cache included.

Prints a table and ends with one JSON line. Run: python benchmarks/generate_speed.py [--sizes tiny small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test helpers (tests/helpers.py)
from _measure import add_glibc_defaults_flag, keep_glibc_defaults, matmul_gflops, peak_tensor_mb
from helpers import TINY_VISION, load_quiet

import dgemma
from dgemma import accelerate
from dgemma.ar import generate_ar
from dgemma.bench import step_flops
from dgemma.model.presets import preset

SIZES = {
    # preset, canvas length, denoising steps per canvas, prompt length, canvases, repeats
    "tiny": dict(preset="tiny", canvas=32, steps=16, prompt=32, canvases=2, repeats=25),
    "small": dict(preset="small", canvas=256, steps=4, prompt=64, canvases=1, repeats=5),
}


def build_pair(size: dict, directory: Path):
    from transformers import DiffusionGemmaConfig as HFConfig
    from transformers import DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig

    config = preset(size["preset"])
    text = config.text_config.to_dict()
    text.pop("model_type")
    hf = HFConfig(text_config=DiffusionGemmaTextConfig(**text), vision_config=TINY_VISION, canvas_length=size["canvas"])
    torch.manual_seed(0)
    oracle = DiffusionGemmaForBlockDiffusion(hf).eval()
    oracle.save_pretrained(directory)
    return oracle, load_quiet(directory, dtype="fp32")


def timed(fn, repeats: int) -> float:
    """Median wall time of `repeats` warm calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_size(name: str, size: dict, tmp: Path, compile_: bool) -> dict:
    oracle, model = build_pair(size, tmp / name)
    c, n, canvases = size["canvas"], size["steps"], size["canvases"]
    vocab = model.text_config.vocab_size
    prompt = torch.randint(3, vocab, (1, size["prompt"]), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=c * canvases, max_denoising_steps=n, confidence_threshold=1e-30)
    steps = n * canvases

    def reference():
        with torch.no_grad():
            return oracle.generate(input_ids=prompt, **settings)

    def ours(runner, mode):
        return lambda: dgemma.generate(runner, prompt[0].tolist(), mode=mode, seed=0, stop_token_ids=[], **settings)

    fast = accelerate(model)
    # engine -> what to run (exact mode runs the reference modules whatever the runner)
    engines = {
        "transformers": reference,
        "dgemma exact": ours(model, "exact"),
        "dgemma fast": ours(fast, "fast"),
    }
    if compile_:
        engines["dgemma fast+compile"] = ours(accelerate(model, compile=True), "fast")
    warmups = {}
    for engine, fn in engines.items():
        t0 = time.perf_counter()
        fn()  # warm-up (and the one-off compile)
        warmups[engine] = time.perf_counter() - t0
    # Round robin, so that a slow spell of this shared machine hits every engine alike, the ceiling too:
    # its rate is sampled in every round, and each engine's share of it is taken in the same rounds.
    samples = {engine: [] for engine in engines}
    ceilings = []
    for _ in range(size["repeats"]):
        for engine, fn in engines.items():
            samples[engine].append(timed(fn, 1))
        ceilings.append(matmul_gflops(repeats=5, rounds=1))
    peaks = {}
    for engine, fn in engines.items():
        if not engine.endswith("compile"):  # tensors inside compiled code are not visible to the tracker
            peaks[engine] = peak_tensor_mb(fn)
    rows = {}
    for engine in engines:
        seconds = statistics.median(samples[engine])
        rows[engine] = {
            "s_per_run": seconds,
            "ms_per_step": 1000 * seconds / steps,
            "ms_per_canvas": 1000 * seconds / canvases,
            "peak_mb": peaks.get(engine),
            "warmup_s": warmups[engine],
        }
    flops = step_flops(model.config, c, size["prompt"] + c)
    for engine, r in rows.items():
        r["gflops"] = flops / (r["ms_per_step"] / 1000) / 1e9
        # the median over rounds of the same round's ratio: a slow spell of a shared machine slows both sides
        pairs = zip(samples["transformers"], samples[engine], strict=True)
        r["speedup"] = statistics.median(theirs / ours for theirs, ours in pairs)
        # the median over rounds of (this round's step rate / this round's ceiling)
        shares = [flops * steps / t / 1e9 / ceiling for t, ceiling in zip(samples[engine], ceilings, strict=True)]
        r["share_of_ceiling"] = statistics.median(shares)
    # diffusion vs autoregressive decoding on the same weights (both on the accelerated eager model)
    generate_ar(fast, prompt[0].tolist(), 8, stop_token_ids=[])
    ar_seconds = timed(lambda: generate_ar(fast, prompt[0].tolist(), c, stop_token_ids=[]), 1)
    ar_tps = c / ar_seconds
    fast_step = rows["dgemma fast"]["ms_per_step"] / 1000
    logits_mb = c * vocab * 4 / 2**20
    return {
        "size": name,
        "params": dgemma.count_parameters(model.config)["total"],
        "canvas": c,
        "steps_per_canvas": n,
        "canvases": canvases,
        "prompt": size["prompt"],
        "vocab": vocab,
        "gflop_per_step": flops / 1e9,
        "ceiling_gflops": statistics.median(ceilings),  # the fp32 matmul rate during these rounds
        "logits_buffer_mb": logits_mb,
        "engines": rows,
        "ar_tokens_per_s": ar_tps,
        "diffusion_tokens_per_s": c / (fast_step * n),
        # a canvas beats AR when it needs fewer steps than this (time of c AR tokens / time of one step)
        "crossover_steps_per_canvas": (c / ar_tps) / fast_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "small"])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    add_glibc_defaults_flag(parser)
    args = parser.parse_args()
    if args.glibc_defaults:
        keep_glibc_defaults()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    peak = matmul_gflops()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes:
            results.append(run_size(name, SIZES[name], Path(tmp), not args.no_compile))
    print(
        f"{'size':6s} {'engine':20s} {'ms/canvas':>10s} {'ms/step':>9s} {'GFLOP/s':>8s} {'peak MB':>8s} "
        f"{'of ceiling':>10s} {'vs transformers':>16s} {'warm-up s':>10s}"
    )
    for r in results:
        for engine, e in r["engines"].items():
            peak_mb = "-" if e["peak_mb"] is None else f"{e['peak_mb']:.1f}"
            print(
                f"{r['size']:6s} {engine:20s} {e['ms_per_canvas']:10.1f} {e['ms_per_step']:9.2f} "
                f"{e['gflops']:8.2f} {peak_mb:>8s} {e['share_of_ceiling']:10.0%} {e['speedup']:15.2f}x "
                f"{e['warmup_s']:10.1f}"
            )
    print()
    for r in results:
        print(
            f"{r['size']}: {r['params'] / 1e6:.1f}M params, canvas {r['canvas']}, {r['steps_per_canvas']} steps "
            f"per canvas, {r['gflop_per_step']:.2f} GFLOP per step, one fp32 canvas x vocab buffer "
            f"{r['logits_buffer_mb']:.1f} MB; diffusion (fast) {r['diffusion_tokens_per_s']:.0f} tok/s vs AR "
            f"{r['ar_tokens_per_s']:.0f} tok/s; diffusion wins below {r['crossover_steps_per_canvas']:.1f} "
            f"steps per canvas; fp32 matmul ceiling during its rounds {r['ceiling_gflops']:.0f} GFLOP/s"
        )
    print(
        f"machine: fp32 matmul {peak:.0f} GFLOP/s on {args.threads} threads (1024^3, best of 3 at the start); "
        "'of ceiling' is each round's step rate over that round's matmul rate, 'vs transformers' each round's "
        "time ratio (medians over rounds)"
    )
    print(
        json.dumps({"benchmark": "generate_speed", "threads": args.threads, "matmul_gflops": peak, "results": results})
    )


if __name__ == "__main__":
    main()
