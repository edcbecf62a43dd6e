"""A request's prompt as token rows: text, ids or a batch of either; images placed; rows left-padded."""

from __future__ import annotations

import torch

from .images import text_prompt
from .model import DiffusionGemma


def prompt_rows(prompt, tokenizer) -> list[list[int]]:
    """A prompt as a batch of token-id rows: text (with `tokenizer`), ids, a list of either, or a tensor."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist() if prompt.dim() == 2 else [prompt.tolist()]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a string, a list of token ids, or a list of those")
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    rows = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (pass tokenizer=Tokenizer.from_dir(...))")
            p = tokenizer.encode(p)
        if not isinstance(p, list) or not p or not all(isinstance(t, int) for t in p):
            raise ValueError("each prompt must be a non-empty string or a non-empty list of token ids")
        rows.append(p)
    return rows


def with_images(model: DiffusionGemma, prompt, tokenizer, pixels, images, budget: int):
    """A text prompt with images -> its token ids (placeholders expanded) and the images' Pixels."""
    if pixels is not None:
        raise ValueError("give images= or pixels=, not both")
    if not isinstance(prompt, str) or tokenizer is None:
        raise ValueError("images= goes with a text prompt (one image token per image) and tokenizer=")
    model.check_vision()  # before reading and preprocessing the images
    return text_prompt(tokenizer, model.config, prompt, list(images), budget)


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [B, T] left-padded to the longest row, and the attention mask (None if nothing is padded)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids.to(device), (None if bool(mask.all()) else mask.to(device))
