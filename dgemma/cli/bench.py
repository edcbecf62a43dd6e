"""`dgemma bench`: diffusion or autoregressive decoding, which wins on this hardware? (see dgemma/bench.py)"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CPU_STEPS = "1,2,4,8,16,32"
CUDA_STEPS = "2,4,8,12,16,20,32,48"


def _steps(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"steps must be comma-separated integers (got {text!r})") from None
    if len(set(values)) < 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"give at least two different step counts >= 1 (got {text!r})")
    return sorted(set(values))


def _at_least_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number (got {text!r})") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: a canvas takes at least one step (got {text})")
    return value


def load_for_bench(args: argparse.Namespace):
    """The model to measure: a preset with random weights, or a checkpoint (default: the shipped code
    model). Returns (the Runner that --kernels, --compile and --no-graphs ask for, tokenizer or None, what
    it is)."""

    from ..bench import random_model
    from ..checkpoints.weights import resolve_dtype
    from ..runtime.cpu import preferred_dtype
    from .common import make_runner, resolve_device

    device = resolve_device(args.device)
    if args.preset:
        if not args.random_weights:
            raise ValueError("presets have no trained weights: add --random-weights (or give --model DIR)")
        dtype = resolve_dtype(args.dtype) or preferred_dtype(device)  # auto: bf16 where it multiplies natively
        model = random_model(args.preset, device=device, dtype=dtype, quant=args.quant, group_size=args.group_size)
        tokenizer, label = None, f"preset {args.preset} (random weights)"
    else:
        if args.random_weights:
            raise ValueError("--random-weights goes with --preset")
        from .common import load_model

        model, tokenizer = load_model(args)
        label = str(args.model)
    return make_runner(model, args, graphs=False if args.no_graphs else None), tokenizer, label


def format_table(r, label: str) -> str:
    """The human-readable report of a BenchResult."""
    lines = [
        f"model: {label}, {r.params / 1e6:,.1f}M parameters ({r.active_params / 1e6:,.1f}M active), {r.dtype}"
        + (f", {r.quant} weights" if r.quant else ""),
        f"device: {r.device}; canvas {r.canvas} tokens, prompt {r.prompt_tokens} tokens, batch 1",
        "",
        f"{'decoding':28s} {'s/canvas':>9s} {'tokens/s':>9s} {'TTFT s':>8s} {'vs AR':>7s}",
    ]
    for p in r.points:
        lines.append(
            f"{'diffusion, ' + str(p.steps) + ' steps/canvas':28s} {p.seconds_per_canvas:9.3f} "
            f"{p.tokens_per_s:9.1f} {p.time_to_first_token:8.3f} {p.tokens_per_s / r.ar_tokens_per_s:6.2f}x"
        )
    if r.sampler_steps is not None:
        lines.append(
            f"{'diffusion, sampler decides':28s} {'':9s} {r.sampler_tokens_per_s:9.1f} {'':8s} "
            f"{r.sampler_tokens_per_s / r.ar_tokens_per_s:6.2f}x   ({r.sampler_steps:.1f} steps per canvas)"
        )
    lines.append(f"{'autoregressive (greedy)':28s} {'':9s} {r.ar_tokens_per_s:9.1f} {r.ar_time_to_first_token:8.3f}")
    lines += [
        "",
        f"time per denoising step {1000 * r.step_s:.2f} ms (sampler included; fit over the step counts), "
        f"per canvas beyond its steps {1000 * r.canvas_overhead_s:.2f} ms, prefill {1000 * r.prefill_s:.2f} ms",
        f"a step reads {r.step_bytes['weights'] / 1e9:.3f} GB of weights + {r.step_bytes['kv_cache'] / 1e9:.4f} GB "
        f"of KV cache and does {r.step_flops / 1e9:.1f} GFLOP: {r.step_gbps:.1f} GB/s, "
        f"{r.step_tflops * 1000:.1f} GFLOP/s achieved",
    ]
    pk = r.peaks
    if pk:
        limit = (
            f"this device: copy {pk['copy_gbps']:.1f} GB/s, {pk['matmul_dtype']} matmul "
            f"{pk['matmul_tflops'] * 1000:.0f} GFLOP/s (measured)"
        )
        if pk.get("nominal_gbps"):
            limit += f"; nominal {pk['nominal_gbps']:.0f} GB/s, {pk['nominal_bf16_tflops']:.0f} TFLOP/s bf16"
        lines.append(limit)
        if pk.get("cpu"):
            cpu = pk["cpu"]
            lines.append(
                f"this CPU: {cpu['capability']}; bf16 products: {', '.join(cpu['bf16']) or 'none'}; "
                f"int8 dot products: {', '.join(cpu['int8']) or 'none'}"
            )
        bound = r.step_bytes["total"] / (1e9 * (pk.get("nominal_gbps") or pk["copy_gbps"]))
        lines.append(
            f"a step's weight-read bound: {1000 * bound:.2f} ms; measured {1000 * r.step_s:.2f} ms = "
            f"{r.step_s / bound:.1f}x the bound; compute share {r.step_tflops / pk['matmul_tflops']:.0%} of the "
            "measured matmul rate"
        )
    lines += [
        "",
        f"crossover: diffusion is faster than AR here below {r.crossover_steps:.1f} steps per canvas",
        f"steps per canvas compared with it: {r.expected_steps:.1f} ({r.expected_steps_source})",
        f"recommendation: {r.recommendation}",
    ]
    return "\n".join(lines)


def plot(r, path: Path, label: str) -> None:
    """tokens/s against steps per canvas: measured points, the fitted curve, the AR line, the crossover."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(max(p.steps for p in r.points), 48)
    xs = [1 + i * (top - 1) / 200 for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [r.tokens_per_s_at(x) for x in xs], color="tab:blue", alpha=0.5, label="diffusion (fit)")
    ax.plot([p.steps for p in r.points], [p.tokens_per_s for p in r.points], "o", color="tab:blue", label="diffusion")
    ax.axhline(r.ar_tokens_per_s, color="tab:red", ls="--", label=f"autoregressive ({r.ar_tokens_per_s:.0f} tok/s)")
    if 1 <= r.crossover_steps <= top:
        ax.axvline(r.crossover_steps, color="gray", ls=":", label=f"crossover {r.crossover_steps:.1f} steps")
    if r.sampler_steps is not None:
        ax.plot([r.sampler_steps], [r.sampler_tokens_per_s], "*", ms=12, color="tab:green", label="sampler decides")
    if r.expected_steps_source != "measured":
        ax.axvline(r.expected_steps, color="tab:green", ls="-.", label=f"{r.expected_steps_source} steps")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("denoising steps per canvas")
    ax.set_ylabel("tokens / s (batch 1)")
    ax.set_title(f"{label}\n{r.device}, {r.dtype}" + (f", {r.quant}" if r.quant else ""), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from ..bench import machine_peaks, run_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, label = load_for_bench(args)
    steps = args.fixed_steps or _steps(CUDA_STEPS if model.device.type == "cuda" else CPU_STEPS)
    sampler_prompt = None
    if tokenizer is not None:
        sampler_prompt = tokenizer.encode(args.sampler_prompt)
    show = sys.stderr.isatty() and not args.quiet

    def progress(text: str) -> None:
        if not args.quiet:
            print(f"\r\033[2K{text}" if show else text, end="" if show else "\n", file=sys.stderr, flush=True)

    result = run_bench(
        model,
        steps=steps,
        prompt_tokens=args.prompt_length,
        canvases=args.canvases,
        ar_tokens=args.ar_tokens,
        repeats=args.repeats,
        sampler_prompt=sampler_prompt,
        steps_per_canvas=args.steps_per_canvas,
        progress=progress,
    )
    progress("measuring the device's peaks")
    result.peaks = machine_peaks(model.device, model.dtype)
    if show:
        print("\r\033[2K", end="", file=sys.stderr)
    table = sys.stderr if args.json else sys.stdout  # --json: stdout holds the JSON object alone
    print(format_table(result, label), file=table)
    out = result.to_json() | {"benchmark": "dgemma_bench", "model": label}
    if args.plot:
        try:
            plot(result, args.plot, label)
            print(f"plot: {args.plot}", file=table)
            out["plot"] = str(args.plot)
        except ImportError:
            print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    if args.save_json:
        args.save_json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.save_json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        tmp.replace(args.save_json)
    print(json.dumps(out))
    return 0


def register(sub) -> None:
    from ..model.presets import PRESETS
    from .common import add_model_args, add_old_name, positive_int

    s = sub.add_parser(
        "bench",
        help="measure diffusion vs autoregressive decoding on this hardware, and say which to use",
        description="Measure, on this device and these weights, diffusion decoding (time per denoising step, "
        "tokens/s and time to first token at fixed steps per canvas, and with trained weights the steps the "
        "sampler takes) against autoregressive decoding of the same weights; print a table, the crossover "
        "(steps per canvas below which diffusion wins here), a recommendation, the bytes and FLOPs a step "
        "needs with the achieved GB/s and FLOP/s, a PNG plot and one JSON line. Default model: the shipped "
        "code model; --preset NAME --random-weights measures an architecture without its weights (in bf16 on a "
        "GPU and on a CPU with bf16 matmuls, else fp32, unless --dtype says; the "
        "26b-a4b preset needs a GPU with ~55 GB free in bf16). About a minute on 2 CPU cores for the small "
        "preset.",
    )
    add_model_args(s)
    s.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration (with --random-weights)")
    s.add_argument("--random-weights", action="store_true", help="random weights for --preset (speed only)")
    s.add_argument(
        "--fixed-steps",
        type=_steps,
        default=None,
        help=f"fixed steps per canvas to measure, comma-separated (default: {CPU_STEPS} on CPU, {CUDA_STEPS} on CUDA)",
    )
    add_old_name(s, "--steps", "--fixed-steps", dest="fixed_steps", type=_steps)
    s.add_argument("--prompt-length", type=positive_int, default=64, help="prompt tokens (default 64)")
    s.add_argument("--canvases", type=positive_int, default=2, help="canvases per diffusion run (default 2)")
    s.add_argument("--ar-tokens", type=positive_int, default=None, help="tokens per AR run (default: one canvas)")
    s.add_argument(
        "--repeats", type=positive_int, default=2, help="runs of each setting; the median is kept (default 2)"
    )
    s.add_argument(
        "--sampler-prompt",
        default="def parse(text):\n",
        help="text the sampler generates from to find its own steps per canvas (trained weights only)",
    )
    s.add_argument(
        "--steps-per-canvas",
        type=_at_least_one,
        default=None,
        help="steps per canvas to recommend for (default: the sampler's measured steps with trained weights; "
        "with random weights an assumption: canvas / 20, the released model's ~20 tokens per forward, but at "
        "least the 2 steps its stop rule needs)",
    )
    s.add_argument("--plot", type=Path, default=Path("bench.png"), help="PNG plot path (default bench.png)")
    s.add_argument("--json", action="store_true", help="stdout: the JSON result alone (the table goes to stderr)")
    s.add_argument("--save-json", type=Path, default=None, help="also write the JSON result to this file")
    add_old_name(s, "--json-out", "--save-json", dest="save_json", type=Path)
    add_old_name(s, "--no-accelerate", "--kernels reference", dest="kernels", is_flag=True, const="reference")
    s.add_argument("--no-graphs", action="store_true", help="no CUDA graphs (the other fast paths stay)")
    s.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    s.set_defaults(func=cmd_bench)
