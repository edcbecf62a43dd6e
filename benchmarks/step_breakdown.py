"""Where a denoising step's time goes: the model forward (attention, dense MLP, experts, the
self-conditioning MLP, the LM head), the sampler's vocabulary pass, the self-conditioning soft embedding,
and the rest, each with its FLOPs and its rate as a share of this machine's fp32 matmul ceiling.

A fast-mode step of the `small` (or `tiny`) preset, random weights, warm, after a prompt in the KV cache:
the same calls the canvas loop makes (runner.denoise, then sampling.fast_transition), timed part by part
with forward hooks (CPU ops are synchronous) and by running the sampler pass with and without the soft
embedding. The ceiling is the matmul rate in the weights' dtype (`--dtype bf16`: the CPU's bf16
products, where it has them). Prints a table and ends with one JSON line.

    python benchmarks/step_breakdown.py [--size small] [--threads 2] [--repeats 5] [--dtype bf16]
        [--quant int8 | int8-dequantized] [--glibc-defaults]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from _measure import add_glibc_defaults_flag, keep_glibc_defaults, matmul_gflops

import dgemma
from dgemma.generation.sampling import SAMPLERS, canvas_stats, fast_transition
from dgemma.model.model import MLP, Attention, Experts, Router, SelfConditioning
from dgemma.model.presets import preset
from dgemma.quant import QuantExperts, quantize_model, use_kernels

SIZES = {"tiny": dict(canvas=32, prompt=32), "small": dict(canvas=256, prompt=64)}
PARTS = {
    Attention: "attention",
    MLP: "dense MLP",
    Router: "experts",
    Experts: "experts",
    QuantExperts: "experts",
    SelfConditioning: "self-cond MLP",
}


def part_flops(model, canvas: int, prefix: int) -> dict[str, float]:
    """FLOPs (2 x multiply-adds) of each part of one denoising step of `canvas` tokens after `prefix`."""
    t, c = model.text_config, canvas
    m, v = t.hidden_size, t.vocab_size
    out = defaultdict(float)
    for spec in t.layers:
        heads, kv, d = t.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        out["attention"] += 2 * c * m * d * (2 * heads + 2 * kv)  # q, o; k, v projections
        keys = (min(prefix, t.sliding_window - 1) if spec.is_sliding else prefix) + c
        out["attention"] += 2 * 2 * c * keys * heads * d  # scores and values
        out["dense MLP"] += 2 * c * m * t.intermediate_size * 3
        if t.has_experts:
            out["experts"] += 2 * c * m * t.num_experts  # router
            out["experts"] += 2 * c * t.top_k_experts * m * t.moe_intermediate_size * 3
    out["self-cond MLP"] = 2 * c * m * t.intermediate_size * 3
    out["LM head"] = 2 * c * m * v
    out["soft embedding"] = 2 * c * v * m
    return dict(out)


class Clock:
    """Seconds spent in each part's modules, from forward pre/post hooks (outermost call counted)."""

    def __init__(self, model):
        self.seconds = defaultdict(float)
        self.handles, self._start = [], {}
        for module in model.modules():
            name = next((n for cls, n in PARTS.items() if isinstance(module, cls)), None)
            if name is not None:
                self.handles.append(module.register_forward_pre_hook(self._pre(module)))
                self.handles.append(module.register_forward_hook(self._post(module, name)))

    def _pre(self, module):
        def hook(*_):
            self._start[id(module)] = time.perf_counter()

        return hook

    def _post(self, module, name):
        def hook(*_):
            self.seconds[name] += time.perf_counter() - self._start.pop(id(module))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def measure(size: str, repeats: int, dtype: torch.dtype = torch.float32, quant: str | None = None) -> dict:
    spec = SIZES[size]
    config = preset(size)
    config.canvas_length = spec["canvas"]
    model = dgemma.build(config, dtype=dtype).eval()
    if quant is not None:
        model = quantize_model(model, quant.removesuffix("-dequantized"))
    runner = dgemma.accelerate(model)
    fast = runner.modules_for(False)
    if quant == "int8-dequantized":  # the baseline of the W8A8 default, which the twin switches on itself
        use_kernels(fast, enable=False)
    c, v = spec["canvas"], model.text_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, v, (1, spec["prompt"]), generator=gen)
    cache = model.new_cache(1, spec["prompt"] + c)
    canvas = torch.randint(3, v, (1, c), generator=gen)
    pinned = torch.zeros(1, c, dtype=torch.bool)
    w = model.embed_tokens.weight
    scale = model.embed_scale(w.dtype)
    sampler = SAMPLERS["entropy-bound"](0.1)
    rows = defaultdict(list)
    with torch.no_grad():
        runner.encode(prompt, cache)
        sc, buffer = None, torch.empty(1, c, v)
        for k in range(repeats + 1):
            clock = Clock(fast)
            t0 = time.perf_counter()
            logits = runner.denoise(canvas, cache, sc, out=buffer)  # as generate.drive reuses one
            t1 = time.perf_counter()
            hidden_t0 = time.perf_counter()
            fast.denoise_hidden(canvas, cache, sc)
            hidden = time.perf_counter() - hidden_t0
            clock.remove()
            plain, with_soft, step_logits = (logits / 0.8 for _ in range(3))
            t2 = time.perf_counter()
            canvas_stats(plain)
            t3 = time.perf_counter()
            canvas_stats(with_soft, w, scale)
            t4 = time.perf_counter()
            t5 = time.perf_counter()
            t = fast_transition(step_logits, sampler, 10, pinned, canvas, gen, w, scale)
            t6 = time.perf_counter()
            sc = t.soft_embeds
            if k == 0:
                continue  # warm-up
            parts = {name: s / 2 for name, s in clock.seconds.items()}  # the clock ran over two forwards
            forward = t1 - t0
            parts["LM head"] = forward - hidden
            parts["model, other"] = hidden - sum(parts[n] for n in set(PARTS.values()) if n in parts)
            parts["sampler pass"] = t3 - t2
            parts["soft embedding"] = (t4 - t3) - (t3 - t2)
            parts["transition, other"] = (t6 - t5) - (t4 - t3)
            parts["step"] = forward + (t6 - t5)
            for name, s in parts.items():
                rows[name].append(s)
    return {name: statistics.median(s) for name, s in rows.items()}, part_flops(model, c, spec["prompt"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the weights' dtype")
    ap.add_argument(
        "--quant",
        choices=["int8", "int8-dequantized", "fp8", "int4"],
        default=None,
        help="quantized weights (int8: W8A8 integer matmuls where the CPU has int8 dot products; "
        "int8-dequantized: the same weights dequantized for fp32 matmuls)",
    )
    add_glibc_defaults_flag(ap)
    args = ap.parse_args()
    if args.glibc_defaults:
        keep_glibc_defaults()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    ceiling = matmul_gflops(dtype=dtype)  # of the weights' dtype: bf16 products where the CPU has them
    seconds, flops = measure(args.size, args.repeats, dtype, args.quant)
    step = seconds["step"]
    order = ["attention", "dense MLP", "experts", "self-cond MLP", "model, other", "LM head", "sampler pass"]
    order += ["soft embedding", "transition, other"]
    print(f"{'part':20s} {'ms':>8s} {'share':>7s} {'GFLOP':>8s} {'GFLOP/s':>8s} {'of ceiling':>10s}")
    out = {}
    for name in order:
        if name not in seconds:
            continue
        s, f = seconds[name], flops.get(name, 0.0)
        rate = f / s / 1e9 if s > 0 and f else None
        out[name] = {"ms": 1000 * s, "share": s / step, "gflop": f / 1e9, "gflops": rate}
        shown = "-" if rate is None else f"{rate:8.1f}"
        of = "-" if rate is None else f"{rate / ceiling:9.0%}"
        print(f"{name:20s} {1000 * s:8.2f} {s / step:7.1%} {f / 1e9:8.3f} {shown:>8s} {of:>10s}")
    total = sum(flops.values())
    rate = total / step / 1e9
    print(f"{'step':20s} {1000 * step:8.2f} {1:7.1%} {total / 1e9:8.3f} {rate:8.1f} {rate / ceiling:9.0%}")
    print(f"machine: {args.dtype} matmul ceiling {ceiling:.0f} GFLOP/s on {args.threads} threads (1024^3, best of 3)")
    summary = {"benchmark": "step_breakdown", "size": args.size, "dtype": args.dtype, "quant": args.quant}
    summary["threads"] = args.threads
    summary["ceiling_gflops"] = ceiling
    print(json.dumps({**summary, "step_ms": 1000 * step, "step_gflops": total / step / 1e9, "parts": out}))


if __name__ == "__main__":
    main()
