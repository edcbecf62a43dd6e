"""Peak memory of the real 26B-A4B model with quantized weights, on CPU, with no checkpoint.

Builds the `26b-a4b` configuration (25.25B parameters, 128 experts) directly in its quantized form: the
policy's layers (attention, dense MLP, experts; dgemma.quant) hold random codes and scales, everything
else (embedding / LM head, router, norms, self-conditioning) random bf16. Nothing is ever materialised
in bf16 first. Then it runs what generation does for one canvas: encode a prompt, one full 256-token
denoising step, and the commit (encoding the canvas), and reports the peak resident memory of the
process (getrusage), the parameter bytes by component, and the time of each phase. The bf16 and int8
parameter bytes are computed, not run. Random weights: the numbers are about memory and time, not text.

    python benchmarks/memory_26b.py [--quant int4] [--group-size 64] [--prompt 64] [--threads N]

Prints a table and ends with one JSON line. Needs ~15 GB of free memory for int4 (~27 GB for int8).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

import dgemma
from dgemma.model import DiffusionGemma
from dgemma.quant import QuantExperts, QuantLinear, describe, swap_modules

GIB = 2**30


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def fill_random(model: DiffusionGemma, seed: int = 0) -> None:
    """Random values in place: floats ~ N(0, 0.02) (norm scales and layer scalars 1), codes from a
    repeated random block (cheap to write, and every byte is touched, so it is resident), scales so that
    dequantized weights have a standard deviation near 0.02."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        with torch.no_grad():
            if t.dtype in (torch.uint8, torch.int8) or t.dtype == getattr(torch, "float8_e4m3fn", None):
                flat = t.view(torch.uint8).view(-1)
                for start in range(0, flat.numel(), block.numel()):
                    part = flat[start : start + block.numel()]
                    part.copy_(block[: part.numel()])
                if t.dtype == torch.int8:
                    t.clamp_(-127, 127)
                elif t.dtype != torch.uint8:  # fp8: keep codes finite
                    t.view(torch.uint8).bitwise_and_(0xF7)
            elif name.endswith("_scale") and t.dim() >= 2:
                t.fill_(0.02 / 4.0)
            elif "norm" in name or name.endswith("scalar") or name.endswith("scale"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=g)


def component(name: str) -> str:
    if name.startswith("embed_tokens"):
        return "embedding / LM head (tied, bf16)"
    if name.startswith("self_conditioning"):
        return "self-conditioning MLP (bf16)"
    if ".experts." in name:
        return "experts"
    if ".self_attn." in name and "norm" not in name:
        return "attention projections"
    if ".mlp." in name:
        return "dense MLP"
    if ".router." in name:
        return "router (bf16)"
    return "norms, scalars (bf16)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="int4", choices=["int4", "int8", "fp8"])
    ap.add_argument("--group-size", type=int, default=64, help="int4 group size (default 64)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens encoded before the canvas")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check; not the real model)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    config = dgemma.preset("26b-a4b")
    tc = config.text_config
    if args.layers:
        tc.num_hidden_layers = args.layers
        tc.layer_types = tc.layer_types[: args.layers]
    t0 = time.perf_counter()
    rss0 = rss_bytes()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # float parameters in bf16; codes and scales have their own dtypes
    try:
        with torch.device("meta"):
            model = DiffusionGemma(config)
            n_params = sum(t.numel() for t in model.parameters())
            swap_modules(model, args.quant, args.group_size, empty=True)
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device="cpu")
    fill_random(model)
    model.quantization = describe(args.quant, args.group_size)
    dgemma.accelerate(model)
    build_s = time.perf_counter() - t0
    rss_built = rss_bytes()

    by_component: dict[str, int] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        by_component[component(name)] = by_component.get(component(name), 0) + t.nbytes
    total = sum(by_component.values())
    quantized_weights = rows = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            quantized_weights += m.in_features * m.out_features
            rows += m.out_features
        elif isinstance(m, QuantExperts):
            quantized_weights += sum(torch.Size(s).numel() for s in m.shapes.values())
            rows += sum(s[0] * s[1] for s in m.shapes.values())
    bf16_bytes = 2 * n_params
    int8_bytes = bf16_bytes - quantized_weights + 4 * rows  # 1 byte per quantized weight + an fp32 scale per row

    cache = model.new_cache(batch_size=1, max_length=args.prompt + 2 * config.canvas_length)
    prompt = torch.randint(0, tc.vocab_size, (1, args.prompt))
    canvas = torch.randint(0, tc.vocab_size, (1, config.canvas_length))
    phases = {}
    t = time.perf_counter()
    model.encode(prompt, cache)
    phases["encode prompt"] = time.perf_counter() - t
    t = time.perf_counter()
    logits = model.denoise(canvas, cache)
    phases["denoising step (256-token canvas)"] = time.perf_counter() - t
    t = time.perf_counter()
    model.encode(logits.argmax(-1), cache)
    phases["commit (encode the canvas)"] = time.perf_counter() - t
    peak = peak_rss_bytes()

    print(
        f"26b-a4b{'' if not args.layers else f' (first {args.layers} layers only)'}, weights {args.quant}"
        f"{f' (group {args.group_size})' if args.quant == 'int4' else ''}, random; {torch.get_num_threads()} threads"
    )
    print("\n| component | bytes |\n|---|---:|")
    for name, b in sorted(by_component.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {b / GIB:.2f} GiB |")
    print(f"| **total ({args.quant})** | **{total / GIB:.2f} GiB** |")
    print(f"| total if bf16 (computed) | {bf16_bytes / GIB:.2f} GiB |")
    print(f"| total if int8 (computed) | {int8_bytes / GIB:.2f} GiB |")
    print("\n| phase | seconds |\n|---|---:|")
    print(f"| build (random {args.quant} weights) | {build_s:.1f} |")
    for name, s in phases.items():
        print(f"| {name} | {s:.1f} |")
    print(
        f"\npeak resident memory: {peak / GIB:.2f} GiB (process at start {rss0 / GIB:.2f} GiB, "
        f"after building {rss_built / GIB:.2f} GiB)"
    )
    print(
        json.dumps(
            {
                "benchmark": "memory_26b",
                "quant": args.quant,
                "group_size": args.group_size if args.quant == "int4" else None,
                "layers": tc.num_hidden_layers,
                "parameters": n_params,
                "param_bytes": total,
                "param_bytes_by_component": by_component,
                "bf16_param_bytes": bf16_bytes,
                "int8_param_bytes": int8_bytes,
                "peak_rss_bytes": peak,
                "peak_rss_gib": peak / GIB,
                "seconds": {"build": build_s, **phases},
                "threads": torch.get_num_threads(),
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
