"""What an image costs: preprocessing, the vision tower and the prefill of its soft tokens, at each budget.

The released 26B-A4B's tower shape (dgemma.model.vision.RELEASED_VISION_CONFIG, random weights) projects into
the `small` preset's text model (73M parameters), on this machine's CPU in fp32, one image per prompt: a
photo-sized random image (1024x768) resized to each budget's grid. Also the tower's share of the 26B-A4B
model's memory in bf16 and with int4 text weights (dgemma's quantization policy keeps the tower in bf16).

Prints a table and ends with one JSON line. Run: python benchmarks/vision_cost.py [--budgets 70 280]
[--threads N] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import dgemma
from dgemma.images import SOFT_TOKEN_BUDGETS, preprocess
from dgemma.model.vision import RELEASED_VISION_CONFIG, VisionConfig, count_vision_parameters

IMAGE_IDS = {"boi_token_id": 31_997, "image_token_id": 31_998, "eoi_token_id": 31_999}


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def build_model() -> dgemma.DiffusionGemma:
    config = dataclasses.replace(dgemma.preset("small"), vision_config=dict(RELEASED_VISION_CONFIG), **IMAGE_IDS)
    config.text_config.use_bidirectional_attention = "vision"
    return dgemma.build(config, seed=0).eval()


@torch.no_grad()
def measure(model, picture, budget: int, repeats: int) -> dict:
    pre_s, (pixels, counts) = timed(lambda: preprocess([picture], budget), repeats)
    model.image_features(pixels)  # warm-up
    tower_s, features = timed(lambda: model.image_features(pixels), repeats)
    n = counts[0]
    prompt = [2, IMAGE_IDS["boi_token_id"], *[IMAGE_IDS["image_token_id"]] * n, IMAGE_IDS["eoi_token_id"], 100, 101]
    ids = torch.tensor([prompt])

    text_ids = torch.randint(3, 30_000, ids.shape, generator=torch.Generator().manual_seed(1))
    model.encode(text_ids, model.new_cache(1, len(prompt)))  # warm-up
    prefill_s, _ = timed(lambda: model.encode(text_ids, model.new_cache(1, len(prompt))), repeats)
    total_s, _ = timed(lambda: model.encode(ids, model.new_cache(1, len(prompt)), pixels=pixels), repeats)
    return {
        "budget": budget,
        "patch_rows": int(pixels.values.shape[1]),
        "soft_tokens": n,
        "preprocess_s": pre_s,
        "tower_s": tower_s,
        "prefill_s": prefill_s,  # the causal pass over a text prompt of the same length
        "encode_s": total_s,
        "features": list(features.shape),
    }


def memory_shares() -> dict:
    """The tower's bytes beside the 26B-A4B text model's, in bf16 and with int4 text weights."""
    config = dgemma.preset("26b-a4b")
    text = dgemma.count_parameters(config)["total"]
    vision = count_vision_parameters(VisionConfig.from_dict(RELEASED_VISION_CONFIG), config.text_config.hidden_size)
    # int4 with group 64: 4 bits + one bf16 scale per 64 weights over the quantized ~95% (docs/quantization.md)
    int4_text = text * (0.95 * (0.5 + 2 / 64) + 0.05 * 2)
    return {
        "vision_parameters": vision,
        "text_parameters": text,
        "vision_gib_bf16": vision * 2 / 2**30,
        "text_gib_bf16": text * 2 / 2**30,
        "vision_share_bf16": vision / (vision + text),
        "text_gib_int4_approx": int4_text / 2**30,
        "vision_share_int4": vision * 2 / (vision * 2 + int4_text),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=list(SOFT_TOKEN_BUDGETS), choices=SOFT_TOKEN_BUDGETS)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    picture = Image.fromarray(torch.randint(0, 256, (768, 1024, 3), generator=g, dtype=torch.uint8).numpy())
    model = build_model()
    rows = [measure(model, picture, b, args.repeats) for b in args.budgets]
    shares = memory_shares()
    print(f"vision tower: released shape (random weights), {shares['vision_parameters'] / 1e6:.1f}M parameters, fp32")
    print(f"text model: preset small; CPU, {torch.get_num_threads()} threads; one 1024x768 image\n")
    heads = ("budget", "patches", "tokens", "preprocess s", "tower s", "prefill s", "encode s")
    print(" ".join(f"{h:>{w}s}" for h, w in zip(heads, (6, 7, 6, 12, 8, 9, 8), strict=True)))
    for r in rows:
        print(
            f"{r['budget']:6d} {r['patch_rows']:7d} {r['soft_tokens']:6d} {r['preprocess_s']:12.3f} "
            f"{r['tower_s']:8.2f} {r['prefill_s']:9.3f} {r['encode_s']:8.2f}"
        )
    print(
        f"\nmemory (26B-A4B): tower {shares['vision_gib_bf16']:.2f} GiB in bf16 = "
        f"{100 * shares['vision_share_bf16']:.1f}% "
        f"of the bf16 model; beside int4 text weights (~{shares['text_gib_int4_approx']:.1f} GiB) the bf16 tower is "
        f"{100 * shares['vision_share_int4']:.1f}%"
    )
    print(json.dumps({"benchmark": "vision_cost", "threads": torch.get_num_threads(), "rows": rows, "memory": shares}))


if __name__ == "__main__":
    main()
