"""Where the GPU suite's figures come from: logit parity against an fp32 oracle, and profiles of one pass.

    python benchmarks/gpu_diag.py OUTDIR              # on the GPU machine (after gpu_suite.sh installed the oracle)
    python benchmarks/gpu_diag.py OUTDIR --dry-run    # small preset, on this CPU

1. Parity at the 26b-a4b geometry, cut to a few layers so that an fp32 copy fits beside the bf16 one:
   the error of transformers in bf16 and of dgemma in bf16 (reference modules and the fast twin), each
   against transformers in fp32 on the same weights. A bf16 error of dgemma near transformers' own is
   rounding (random routers flip experts on ties of rounding); one far above it is a bug.
2. torch.profiler tables (top operations by device time) of one autoregressive token (`Runner.encode`
   of 1 token) and one denoising step of the fast twin without graphs, at the same cut depth.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test helpers (tests/helpers.py)
from helpers import model_sharing_oracle_weights, oracle_from_config

from dgemma import accelerate
from dgemma.model.config import DiffusionGemmaConfig
from dgemma.model.presets import preset


def cut(config: DiffusionGemmaConfig, layers: int) -> DiffusionGemmaConfig:
    """`config` with only its first `layers` layers (the last one full attention, as the model requires)."""
    d = config.to_dict()
    d["text_config"]["num_hidden_layers"] = layers
    d["text_config"]["layer_types"] = d["text_config"]["layer_types"][:layers]
    d["text_config"]["layer_types"][-1] = "full_attention"
    return DiffusionGemmaConfig.from_dict(d)


@torch.no_grad()
def step_logits(oracle, model, runner, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """One denoising step's logits from transformers, dgemma's reference modules and (if given) its twin."""
    from transformers.cache_utils import DynamicCache

    vocab, c = model.text_config.vocab_size, model.config.canvas_length
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, vocab, (1, 32), generator=g).to(device)
    canvas = torch.randint(0, vocab, (1, c), generator=g).to(device)
    pkv = DynamicCache(config=oracle.config.text_config)
    oracle.model.encoder(input_ids=ids, past_key_values=pkv)
    out = {"transformers": oracle(past_key_values=pkv, decoder_input_ids=canvas).logits.float()}
    cache = model.new_cache(1, 32 + c)
    model.encode(ids, cache)
    out["dgemma"] = model.denoise(canvas, cache).float()
    if runner is not None:
        cache = runner.new_cache(1, 32 + c)
        runner.encode(ids, cache)
        out["dgemma fast"] = runner.denoise(canvas, cache).float().clone()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-9)


def parity(config, layers: int, device, low: torch.dtype) -> dict:
    """Errors of transformers and dgemma in `low` against transformers in fp32, same weights."""
    c = cut(config, layers)
    oracle32 = oracle_from_config(c, device=device, dtype=torch.float32)
    model32 = model_sharing_oracle_weights(oracle32, c)
    ref = step_logits(oracle32, model32, None, device)
    oracle_low = copy.deepcopy(oracle32).to(low)
    del oracle32, model32
    model_low = model_sharing_oracle_weights(oracle_low, c)
    got = step_logits(oracle_low, model_low, accelerate(model_low, graphs=False), device)
    base = ref["transformers"]
    row = {"layers": layers, "dgemma fp32 vs transformers fp32": rel(ref["dgemma"], base)}
    for k, v in got.items():
        row[f"{k} {str(low)[6:]} vs transformers fp32"] = rel(v, base)
    row["dgemma vs transformers, both low"] = rel(got["dgemma"], got["transformers"])
    row["argmax agreement dgemma/transformers low"] = (
        (got["dgemma"].argmax(-1) == got["transformers"].argmax(-1)).float().mean().item()
    )
    del oracle_low, model_low
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def profile(fn, device, rows: int = 18) -> str:
    """The top operations of `fn()` by device (or CPU) time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with prof(activities=acts) as p:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    try:
        table = p.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    except Exception:  # older torch names it cuda_time_total
        table = p.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)
    return f"wall: {wall(fn, device) * 1e3:.2f} ms per call (median of 10)\n{table}"


def wall(fn, device, n: int = 10) -> float:
    """Median seconds per call of `fn()`."""
    import statistics
    import time

    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def profiles(config, layers: int, device, dtype) -> dict[str, str]:
    """Profiles of one AR token and one fast denoising step (no graphs) at `layers` layers."""
    c = cut(config, layers)
    oracle = oracle_from_config(c, device=device, dtype=dtype)
    model = model_sharing_oracle_weights(oracle, c)
    runner = accelerate(model, graphs=False)
    vocab, canvas = c.text_config.vocab_size, c.canvas_length
    ids = torch.randint(8, vocab, (1, 64), device=device)
    cache = runner.new_cache(1, 64 + 8 * 64 + canvas)
    runner.encode(ids, cache)
    token = torch.randint(8, vocab, (1, 1), device=device)

    def ar_token():
        runner.encode(token, cache, return_logits=True)

    cache2 = runner.new_cache(1, 64 + canvas)
    runner.encode(ids, cache2)
    canvas_ids = torch.randint(0, vocab, (1, canvas), device=device)

    def step():
        runner.denoise(canvas_ids, cache2)

    return {"ar_token": profile(ar_token, device), "denoise_step": profile(step, device)}


@torch.no_grad()
def attention_backends(config, layers: int, device, dtype) -> dict:
    """One AR token's wall time under each SDPA backend choice, and its CPU-heavy operations."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    c = cut(config, layers)
    oracle = oracle_from_config(c, device=device, dtype=dtype)
    model = model_sharing_oracle_weights(oracle, c)
    runner = accelerate(model, graphs=False)
    vocab = c.text_config.vocab_size
    cache = runner.new_cache(1, 64 + 200)
    runner.encode(torch.randint(8, vocab, (1, 64), device=device), cache)
    token = torch.randint(8, vocab, (1, 1), device=device)

    def ar_token():
        runner.encode(token, cache, return_logits=True)

    out = {"default_ms": wall(ar_token, device) * 1e3}
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        ar_token()
    out["cpu_table"] = p.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(no_cudnn):
        out["no_cudnn_ms"] = wall(ar_token, device) * 1e3
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out["efficient_only_ms"] = wall(ar_token, device) * 1e3
    except RuntimeError as e:  # a CPU has no such kernel
        out["efficient_only_ms"] = str(e)[:80]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--layers", default="1,6")
    parser.add_argument("--backends", action="store_true", help="only the AR attention-backend check")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry_run else "cuda")
    config = preset("small" if args.dry_run else "26b-a4b")
    results: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if args.backends:
        r = attention_backends(config, 6, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        print(r.pop("cpu_table"), "\n", json.dumps(r), flush=True)
        return
    for n in [int(x) for x in args.layers.split(",")]:
        row = parity(config, n, device, torch.bfloat16)
        print(json.dumps(row), flush=True)
        results.setdefault("parity", []).append(row)
    tables = profiles(config, 6, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    for k, v in tables.items():
        print(f"== {k} ==\n{v}", flush=True)
        (args.out / f"profile_{k}.txt").write_text(v)
    (args.out / "gpu_diag.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
