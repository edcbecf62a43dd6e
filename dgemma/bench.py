"""Diffusion or autoregressive decoding, on this machine? Measurements behind `dgemma bench`.

Times prefill, denoising at fixed steps per canvas and autoregressive decoding on the current device and
weights, finds the crossover and recommends one, and accounts for the bytes and FLOPs a step costs against
the device's peaks. What is measured and why: docs/speed.md.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .ar import generate_ar
from .generation.programs import generate
from .model.config import DiffusionGemmaConfig
from .model.model import DiffusionGemma
from .model.presets import preset
from .model.sizes import count_parameters
from .runtime.cpu import cpu_features
from .runtime.runner import Runner, as_runner

# Nominal peaks of common GPUs (memory bandwidth in bytes/s, dense bf16 tensor FLOP/s), from the vendors'
# data sheets; matched against torch.cuda.get_device_name() by substring, most specific first.
GPU_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (4.8e12, 989e12),
    "H100 PCIe": (2.0e12, 756e12),
    "H100": (3.35e12, 989e12),
    "A100-SXM4-80GB": (2.04e12, 312e12),
    "A100 80GB PCIe": (1.94e12, 312e12),
    "A100": (1.56e12, 312e12),
    "L40S": (0.864e12, 362e12),
    "L4": (0.3e12, 121e12),
    "A10": (0.6e12, 125e12),
    "RTX 4090": (1.008e12, 165e12),
    "RTX 3090": (0.936e12, 71e12),
}

# Tokens per forward of the released model after its second training stage, on its 256-token canvases:
# "15-20" by the model card, about 20 by the technical report (arXiv 2608.00146); see
# shared/reference/ecosystem.md. Random weights settle in no meaningful number of steps, so with them the
# recommendation assumes a model that settles like the released one.
RELEASED_TOKENS_PER_FORWARD = 20
RELEASED_CANVAS = 256


def assumed_steps_per_canvas(canvas: int, stability_threshold: int = 1, max_steps: int = 48) -> float:
    """Steps per canvas assumed for random weights: the released model's tokens per forward held at 20,
    so canvas / 20 steps (12.8 for its 256-token canvas), but never fewer than the stop rule allows (the
    argmax must hold for `stability_threshold` steps after the first one: 2 steps by default) and never
    more than the step cap. An assumption, not a measurement: small canvases are not what the figure was
    measured on, which is why the floor matters there."""
    return float(min(max(canvas / RELEASED_TOKENS_PER_FORWARD, stability_threshold + 1), max_steps))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(
    name: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    quant: str | None = None,
    group_size: int = 64,
    seed: int = 0,
) -> DiffusionGemma:
    """A preset with random weights, built directly on `device` in `dtype` (no full-precision copy first,
    so the 26B preset fits a GPU that holds its bf16 weights). Refuses clearly when it cannot fit."""
    config = preset(name)
    device = torch.device(device)
    need = count_parameters(config)["total"] * torch.tensor([], dtype=dtype).element_size()
    free = _free_memory(device)
    if free is not None and need > 0.95 * free:
        raise ValueError(
            f"preset {name!r} needs {need / 2**30:.1f} GiB of weights in {dtype} but {device} has "
            f"{free / 2**30:.1f} GiB free; choose a smaller preset, --dtype bf16, or another device"
        )
    with torch.device("meta"):
        model = DiffusionGemma(config)
    model = model.to(dtype).to_empty(device=device)
    model.init_weights(torch.Generator(device=device).manual_seed(seed))
    if quant:
        from .quant import quantize_model

        quantize_model(model, quant, group_size)
    return model.eval()


def _free_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


# ------------------------------------------------------------------------------------------------
# What a forward reads and computes


def step_flops(config: DiffusionGemmaConfig, tokens: int, prefix: int, *, diffusion: bool = True) -> float:
    """FLOPs (2 x multiply-adds) of one forward of `tokens` tokens after `prefix` cached positions: every
    active weight matrix once per token, the LM head (and, for a denoising step, the self-conditioning
    soft embedding: another vocabulary x hidden product) and attention."""
    t = config.text_config
    embedding = t.vocab_size * t.hidden_size
    flops = 2 * tokens * (count_parameters(config)["active"] - embedding)
    flops += 2 * tokens * embedding * (2 if diffusion else 1)
    for spec in t.layers:
        keys = (min(prefix, t.sliding_window - 1) if spec.is_sliding else prefix) + tokens
        flops += 2 * 2 * tokens * keys * t.num_attention_heads * spec.head_dim
    return float(flops)


def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@torch.no_grad()
def step_bytes(model: DiffusionGemma, forward, embedding_uses: int, kv_bytes: int) -> dict[str, int]:
    """Bytes one forward pass (`forward()`) reads: the weights, counting an expert only if a token was
    routed to it and the tied embedding `embedding_uses` times (the LM head; a denoising step's soft
    embedding too), plus `kv_bytes` of KV cache."""
    from .model.model import Experts, Router
    from .quant.modules import QuantExperts

    hit: list[int] = []  # experts used, per layer
    handles = [
        m.register_forward_hook(lambda _m, _i, out: hit.append(int(torch.unique(out[1]).numel())))
        for m in model.modules()
        if isinstance(m, Router)
    ]
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
    experts = [m for m in model.modules() if isinstance(m, Experts | QuantExperts)]
    e = model.text_config.num_experts or 1
    expert_bytes = sum(_tensor_bytes(m) * n // e for m, n in zip(experts, hit, strict=True))
    embedding = _tensor_bytes(model.embed_tokens)
    other = _tensor_bytes(model) - embedding - sum(_tensor_bytes(m) for m in experts)
    weights = other + expert_bytes + embedding_uses * embedding
    return {"weights": weights, "kv_cache": kv_bytes, "total": weights + kv_bytes}


# ------------------------------------------------------------------------------------------------
# Machine peaks


def machine_peaks(device: torch.device, dtype: torch.dtype) -> dict:
    """This device's measured copy bandwidth and matmul rate (in the model's dtype), and its nominal
    bandwidth and bf16 rate when it is a known GPU."""
    device = torch.device(device)
    n = (1 << 30) if device.type == "cuda" else (1 << 27)  # bytes copied per trial
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = _best_of(lambda: dst.copy_(src), device, 5)
    size = 4096 if device.type == "cuda" else 1024
    mm_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=mm_dtype)
    a @ a
    mm_s = _best_of(lambda: a @ a, device, 5)
    out = {
        "device": device_name(device),
        "copy_gbps": 2 * n / copy_s / 1e9,  # read + write
        "matmul_tflops": 2 * size**3 / mm_s / 1e12,
        "matmul_dtype": str(mm_dtype).replace("torch.", ""),
        "nominal_gbps": None,
        "nominal_bf16_tflops": None,
    }
    if device.type == "cuda":
        for key, (bandwidth, flops) in GPU_PEAKS.items():
            if key in out["device"]:
                out["nominal_gbps"], out["nominal_bf16_tflops"] = bandwidth / 1e9, flops / 1e12
                break
    else:
        out["cpu"] = cpu_features()
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({torch.get_num_threads()} threads)"


def _best_of(fn, device: torch.device, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------------------------------------
# The benchmark


@dataclass
class Point:
    steps: int  # denoising steps per canvas (fixed)
    seconds_per_canvas: float  # measured, prefill excluded, commit included
    tokens_per_s: float
    time_to_first_token: float  # prefill + the first canvas


@dataclass
class BenchResult:
    device: str
    params: int
    active_params: int
    dtype: str
    quant: str | None
    canvas: int
    prompt_tokens: int
    prefill_s: float
    step_s: float  # fitted: seconds per denoising step (sampler included)
    canvas_overhead_s: float  # fitted: per canvas beyond its steps (the commit, mostly)
    points: list[Point]
    ar_tokens_per_s: float
    ar_time_to_first_token: float
    crossover_steps: float  # diffusion is faster below this many steps per canvas
    sampler_steps: float | None  # steps per canvas the sampler took (trained weights only)
    sampler_tokens_per_s: float | None
    expected_steps: float  # the steps per canvas the recommendation compares with the crossover ...
    expected_steps_source: str  # ... "measured" (the sampler), "given" (steps_per_canvas) or "assumed"
    step_bytes: dict[str, int]
    step_flops: float
    ar_token_bytes: dict[str, int]
    ar_token_flops: float
    peaks: dict = field(default_factory=dict)
    recommendation: str = ""

    @property
    def step_gbps(self) -> float:
        return self.step_bytes["total"] / self.step_s / 1e9

    @property
    def step_tflops(self) -> float:
        return self.step_flops / self.step_s / 1e12

    def tokens_per_s_at(self, steps: float) -> float:
        """Diffusion tokens/s at `steps` steps per canvas, from the fitted step and overhead times."""
        return self.canvas / (steps * self.step_s + self.canvas_overhead_s)

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(step_gbps=self.step_gbps, step_tflops=self.step_tflops)
        return out


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y = slope * x + intercept."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("need at least two different step counts to fit the time per step")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def crossover(canvas: int, step_s: float, overhead_s: float, ar_tokens_per_s: float) -> float:
    """Steps per canvas at which diffusion's tokens/s equals autoregressive decoding's (may be <= 0:
    autoregressive decoding is faster even at one step)."""
    return (canvas / ar_tokens_per_s - overhead_s) / step_s


def recommend(result: BenchResult) -> str:
    """One sentence: which decoding mode to use here, and why (saying where the steps per canvas come from)."""
    s_star, steps = result.crossover_steps, result.expected_steps
    if result.expected_steps_source == "measured":
        why = f"the sampler took {steps:.1f} steps per canvas on this model"
    elif result.expected_steps_source == "given":
        why = f"at the {steps:g} steps per canvas given (--steps-per-canvas)"
    else:
        why = (
            f"at an assumed {steps:.1f} steps per canvas (random weights: not measured; a model that settles "
            f"like the released one, ~{RELEASED_TOKENS_PER_FORWARD} tokens per forward on "
            f"{RELEASED_CANVAS}-token canvases by its model card and report, and at least the steps its stop "
            "rule needs; give --steps-per-canvas N, or measure a trained model with --model DIR)"
        )
    if s_star < 1:  # the measured speeds decide this, whatever the steps
        return (
            "autoregressive: on this device a denoising step costs more than a whole canvas of AR tokens, "
            f"so diffusion is slower at any step count, {why}"
        )
    ratio = result.tokens_per_s_at(steps) / result.ar_tokens_per_s
    mode = "diffusion" if steps < s_star else "autoregressive"
    return f"{mode}: {why}; diffusion is faster here below {s_star:.1f} (diffusion at {ratio:.2f}x AR's tokens/s)"


def _timed(fn, device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


@torch.no_grad()
def run_bench(
    model: DiffusionGemma | Runner,
    *,
    steps: list[int],
    prompt_tokens: int = 64,
    canvases: int = 2,
    ar_tokens: int | None = None,
    repeats: int = 3,
    sampler_prompt: list[int] | None = None,
    steps_per_canvas: float | None = None,
    progress=None,
) -> BenchResult:
    """Measure `model`, a DiffusionGemma (reference modules) or a Runner (`dgemma.accelerate(model)`: the
    fast ones, as a fast-mode request runs them). `steps`: fixed steps per canvas to measure;
    `sampler_prompt`: token ids to let the sampler decide its own steps on (trained weights);
    `steps_per_canvas`: what the recommendation compares with the crossover (default: the sampler's
    measured steps, else `assumed_steps_per_canvas`)."""
    if len(set(steps)) < 2 or min(steps) < 1:
        raise ValueError(f"give at least two different step counts >= 1 (got {steps})")
    if steps_per_canvas is not None and not steps_per_canvas >= 1:
        raise ValueError(f"steps_per_canvas must be >= 1: a canvas takes at least one step (got {steps_per_canvas})")
    runner = as_runner(model)
    model = runner.model
    c, vocab = model.config.canvas_length, model.text_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(min(8, vocab - 1), vocab, (prompt_tokens,), generator=g).tolist()
    ar_tokens = ar_tokens or c
    tell = progress or (lambda text: None)
    timing = _time_decoding(runner, prompt, steps, canvases, ar_tokens, repeats, tell)
    sampler_steps = sampler_tps = None
    if sampler_prompt is not None:
        tell("the sampler's own steps per canvas")
        result = generate(runner, sampler_prompt, max_new_tokens=canvases * c, seed=0)
        per_row = result.stats.steps_per_canvas[0]
        sampler_steps = statistics.fmean(per_row) if per_row else None
        sampler_tps = result.stats.tokens_per_second
    tell("counting bytes per step")
    bytes_step, bytes_token = _bytes_per_pass(runner, prompt, torch.randint(0, vocab, (1, c), generator=g))
    result = BenchResult(
        device=device_name(model.device),
        params=count_parameters(model.config)["total"],
        active_params=count_parameters(model.config)["active"],
        dtype=str(model.dtype).replace("torch.", ""),
        quant=_quant_mode(model),
        canvas=c,
        prompt_tokens=prompt_tokens,
        **timing,
        crossover_steps=0.0,
        sampler_steps=sampler_steps,
        sampler_tokens_per_s=sampler_tps,
        **_expected_steps(model, steps_per_canvas, sampler_steps),
        step_bytes=bytes_step,
        step_flops=step_flops(model.config, c, prompt_tokens),
        ar_token_bytes=bytes_token,
        ar_token_flops=step_flops(model.config, 1, prompt_tokens, diffusion=False),
    )
    result.crossover_steps = crossover(c, result.step_s, result.canvas_overhead_s, result.ar_tokens_per_s)
    result.recommendation = recommend(result)
    return result


def _time_decoding(runner: Runner, prompt: list[int], steps, canvases: int, ar_tokens: int, repeats: int, tell):
    """Prefill alone, diffusion at each fixed step count and AR decoding, timed round robin (so that a slow
    spell of a shared machine hits all alike): the BenchResult fields they give."""
    model, device = runner.model, runner.model.device
    c = model.config.canvas_length

    def diffusion(n: int, max_new: int):
        # confidence_threshold: never stop early, exactly n steps per canvas
        settings = dict(max_denoising_steps=n, confidence_threshold=1e-30, stop_token_ids=[], seed=0)
        return generate(runner, prompt, max_new_tokens=max_new, **settings)

    tell("warming up")  # lazy initialisation, graph capture
    diffusion(min(steps), c)
    generate_ar(runner, prompt, 4, stop_token_ids=[])
    prompt_ids = torch.tensor([prompt], device=device)

    def prefill():
        runner.encode(prompt_ids, model.new_cache(1, len(prompt) + 2 * c))

    prefill_s = statistics.median(_timed(prefill, device) for _ in range(max(3, repeats)))
    samples: dict[int, list[tuple[float, float]]] = {n: [] for n in steps}
    ar_samples: list[tuple[float, float]] = []
    for r in range(repeats):
        for n in steps:
            tell(f"diffusion, {n} steps per canvas (round {r + 1}/{repeats})")
            synchronize(device)
            stats = diffusion(n, canvases * c).stats
            synchronize(device)
            samples[n].append((stats.elapsed, stats.time_to_first_token or stats.elapsed))
        tell(f"autoregressive, {ar_tokens} tokens (round {r + 1}/{repeats})")
        stats = generate_ar(runner, prompt, ar_tokens, stop_token_ids=[]).stats
        synchronize(device)
        ar_samples.append((stats.elapsed, stats.time_to_first_token or stats.elapsed))
    points = []
    for n in steps:
        per_canvas = max(statistics.median(e for e, _ in samples[n]) - prefill_s, 1e-9) / canvases
        points.append(Point(n, per_canvas, c / per_canvas, statistics.median(t for _, t in samples[n])))
    step_s, overhead_s = fit_line([p.steps for p in points], [p.seconds_per_canvas for p in points])
    ar_elapsed = statistics.median(e for e, _ in ar_samples)
    return {
        "prefill_s": prefill_s,
        "step_s": max(step_s, 1e-9),
        "canvas_overhead_s": max(overhead_s, 0.0),
        "points": points,
        "ar_tokens_per_s": ar_tokens / max(ar_elapsed - prefill_s, 1e-9),
        "ar_time_to_first_token": statistics.median(t for _, t in ar_samples),
    }


def _bytes_per_pass(runner: Runner, prompt: list[int], canvas_ids: torch.Tensor) -> tuple[dict, dict]:
    """Bytes a denoising step and an AR token read, counted on the modules a fast request runs, eagerly:
    a replayed CUDA graph would not call the routers' hooks."""
    running = runner.modules
    c = runner.model.config.canvas_length
    prompt_ids = torch.tensor([prompt], device=runner.model.device)
    cache = runner.model.new_cache(1, len(prompt) + 2 * c)
    running.encode(prompt_ids, cache)
    kv = _kv_read_bytes(cache)
    canvas_ids = canvas_ids.to(runner.model.device)
    bytes_step = step_bytes(running, lambda: running.denoise(canvas_ids, cache), 2, kv)
    bytes_token = step_bytes(running, lambda: running.encode(prompt_ids[:, :1], cache, return_logits=True), 1, kv)
    return bytes_step, bytes_token


def _expected_steps(model: DiffusionGemma, given: float | None, measured: float | None) -> dict:
    if given is not None:
        return {"expected_steps": float(given), "expected_steps_source": "given"}
    if measured is not None:
        return {"expected_steps": measured, "expected_steps_source": "measured"}
    g = model.generation_config
    steps = assumed_steps_per_canvas(model.config.canvas_length, g.stability_threshold, g.max_denoising_steps)
    return {"expected_steps": steps, "expected_steps_source": "assumed"}


def _kv_read_bytes(cache) -> int:
    """Bytes of cached keys and values a forward after the current contents reads."""
    total = 0
    for i, sliding in enumerate(cache.is_sliding):
        n = cache.num_cached(sliding)
        k = cache.keys[i]
        total += 2 * k.shape[0] * k.shape[1] * n * k.shape[3] * k.element_size()
    return total


def _quant_mode(model: DiffusionGemma) -> str | None:
    for m in model.modules():
        mode = getattr(m, "mode", None)
        if isinstance(mode, str) and type(m).__name__.startswith("Quant"):
            return mode
    return None
