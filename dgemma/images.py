"""Images -> the vision tower's input (vision.Pixels), with Pillow only: no torchvision, no transformers.

Decode (size checked from the header first), RGB, a bicubic resize to whole cells, patches with their
positions: what transformers' `Gemma4ImageProcessorPil` computes, value for value. Also the prompts with
images (`chat_prompt`, `text_prompt`). The stages step by step: docs/vision.md.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .model.vision import Pixels

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
GEMMA4_IMAGE_TOKENS = ("<|image>", "<|image|>", "<image|>")  # begin of image, placeholder, end of image
DEFAULT_BUDGET = 280
MAX_IMAGE_PIXELS = 50_000_000  # decoded pixels an image may have (a decompression bomb is refused first)
PATCH, KERNEL = 16, 3  # patch_size and pooling_kernel_size where no vision_config says otherwise


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError as e:  # pragma: no cover - Pillow is a dependency
        raise ImportError("images need Pillow: pip install pillow") from e
    return Image, ImageOps


def open_image(source, what: str = "image"):
    """A decoded PIL image from a path, bytes or a PIL image, with a ValueError naming `what` for anything
    that is not one (not an image, truncated, empty, too many pixels). Paths and bytes get their EXIF
    orientation applied, as transformers does for the images it loads itself."""
    Image, _ = _pil()
    if isinstance(source, Image.Image):
        _check_size(source, what)
        return source
    return decode(peek(source, what), what)


def peek(source, what: str = "image"):
    """The image of a path or bytes with only its header read: its size and mode known (the size checked
    against MAX_IMAGE_PIXELS), its pixels not decoded yet (`decode` does that)."""
    Image, _ = _pil()
    if isinstance(source, str | Path):
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise ValueError(f"{what}: cannot read {source} ({e.strerror or e})") from None
    elif isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
    else:
        raise ValueError(f"{what}: expected a path, bytes or a PIL image (got {type(source).__name__})")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:  # far past our own cap: Pillow refuses it at once
        raise ValueError(f"{what} has more pixels than an image may have ({e})") from None
    except (Image.UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{what} is not an image Pillow can read ({e})") from None
    _check_size(image, what)
    return image


def decode(image, what: str = "image"):
    """An image from `peek` decoded, its EXIF orientation applied in place (no second full-size copy)."""
    _, ImageOps = _pil()
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise ValueError(f"{what} could not be decoded: {e}") from None
    _check_size(image, what)
    return image


def _check_size(image, what: str) -> None:
    w, h = image.size
    if w <= 0 or h <= 0:
        raise ValueError(f"{what} has no pixels ({w}x{h})")
    if w * h > MAX_IMAGE_PIXELS:
        raise ValueError(f"{what} has {w}x{h} pixels, more than the {MAX_IMAGE_PIXELS:,} an image may have")


def to_rgb(image):
    """RGB, with any transparency composited onto white (as transformers' convert_to_rgb); an RGB image
    without transparency is returned as it is, not copied."""
    Image, _ = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def check_budget(budget: int) -> int:
    if isinstance(budget, bool) or budget not in SOFT_TOKEN_BUDGETS:
        raise ValueError(f"max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS} (got {budget!r})")
    return budget


def geometry(config) -> dict[str, int]:
    """A checkpoint's patch_size and pooling_kernel_size (its vision_config; Gemma 4's 16 and 3 where it has
    none), as the keywords of preprocess and count_soft_tokens."""
    vision = getattr(config, "vision_config", None) or {}
    get = vision.get if isinstance(vision, dict) else lambda name, default: getattr(vision, name, default)
    return {"patch_size": get("patch_size", PATCH), "pooling_kernel_size": get("pooling_kernel_size", KERNEL)}


def target_size(
    height: int, width: int, budget: int, patch_size: int = PATCH, pooling_kernel_size: int = KERNEL
) -> tuple[int, int]:
    """The resized (height, width): whole cells of k x p pixels, at most k^2 x budget patches, aspect kept."""
    cell, max_patches = patch_size * pooling_kernel_size, budget * pooling_kernel_size**2
    factor = math.sqrt(max_patches * patch_size**2 / (height * width))
    h, w = math.floor(factor * height / cell) * cell, math.floor(factor * width / cell) * cell
    longest = budget * cell  # a one-cell-wide strip holds at most `budget` cells
    if h == 0 and w == 0:
        raise ValueError(f"an image of {height}x{width} pixels cannot be resized to whole {cell}-pixel cells")
    if h == 0:
        h, w = cell, min(math.floor(width / height) * cell, longest)
    elif w == 0:
        w, h = cell, min(math.floor(height / width) * cell, longest)
    return h, w


def patchify(image, patch_size: int = PATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """An RGB PIL image of whole patches -> patches [P, p*p*3] in [0, 1] and their (x, y) [P, 2]."""
    w, h = image.size
    raw = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3)
    pixels = (raw.double() * (1 / 255)).float()  # float64 then float32, as numpy does it there
    p = patch_size
    ph, pw = h // p, w // p
    patches = pixels.view(ph, p, pw, p, 3).permute(0, 2, 1, 3, 4).reshape(ph * pw, -1)
    ys, xs = torch.meshgrid(torch.arange(ph), torch.arange(pw), indexing="ij")
    return patches, torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)


def count_soft_tokens(
    source, budget: int = DEFAULT_BUDGET, *, patch_size: int = PATCH, pooling_kernel_size: int = KERNEL
) -> int:
    """The soft tokens an image takes at `budget` (its placeholders), from its size alone."""
    image = open_image(source)
    th, tw = target_size(image.size[1], image.size[0], budget, patch_size, pooling_kernel_size)
    return (th // patch_size) * (tw // patch_size) // pooling_kernel_size**2


@dataclass(frozen=True)
class Resized:
    """An image in RGB at its target size for `budget` soft tokens of a tower's geometry (resize_image makes
    it): preprocess takes it as it is. What the server keeps of a decoded image (server/media.py)."""

    image: Any  # a PIL image
    budget: int
    patch_size: int = PATCH
    pooling_kernel_size: int = KERNEL


def resize_image(
    source,
    budget: int = DEFAULT_BUDGET,
    what: str = "image",
    *,
    patch_size: int = PATCH,
    pooling_kernel_size: int = KERNEL,
) -> Resized:
    """An image (a path, bytes, a PIL image, or a Resized for the same budget and geometry) decoded, in RGB
    and resized (bicubic) to its target size: the first half of preprocess. The decoded image is let go as
    soon as the resized one exists."""
    Image, _ = _pil()
    check_budget(budget)
    if isinstance(source, Resized):
        made = (source.budget, source.patch_size, source.pooling_kernel_size)
        if made != (budget, patch_size, pooling_kernel_size):
            raise ValueError(
                f"{what} was resized for (budget, patch_size, pooling_kernel_size) {made}, not "
                f"{(budget, patch_size, pooling_kernel_size)}"
            )
        return source
    image = to_rgb(open_image(source, what))
    w, h = image.size
    th, tw = target_size(h, w, budget, patch_size, pooling_kernel_size)
    if (th, tw) != (h, w):
        image = image.resize((tw, th), resample=Image.Resampling.BICUBIC)
    return Resized(image, budget, patch_size, pooling_kernel_size)


def preprocess(
    images: Sequence,
    budget: int = DEFAULT_BUDGET,
    what: str = "image",
    *,
    patch_size: int = PATCH,
    pooling_kernel_size: int = KERNEL,
) -> tuple[Pixels, list[int]]:
    """Images (paths, bytes, PIL images or Resized) -> the tower's Pixels and each image's soft-token count
    (the number of placeholders its prompt needs), cut for a tower of `patch_size` and `pooling_kernel_size`
    (geometry(config) gives a checkpoint's). One image is decoded at a time. Errors name `what` and the
    image's index."""
    check_budget(budget)
    pool = pooling_kernel_size**2
    rows = budget * pool
    values = torch.zeros(len(images), rows, 3 * patch_size**2)
    positions = torch.full((len(images), rows, 2), -1, dtype=torch.long)
    counts = []
    cut = {"patch_size": patch_size, "pooling_kernel_size": pooling_kernel_size}
    for i, source in enumerate(images):
        name = f"{what} {i}" if len(images) > 1 else what
        patches, xy = patchify(resize_image(source, budget, name, **cut).image, patch_size)
        values[i, : len(patches)] = patches
        positions[i, : len(patches)] = xy
        counts.append(len(patches) // pool)
    return Pixels(values, positions), counts


# ------------------------------------------------------------------------------------------------
# Prompts with images


def image_token_strings(tokenizer, config) -> tuple[str, str, str]:
    """The (begin-of-image, image placeholder, end-of-image) token strings of a checkpoint."""
    ids = (config.boi_token_id, config.image_token_id, config.eoi_token_id)
    if any(i is None for i in ids):
        raise ValueError("this checkpoint's config.json has no image token ids (boi, image, eoi): text only")
    strings = tuple(tokenizer.id_to_token(i) for i in ids)
    if any(s is None for s in strings):
        raise ValueError(f"the tokenizer has no tokens for the image ids {ids}")
    return strings


def expand_image_tokens(text: str, counts: list[int], tokens: tuple[str, str, str]) -> str:
    """Each image token of `text` (one per image, as a chat template writes them) -> begin-of-image, that
    image's placeholders, end-of-image: what transformers' Gemma 4 processor does."""
    boi, image, eoi = tokens
    pieces = text.split(image)
    if len(pieces) - 1 != len(counts):
        raise ValueError(f"the prompt has {len(pieces) - 1} image tokens ({image}) for {len(counts)} images")
    return pieces[0] + "".join(f"{boi}{image * n}{eoi}{rest}" for n, rest in zip(counts, pieces[1:], strict=True))


def text_prompt(
    tokenizer, config, text: str, images: Sequence, budget: int = DEFAULT_BUDGET, *, add_special_tokens: bool = True
):
    """Token ids of `text` (one image token per image) with the images' placeholders, and their Pixels (cut
    as the checkpoint's vision_config says)."""
    pixels, counts = preprocess(images, budget, **geometry(config))
    expanded = expand_image_tokens(text, counts, image_token_strings(tokenizer, config))
    return tokenizer.encode(expanded, add_special_tokens=add_special_tokens), pixels


VIDEO_MARKER = "<|video|>"  # what a chat template writes for a video part (Gemma 4's video token)
VIDEO_FRAME_BUDGET = 70  # soft tokens per video frame, as Gemma 4's processor gives them


def frames_text(counts: list[int], fps: float, tokens: tuple[str, str, str]) -> str:
    """A video's frames as Gemma 4's processor lays them out: "MM:SS <frame>" for each frame, joined by
    spaces, each frame begin-of-image, its placeholders, end-of-image (DiffusionGemma has no video token,
    so the placeholders are image tokens), the time of frame k being k / fps."""
    boi, image, eoi = tokens

    def stamp(k: int) -> str:
        seconds = int(k / fps)
        return f"{seconds // 60:02d}:{seconds % 60:02d}"

    return " ".join(f"{stamp(k)} {boi}{image * n}{eoi}" for k, n in enumerate(counts))
