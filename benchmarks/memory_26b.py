"""Peak memory of the real 26B-A4B model with quantized weights, on CPU: built directly, or loaded from disk.

Direct (the default): builds the `26b-a4b` configuration (25.25B parameters, 128 experts) directly in its
quantized form: the policy's layers (attention, dense MLP, experts; dgemma.quant) hold random codes and
scales, everything else (embedding / LM head, router, norms, self-conditioning) random bf16. Nothing is
ever materialised in bf16 first. Then it runs what generation does for one canvas: encode a prompt, one
full 256-token denoising step, and the commit (encoding the canvas), and reports the peak resident memory
of the process (getrusage), the parameter bytes by component, and the time of each phase. The bf16 and
int8 parameter bytes are computed, not run. Random weights: the numbers are about memory and time, not text.

    python benchmarks/memory_26b.py [--quant int4] [--group-size 64] [--prompt 64] [--threads N]

Needs ~15 GB of free memory for int4 (~27 GB for int8).

From disk (`--from-disk`): the quantize-while-loading path, `dgemma.load(DIR, quant=...)` on a bf16
checkpoint. It writes random bf16 checkpoints of N full-size 26b-a4b layers (N - 1 sliding-attention
layers, then a full-attention one, as a config must end), one safetensors file per layer written one at a
time with dgemma.checkpoints.weights (never the whole model), then for each N, in fresh processes: load with
quantization, encode, one denoising step, commit; and the direct build of the same N layers beside it.
It fits peak memory and times per layer and extrapolates them to the model's 30 layers. Besides
getrusage's exact peak it samples the two parts of resident memory (/proc/self/status): anonymous (what
the process allocated) and file-backed (pages of the memory-mapped safetensors files touched while they
stay mapped: clean, reclaimable by the kernel, but counted). The page cache of each checkpoint is dropped
before it loads, and the files are deleted at the end (`--keep` keeps them).

    python benchmarks/memory_26b.py --from-disk [--layers 1 2 3 4] [--dir /tmp/mem26b] [--threads 1]

With the default 1 2 3 4 layers: ~8 GB of disk, ~11 GB of memory, ~9 minutes on one thread.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import torch

import dgemma
from dgemma.checkpoints.weights import atomic_save_tensors, atomic_write_bytes, hf_state_dict
from dgemma.model.config import FULL, DiffusionGemmaConfig
from dgemma.model.model import DiffusionGemma
from dgemma.quant import QuantExperts, QuantLinear, QuantSpec, describe, swap_modules, targets

GIB = 2**30
REAL_LAYERS = 30


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_parts() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process (Linux /proc/self/status)."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split(":")
                parts[key] = int(value.split()[0]) * 1024
    return parts["RssAnon"], parts["RssFile"]


class Laps:
    """Seconds of each phase, and the peaks of anonymous and file-backed resident memory during it,
    sampled every `interval` seconds on a thread (a transient shorter than that can be missed; getrusage,
    recorded at each phase's end, is exact for their sum)."""

    def __init__(self, interval: float = 0.01):
        self.interval, self.laps = interval, {}
        self._anon, self._file = rss_parts()
        self._start = time.perf_counter()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            anon, file = rss_parts()
            self._anon, self._file = max(self._anon, anon), max(self._file, file)

    def lap(self, name: str) -> None:
        """End the current phase as `name`."""
        anon, file = rss_parts()
        now = time.perf_counter()
        self.laps[name] = {
            "seconds": now - self._start,
            "peak_anon_bytes": max(self._anon, anon),
            "peak_file_bytes": max(self._file, file),
            "peak_rss_bytes_so_far": peak_rss_bytes(),
        }
        self._anon, self._file, self._start = anon, file, time.perf_counter()

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        return self.laps


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
            else:
                fill_float(name, t, g)


def fill_float(name: str, t: torch.Tensor, g: torch.Generator) -> None:
    """A float weight's random value: norm scales and layer scalars 1, everything else N(0, 0.02)."""
    if "norm" in name or name.endswith("scalar") or name.endswith("scale"):
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


def config_with_layers(num_layers: int | None) -> DiffusionGemmaConfig:
    """The 26b-a4b configuration, or one of `num_layers` full-size layers: the real model's first
    `num_layers - 1` layer types, then a full-attention layer (a config must end with one, as the
    reference's does: dgemma.model.config forces it)."""
    config = dgemma.preset("26b-a4b")
    if num_layers:
        config.text_config.num_hidden_layers = num_layers
        config.text_config.layer_types = [*config.text_config.layer_types[: num_layers - 1], FULL]
    return config


def build_direct(config: DiffusionGemmaConfig, mode: str, group_size: int) -> tuple[DiffusionGemma, int]:
    """The model built directly in its quantized form with random weights, and its parameter count."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # float parameters in bf16; codes and scales have their own dtypes
    try:
        with torch.device("meta"):
            model = DiffusionGemma(config)
            n_params = sum(t.numel() for t in model.parameters())
            swap_modules(model, dict.fromkeys(targets(model), QuantSpec.of(mode, group_size)), empty=True)
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device="cpu")
    fill_random(model)
    model.quantization = describe(mode, group_size)
    return model, n_params


def param_bytes(model: DiffusionGemma, n_params: int) -> tuple[dict[str, int], int, int]:
    """Bytes by component of the quantized model, and the bf16 and int8 totals (computed)."""
    by_component: dict[str, int] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        by_component[component(name)] = by_component.get(component(name), 0) + t.nbytes
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
    return by_component, bf16_bytes, int8_bytes


def run_canvas(model: dgemma.Runner, prompt_len: int, laps: Laps) -> None:
    """What generation does for one canvas: encode the prompt, one denoising step, the commit."""
    config = model.config
    cache = model.new_cache(batch_size=1, max_length=prompt_len + 2 * config.canvas_length)
    prompt = torch.randint(0, config.text_config.vocab_size, (1, prompt_len))
    canvas = torch.randint(0, config.text_config.vocab_size, (1, config.canvas_length))
    model.encode(prompt, cache)
    laps.lap("encode prompt")
    logits = model.denoise(canvas, cache)
    laps.lap("denoising step (256-token canvas)")
    model.encode(logits.argmax(-1), cache)
    laps.lap("commit (encode the canvas)")


def main_direct(args: argparse.Namespace) -> None:
    """The model built directly in quantized form: parameter bytes, phase times, peak memory."""
    num_layers = args.layers[0] if args.layers else None
    config = config_with_layers(num_layers)
    rss0 = rss_bytes()
    laps = Laps()
    model, n_params = build_direct(config, args.quant, args.group_size)
    runner = dgemma.accelerate(model)
    laps.lap("build")
    rss_built = rss_bytes()
    by_component, bf16_bytes, int8_bytes = param_bytes(model, n_params)
    total = sum(by_component.values())
    run_canvas(runner, args.prompt, laps)
    phases = laps.stop()
    peak = peak_rss_bytes()

    print(
        f"26b-a4b{'' if not num_layers else f' ({num_layers} layers only)'}, weights {args.quant}"
        f"{f' (group {args.group_size})' if args.quant == 'int4' else ''}, random; {torch.get_num_threads()} threads"
    )
    print("\n| component | bytes |\n|---|---:|")
    for name, b in sorted(by_component.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {b / GIB:.2f} GiB |")
    print(f"| **total ({args.quant})** | **{total / GIB:.2f} GiB** |")
    print(f"| total if bf16 (computed) | {bf16_bytes / GIB:.2f} GiB |")
    print(f"| total if int8 (computed) | {int8_bytes / GIB:.2f} GiB |")
    vision = vision_bytes(config)
    print(
        f"| + the vision tower, bf16 in every mode (computed) | {vision / GIB:.2f} GiB: "
        f"{100 * vision / (vision + total):.1f}% beside {args.quant}, {100 * vision / (vision + bf16_bytes):.1f}% "
        "beside bf16 |"
    )
    print("\n| phase | seconds |\n|---|---:|")
    for name, lap in phases.items():
        print(f"| {f'build (random {args.quant} weights)' if name == 'build' else name} | {lap['seconds']:.1f} |")
    print(
        f"\npeak resident memory: {peak / GIB:.2f} GiB (process at start {rss0 / GIB:.2f} GiB, "
        f"after building {rss_built / GIB:.2f} GiB)"
    )
    record = {
        "benchmark": "memory_26b",
        "mode": "direct",
        "quant": args.quant,
        "group_size": args.group_size if args.quant == "int4" else None,
        "layers": config.text_config.num_hidden_layers,
        "parameters": n_params,
        "param_bytes": total,
        "param_bytes_by_component": by_component,
        "bf16_param_bytes": bf16_bytes,
        "int8_param_bytes": int8_bytes,
        "vision_tower_bytes_bf16": vision,  # not built here (the text model is); computed from its shape
        "peak_rss_bytes": peak,
        "peak_rss_gib": peak / GIB,
        "seconds": {name: lap["seconds"] for name, lap in phases.items()},
        "phases": phases,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(record))
    sys.stdout.flush()


def vision_bytes(config: DiffusionGemmaConfig) -> int:
    """The released vision tower and projection in bf16 (dgemma's quantization keeps it so)."""
    from dgemma.model.vision import RELEASED_VISION_CONFIG, VisionConfig, count_vision_parameters

    tower = VisionConfig.from_dict(RELEASED_VISION_CONFIG)
    return 2 * count_vision_parameters(tower, config.text_config.hidden_size)


# ------------------------------------------------------------------------------------------------
# From disk: a random bf16 checkpoint, loaded with quantization


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def shard_plan(num_layers: int) -> dict[str, dict[str, torch.Size]]:
    """The tensors of a `num_layers` checkpoint by file: one file per layer, named by its index and
    attention type (so checkpoints of several layer counts share files), and one for the rest."""
    config = config_with_layers(num_layers)
    with torch.device("meta"):
        meta = DiffusionGemma(config)
    plan: dict[str, dict[str, torch.Size]] = {}
    for name, t in hf_state_dict(meta):
        fname = "rest.safetensors"
        if m := _LAYER.search(name):
            i = int(m.group(1))
            fname = f"layer-{i:05d}-{config.text_config.layer_types[i]}.safetensors"
        plan.setdefault(fname, {})[name] = t.shape
    return plan


def write_shards(root: Path, plan: dict[str, dict[str, torch.Size]]) -> None:
    """Write the files of `plan` that `root` lacks, random bf16, each filled and written before the next
    is made (at most one layer is ever in memory), through dgemma.checkpoints.weights' atomic writer."""
    for fname, entries in sorted(plan.items()):
        if (root / fname).exists():
            continue
        g = torch.Generator().manual_seed(zlib.crc32(fname.encode()))  # the same values in every run
        tensors = {}
        for name, shape in entries.items():
            tensors[name] = torch.empty(shape, dtype=torch.bfloat16)
            fill_float(name, tensors[name], g)
        atomic_save_tensors(tensors, root / fname, {"format": "pt"})
        del tensors


def link_checkpoint(root: Path, plan: dict[str, dict[str, torch.Size]], num_layers: int) -> Path:
    """A checkpoint directory `root/layers-N`: config.json, a safetensors index, and hard links to the
    shared files of `plan`."""
    out = root / f"layers-{num_layers}"
    out.mkdir(exist_ok=True)
    for fname in plan:
        if not (out / fname).exists():
            os.link(root / fname, out / fname)
    weight_map = {name: fname for fname, entries in plan.items() for name in entries}
    total = sum(2 * shape.numel() for entries in plan.values() for shape in entries.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_bytes(out / "model.safetensors.index.json", json.dumps(index, indent=2).encode())
    config = config_with_layers(num_layers).to_dict()
    config["dtype"] = "bfloat16"
    atomic_write_bytes(out / "config.json", json.dumps(config, indent=2).encode())
    return out


def drop_page_cache(directory: Path) -> None:
    """Evict the checkpoint's files from the page cache (its own pages only), so each load reads the disk."""
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def mapped_files(directory: Path) -> list[str]:
    """Files of `directory` that this process still has memory-mapped (Linux /proc/self/maps)."""
    prefix = str(directory.resolve())
    with open("/proc/self/maps") as f:
        names = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    return sorted(Path(n).name for n in names if n.startswith(prefix))


def measure_checkpoint(args: argparse.Namespace) -> None:
    """One layer count, in this (fresh) process: load with quantization, then one canvas."""
    directory = Path(args.checkpoint)
    rss0 = rss_bytes()
    laps = Laps()
    model = dgemma.load(directory, quant=args.quant, group_size=args.group_size)
    runner = dgemma.accelerate(model)
    laps.lap("load + quantize")
    anon, file = rss_parts()
    mapped = mapped_files(directory)
    run_canvas(runner, args.prompt, laps)
    phases = laps.stop()
    record = {
        "benchmark": "memory_26b",
        "mode": "from-disk-one",
        "quant": args.quant,
        "layers": model.text_config.num_hidden_layers,
        "param_bytes": sum(t.nbytes for t in list(model.parameters()) + list(model.buffers())),
        "checkpoint_bytes": sum(p.stat().st_size for p in directory.glob("*.safetensors")),
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_at_start_bytes": rss0,
        "after_load": {"anon_bytes": anon, "file_bytes": file, "mapped_checkpoint_files": len(mapped)},
        "phases": phases,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(record))
    sys.stdout.flush()


def run_child(args: argparse.Namespace, extra: list[str]) -> dict:
    """Run this script in a fresh process (peaks never reset within one) and return its JSON line."""
    cmd = [sys.executable, __file__, "--quant", args.quant, "--group-size", str(args.group_size)]
    cmd += ["--prompt", str(args.prompt), *extra]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ys against xs."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if n > 1 else 0.0
    return slope, my - slope * mx


def row_of(disk: dict, direct: dict) -> dict[str, float]:
    """The quantities fitted per layer count, from one from-disk and one direct measurement."""
    ph = disk["phases"]
    peak_anon = max(lap["peak_anon_bytes"] for lap in ph.values())
    return {
        "checkpoint GiB": disk["checkpoint_bytes"] / GIB,
        "load s": ph["load + quantize"]["seconds"],
        "encode s": ph["encode prompt"]["seconds"],
        "step s": ph["denoising step (256-token canvas)"]["seconds"],
        "commit s": ph["commit (encode the canvas)"]["seconds"],
        "peak RSS GiB": disk["peak_rss_bytes"] / GIB,
        "peak anon GiB": peak_anon / GIB,
        "peak file GiB": max(lap["peak_file_bytes"] for lap in ph.values()) / GIB,
        "after load anon GiB": disk["after_load"]["anon_bytes"] / GIB,
        "after load file GiB": disk["after_load"]["file_bytes"] / GIB,
        "direct peak RSS GiB": direct["peak_rss_bytes"] / GIB,
        "direct build s": direct["seconds"]["build"],
    }


def full_attention_extra() -> tuple[int, int]:
    """Bytes (bf16, int4 group 64) the real model holds beyond the fit's 30 layers: the fit's layer
    counts have one full-attention layer each (the last), the real model five, and a full-attention
    layer has larger q / o projections than a sliding one."""
    with torch.device("meta"):
        model = DiffusionGemma(config_with_layers(None))
        kinds = model.text_config.layer_types
        bf16 = [2 * sum(p.numel() for p in layer.parameters()) for layer in model.layers]
        swap_modules(model, dict.fromkeys(targets(model), QuantSpec.of("int4", 64)), empty=True)
        int4 = [sum(t.nbytes for t in list(layer.parameters()) + list(layer.buffers())) for layer in model.layers]
    sliding, full = kinds.index("sliding_attention"), kinds.index(FULL)
    n_full = kinds.count(FULL) - 1
    return n_full * (bf16[full] - bf16[sliding]), n_full * (int4[full] - int4[sliding])


def print_fit(rows: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
    """One table row per quantity: each layer count, the fitted slope and intercept, and the value
    extrapolated to 30 layers. Returns the fits."""
    counts = sorted(rows)
    head = " | ".join(f"{n} layer{'s' if n > 1 else ''}" for n in counts)
    print(f"\n| quantity | {head} | per layer | intercept | {REAL_LAYERS} layers (extrapolated) |")
    print("|---" + "|---:" * (len(counts) + 3) + "|")
    fits = {}
    for key in rows[counts[0]]:
        ys = [rows[n][key] for n in counts]
        slope, intercept = fit(counts, ys)
        fits[key] = {"per_layer": slope, "intercept": intercept, "at_30": intercept + REAL_LAYERS * slope}
        cells = " | ".join(f"{y:.2f}" for y in ys)
        print(f"| {key} | {cells} | {slope:.2f} | {intercept:.2f} | {fits[key]['at_30']:.2f} |")
    return fits


def cleanup(root: Path, counts: list[int]) -> None:
    """Delete what write_shards and link_checkpoint made (and `root` if that leaves it empty)."""
    for n in counts:
        shutil.rmtree(root / f"layers-{n}", ignore_errors=True)
    for path in [*root.glob("layer-*.safetensors"), root / "rest.safetensors"]:
        path.unlink(missing_ok=True)
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()


def measure_counts(args: argparse.Namespace, root: Path, counts: list[int]) -> tuple[dict, dict, float]:
    """Each layer count in turn: its files written (the ones it shares with the previous count kept),
    from-disk and direct measurements in fresh processes, files no later count needs deleted."""
    plans = {n: shard_plan(n) for n in counts}
    rows, records, write_s = {}, {}, 0.0
    for k, n in enumerate(counts):
        t = time.perf_counter()
        write_shards(root, plans[n])
        write_s += time.perf_counter() - t
        directory = link_checkpoint(root, plans[n], n)
        drop_page_cache(directory)
        disk = run_child(args, ["--checkpoint", str(directory)])
        direct = run_child(args, ["--layers", str(n)])
        rows[n], records[n] = row_of(disk, direct), {"from_disk": disk, "direct": direct}
        print(f"{n} layers: peak RSS {rows[n]['peak RSS GiB']:.2f} GiB", file=sys.stderr, flush=True)
        shutil.rmtree(directory)
        later = set().union(*(plans[m] for m in counts[k + 1 :]))
        for fname in set(plans[n]) - later:
            (root / fname).unlink()
    return rows, records, write_s


def main_from_disk(args: argparse.Namespace) -> None:
    """Write the checkpoint, measure each layer count in fresh processes, fit and extrapolate."""
    counts = sorted(set(args.layers or [1, 2, 3, 4]))
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    need = (1.7 * max(counts) + 1.6) * GIB
    if shutil.disk_usage(root).free < need:
        raise ValueError(
            f"{root} has {shutil.disk_usage(root).free / GIB:.1f} GiB free, the checkpoint needs "
            f"{need / GIB:.1f} GiB; pass fewer --layers or another --dir"
        )
    t0 = time.perf_counter()
    try:
        rows, records, write_s = measure_counts(args, root, counts)
    finally:
        if not args.keep:
            cleanup(root, counts)
    extra_bf16, extra_int4 = full_attention_extra()

    threads = args.threads or torch.get_num_threads()
    print(
        f"26b-a4b, N full-size layers (N - 1 sliding-attention, the last full attention), {args.quant} from a "
        f"random bf16 checkpoint on disk (dgemma.load(quant={args.quant!r})) vs built directly; {threads} "
        f"threads; checkpoints written in {write_s:.0f} s"
    )
    fits = print_fit(rows)
    mapped = [records[n]["from_disk"]["after_load"]["mapped_checkpoint_files"] for n in counts]
    print(
        f"\nRSS = anonymous + file-backed; file-backed = pages of the mapped safetensors files touched so far. "
        f"Checkpoint files still mapped after load: {mapped} (of {[n + 1 for n in counts]}).\n"
        f"The extrapolation to {REAL_LAYERS} layers (29 sliding, 1 full) ignores the real model's 4 other "
        f"full-attention layers: {extra_int4 / GIB:.2f} GiB more in int4 ({extra_bf16 / GIB:.2f} GiB in bf16). "
        f"Total {time.perf_counter() - t0:.0f} s."
    )
    record = {
        "benchmark": "memory_26b",
        "mode": "from-disk",
        "quant": args.quant,
        "group_size": args.group_size if args.quant == "int4" else None,
        "layers": counts,
        "rows": {str(n): rows[n] for n in counts},
        "fits": fits,
        "extrapolated_to_layers": REAL_LAYERS,
        "full_attention_extra_bytes": {"bf16": extra_bf16, "int4": extra_int4},
        "write_seconds": write_s,
        "total_seconds": time.perf_counter() - t0,
        "runs": {str(n): records[n] for n in counts},
        "threads": args.threads or torch.get_num_threads(),
    }
    print(json.dumps(record))
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="int4", choices=["int4", "int8", "fp8", "nvfp4"])
    ap.add_argument("--group-size", type=int, default=64, help="int4 group size (default 64)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens encoded before the canvas")
    ap.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=None,
        help="fewer layers (direct: one count, a quick check, not the real model; --from-disk: the counts "
        "to measure and fit, default 1 2 3 4)",
    )
    ap.add_argument("--from-disk", action="store_true", help="measure dgemma.load(quant=...) on a bf16 checkpoint")
    ap.add_argument("--dir", default="/tmp/mem26b", help="where --from-disk writes its checkpoint")
    ap.add_argument("--keep", action="store_true", help="keep the --from-disk checkpoint files")
    ap.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)  # one from-disk measurement
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.layers and min(args.layers) < 1:
        ap.error(f"--layers must be positive, got {args.layers}")
    if args.checkpoint:
        measure_checkpoint(args)
    elif args.from_disk:
        main_from_disk(args)
    elif args.layers and len(args.layers) > 1:
        ap.error("--layers takes one count without --from-disk")
    else:
        main_direct(args)


if __name__ == "__main__":
    main()
