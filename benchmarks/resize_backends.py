"""How far transformers' torchvision image backend is from its Pillow backend, which dgemma follows.

`AutoImageProcessor` picks `Gemma4ImageProcessor` (torchvision) when torchvision imports, otherwise
`Gemma4ImageProcessorPil`. dgemma's preprocessing equals the Pillow one value for value
(tests/test_images.py); this script measures, on this machine's CPU, what a user of the torchvision one
sees instead: the pixel values of both backends on generated pictures (smooth, noisy, hard-edged), for
several sizes and every budget, compared in 8-bit levels (1 level = 1/255).

Needs torchvision (`pip install torchvision` matching torch's build). Only its Python transforms are
used, so a wheel whose compiled ops do not load against this torch (a CUDA wheel beside a CPU torch) is
still usable: the script then skips the ops' registration and says so.

Prints a table and ends with one JSON line. Run: python benchmarks/resize_backends.py
"""

from __future__ import annotations

import importlib
import json
import sys
import types

import torch

SIZES = [(64, 64), (333, 517), (640, 480), (1001, 999), (4000, 3000), (50, 1000)]  # (w, h)
KINDS = ("smooth", "noisy", "edges")


def import_torchvision() -> str:
    """Import torchvision; if its compiled ops cannot register (wrong build), import it without them."""
    try:
        return importlib.import_module("torchvision").__version__
    except (RuntimeError, OSError):
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        version = importlib.import_module("torchvision").__version__
        return f"{version} (its compiled ops did not load; the transforms used here do not need them)"


def picture(kind: str, w: int, h: int, seed: int):
    """A generated RGB picture: gradients, gradients plus noise, or flat shapes with sharp edges."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    base = torch.stack([x, y, (x + y) / 2], -1) * 230
    if kind == "noisy":
        base = base * 0.8 + torch.randint(0, 55, (h, w, 3), generator=g)
    if kind != "edges":
        return Image.fromarray(base.to(torch.uint8).numpy(), "RGB")
    image = Image.new("RGB", (w, h), (235, 235, 235))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(torch.randint(0, w, (1,), generator=g)), int(torch.randint(0, h, (1,), generator=g))
        r = max(1, int(torch.randint(1, max(2, min(w, h) // 3), (1,), generator=g)))
        colour = tuple(int(c) for c in torch.randint(0, 256, (3,), generator=g))
        draw.rectangle((x0 - r, y0 - r, x0 + r, y0 + r), fill=colour)
        draw.ellipse((x0 - r // 2, y0 - r // 2, x0 + r // 2, y0 + r // 2), fill=colour[::-1])
    return image


def compare(budget: int, kind: str) -> dict:
    """Both backends over every size at one budget and content kind: differences in 8-bit levels."""
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    pil, tv = Gemma4ImageProcessorPil(max_soft_tokens=budget), Gemma4ImageProcessor(max_soft_tokens=budget)
    diffs = []
    for i, (w, h) in enumerate(SIZES):
        image = picture(kind, w, h, seed=i)
        a, b = pil(images=[image], return_tensors="pt"), tv(images=[image], return_tensors="pt")
        assert torch.equal(a["image_position_ids"], b["image_position_ids"]), "the patch grids differ"
        real = a["image_position_ids"][0, :, 0] >= 0  # padding rows are zero in both
        diffs.append(((a["pixel_values"][0, real] - b["pixel_values"][0, real]).abs() * 255).flatten())
    d = torch.cat(diffs).double()
    return {
        "budget": budget,
        "content": kind,
        "values": d.numel(),
        "differ_%": round(100 * (d > 0.5).double().mean().item(), 2),
        "ulp_only_%": round(100 * ((d > 0) & (d <= 0.5)).double().mean().item(), 2),
        "mean_levels": round(d.mean().item(), 4),
        "max_levels": round(d.max().item(), 2),
    }


def main() -> None:
    version = import_torchvision()
    import transformers

    print(f"torchvision {version}, transformers {transformers.__version__}, torch {torch.__version__} (CPU)")
    print(f"sizes (w x h): {', '.join(f'{w}x{h}' for w, h in SIZES)}")
    print(f"{'budget':>6s} {'content':8s} {'values':>10s} {'differ':>8s} {'1-ulp':>7s} {'mean':>8s} {'max':>6s}")
    rows = []
    for budget in (70, 140, 280, 560, 1120):
        for kind in KINDS:
            r = compare(budget, kind)
            rows.append(r)
            print(
                f"{budget:6d} {kind:8s} {r['values']:10d} {r['differ_%']:7.2f}% {r['ulp_only_%']:6.2f}% "
                f"{r['mean_levels']:8.4f} {r['max_levels']:6.2f}"
            )
    print("differ: values off by at least half a level (the resize); 1-ulp: off by float32 rounding only")
    print(json.dumps({"benchmark": "resize_backends", "torchvision": version, "rows": rows}))


if __name__ == "__main__":
    main()
