"""Training data: JSONL records -> tokenised (prompt, response) examples, and their order.

Three record forms (messages, prompt/completion, prompt_ids/completion_ids), image parts, `pinned`
positions, chat-template rendering and truncation: docs/training.md, "Data".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..images import KERNEL, PATCH
from ..images import geometry as tower_geometry


@dataclass(frozen=True)
class Example:
    prompt: list[int]
    response: list[int]
    truncated: bool = False
    line: int = 0  # 1-based line in the source file (0: built in code)
    pinned: tuple[bool, ...] | None = None  # response positions given at inference (never noised, not scored)
    images: tuple[str, ...] = ()  # the prompt's images (paths), in order
    image_budget: int = 280  # their max_soft_tokens
    image_geometry: tuple[int, int] = (PATCH, KERNEL)  # the tower's patch_size, pooling_kernel_size


class DataError(ValueError):
    """A malformed record; the message names the file and line."""


def _fail(path: Path, line: int, message: str) -> DataError:
    return DataError(f"{path}:{line}: {message}")


def _render_chat(tokenizer, messages: list[dict], path: Path, line: int, images=None) -> tuple[list[int], list[int]]:
    """`images`: (image token strings, each image's soft-token count), for messages with image parts."""
    if not messages or messages[-1].get("role") != "assistant":
        raise _fail(path, line, "the last message must be the assistant's reply (role 'assistant')")
    if not isinstance(messages[-1].get("content"), str) or not messages[-1]["content"].strip():
        raise _fail(path, line, "the assistant's reply must be a non-empty string")
    try:
        prompt_text = tokenizer.render_chat(messages[:-1], add_generation_prompt=True)
        full_text = tokenizer.render_chat(messages, add_generation_prompt=False)
    except ValueError as e:
        raise _fail(path, line, str(e)) from e
    if not full_text.startswith(prompt_text):
        raise _fail(
            path,
            line,
            "the chat template does not render the conversation as the prompt followed by "
            "the reply, so the reply cannot be told apart; use prompt/completion records instead",
        )
    response_text = full_text[len(prompt_text) :].rstrip("\n")
    if images is not None:
        from ..images import expand_image_tokens

        tokens, counts = images
        try:
            prompt_text = expand_image_tokens(prompt_text, counts, tokens)
        except ValueError as e:
            raise _fail(path, line, str(e)) from e
    return (
        tokenizer.encode(prompt_text, add_special_tokens=False),
        tokenizer.encode(response_text, add_special_tokens=False),
    )


def _check_ids(ids, vocab_size: int, path: Path, line: int, name: str) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _fail(path, line, f"'{name}' must be a non-empty list of integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise _fail(path, line, f"'{name}' has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def tokenize_record(record, tokenizer, vocab_size: int, path: Path, line: int, use_chat_template: bool, images=None):
    """(prompt ids, response ids) of one parsed record; `images` as _render_chat takes them."""
    if not isinstance(record, dict):
        raise _fail(path, line, f"each line must be a JSON object (got {type(record).__name__})")
    if "prompt_ids" in record or "completion_ids" in record:
        return (
            _check_ids(record.get("prompt_ids"), vocab_size, path, line, "prompt_ids"),
            _check_ids(record.get("completion_ids"), vocab_size, path, line, "completion_ids"),
        )
    if tokenizer is None:
        raise _fail(
            path, line, "text records need a tokenizer (set data.tokenizer, or give prompt_ids and completion_ids)"
        )
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise _fail(path, line, "'messages' must be a list of {'role': ..., 'content': ...} objects")
        if not tokenizer.chat_template:
            raise _fail(path, line, "chat records need a tokenizer with a chat template")
        return _render_chat(tokenizer, messages, path, line, images)
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise _fail(path, line, "'prompt' and 'completion' must be strings (the completion non-empty)")
        if use_chat_template and tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return _render_chat(tokenizer, messages, path, line)
        return tokenizer.encode(prompt), tokenizer.encode(completion, add_special_tokens=False)
    raise _fail(
        path, line, "a record needs 'messages', or 'prompt' and 'completion', or 'prompt_ids' and 'completion_ids'"
    )


def load_jsonl(
    path: str | Path,
    tokenizer=None,
    *,
    vocab_size: int,
    max_length: int,
    use_chat_template: bool = True,
    image_tokens: tuple[str, str, str] | None = None,
    image_geometry: dict[str, int] | None = None,
) -> tuple[list[Example], dict[str, int]]:
    """Tokenised examples of a JSONL file and counts of what was kept, truncated and skipped.
    `image_tokens` (dgemma.images.image_token_strings) lets records hold images, cut as `image_geometry`
    says (dgemma.images.geometry(config); Gemma 4's patch 16 and pooling 3 without it)."""
    cut = image_geometry or tower_geometry(None)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training data {path} not found")
    examples: list[Example] = []
    counts = {"records": 0, "truncated": 0, "skipped_long_prompt": 0}
    with path.open(encoding="utf-8") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                raise _fail(path, line_no, f"not valid JSON ({e.msg} at column {e.colno})") from e
            pictures, budget, counts_of = _record_images(record, path, line_no, image_tokens, cut)
            images = None if not pictures else (image_tokens, counts_of)
            prompt, response = tokenize_record(record, tokenizer, vocab_size, path, line_no, use_chat_template, images)
            pinned = record.get("pinned")
            if pinned is not None:
                if not isinstance(pinned, list) or len(pinned) != len(response) or any(p not in (0, 1) for p in pinned):
                    raise _fail(
                        path,
                        line_no,
                        f"'pinned' must be a list of {len(response)} flags (0 or 1), one per response token",
                    )
                pinned = tuple(bool(p) for p in pinned)
            counts["records"] += 1
            if not prompt:
                raise _fail(path, line_no, "the prompt is empty (the encoder needs at least one token)")
            if len(prompt) >= max_length:
                counts["skipped_long_prompt"] += 1
                continue
            truncated = len(prompt) + len(response) > max_length
            if truncated:
                response = response[: max_length - len(prompt)]
                pinned = None if pinned is None else pinned[: len(response)]
                counts["truncated"] += 1
            geometry = (cut["patch_size"], cut["pooling_kernel_size"])
            examples.append(Example(prompt, response, truncated, line_no, pinned, pictures, budget, geometry))
    if not examples:
        raise DataError(f"{path}: no usable examples ({counts})")
    return examples, counts


def _record_images(record, path: Path, line: int, image_tokens, cut) -> tuple[tuple[str, ...], int, list[int]]:
    """A chat record's image paths (resolved), budget, and each image's soft-token count (cut: the tower's
    patch_size and pooling_kernel_size)."""
    from .. import images
    from ..checkpoints.tokenizer import media_of

    messages = record.get("messages") if isinstance(record, dict) else None
    try:
        found = media_of(messages) if isinstance(messages, list) else []
    except ValueError as e:
        raise _fail(path, line, str(e)) from e
    if not found:
        return (), images.DEFAULT_BUDGET, []
    if image_tokens is None:
        raise _fail(path, line, "this record has images, and the model has no vision tower (or no image tokens)")
    if any(kind != "image" or not isinstance(src, str) for kind, src, _ in found):
        raise _fail(path, line, "training images are {'type': 'image', 'image': 'relative/path.png'} parts")
    budget = record.get("max_soft_tokens", images.DEFAULT_BUDGET)
    paths = tuple(str(path.parent / src) for _, src, _ in found)
    try:
        images.check_budget(budget)
        counts = [images.count_soft_tokens(p, budget, **cut) for p in paths]
    except ValueError as e:
        raise _fail(path, line, str(e)) from e
    return paths, budget, counts


def epoch_order(num_examples: int, epoch: int, seed: int) -> list[int]:
    """The shuffled order of one epoch: a function of (seed, epoch) alone, so a resumed run sees the same."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=g).tolist()


def batch_indices(step: int, batch_size: int, num_examples: int, seed: int) -> list[tuple[int, int]]:
    """(draw index, example index) of each sample of optimizer step `step` (0-based).

    Draws are consecutive slices of the epochs' shuffled orders. The draw index (step * batch_size + j)
    names the sample for its noise, so noise does not depend on how a batch is split across processes or
    micro-batches; and the data position is a function of the step, so a resumed run continues exactly.
    """
    draws = range(step * batch_size, (step + 1) * batch_size)
    orders: dict[int, list[int]] = {}
    out = []
    for i in draws:
        epoch, offset = divmod(i, num_examples)
        if epoch not in orders:
            orders[epoch] = epoch_order(num_examples, epoch, seed)
        out.append((i, orders[epoch][offset]))
    return out
