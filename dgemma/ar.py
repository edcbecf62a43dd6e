"""Autoregressive decoding on the same weights: next-token prediction through `encode` with the KV cache.

DiffusionGemma's encoder is a causal language model with the tied LM head (training keeps it so with a
next-token co-loss), so the model can also decode one token at a time. This is the apples-to-apples
baseline for speed comparisons, and a fallback where parallel denoising does not pay off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .generate import DoneEvent, GenerationResult, GenerationStats, TokensEvent, left_pad, prompt_rows
from .model import DiffusionGemma
from .runtime.runner import Runner, as_runner


@torch.no_grad()
def stream_ar(
    model: DiffusionGemma | Runner,
    prompt,
    max_new_tokens: int = 256,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    tokenizer=None,
) -> Iterator[TokensEvent | DoneEvent]:
    """Decode token by token (greedy at temperature 0), yielding each row's token as it is produced.
    `model`: a DiffusionGemma, or a Runner (its fast modules run the passes)."""
    t0 = time.perf_counter()
    runner = as_runner(model)
    model = runner.model
    rows = prompt_rows(prompt, tokenizer)
    pad = model.text_config.pad_token_id or 0
    ids, mask = left_pad(rows, pad, model.device)
    stop = _checked(model, ids, max_new_tokens, temperature, stop_token_ids)
    gen = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    b = ids.shape[0]
    cache = model.new_cache(b, ids.shape[1] + max_new_tokens)
    out: list[list[int]] = [[] for _ in range(b)]
    reasons: list[str | None] = [None] * b
    first = None
    logits = runner.encode(ids, cache, attention_mask=mask, return_logits=True).logits[:, -1]
    passes = 1
    while True:
        nxt = logits.argmax(-1) if temperature == 0 else _draw(logits, temperature, gen)
        alive = torch.ones(b, dtype=torch.long, device=model.device)
        for r, t in enumerate(nxt.tolist()):
            if reasons[r] is not None:
                alive[r] = 0
                continue
            if t in stop:
                reasons[r] = "stop"
                continue
            out[r].append(t)
            first = first or time.perf_counter()
            yield TokensEvent(r, [t], 0)
            if len(out[r]) >= max_new_tokens:
                reasons[r] = "length"
        if all(reasons):
            break
        step_mask = None if bool(alive.all()) else alive[:, None]
        logits = runner.encode(
            nxt[:, None], cache, attention_mask=step_mask, return_logits=True, is_generated=True
        ).logits[:, -1]
        passes += 1
    result = _result(out, reasons, passes, [len(r) for r in rows], t0, first, pad, max_new_tokens)
    if tokenizer is not None:
        result.text = [tokenizer.decode(t) for t in out]
    yield DoneEvent(result)


def _checked(model: DiffusionGemma, ids: torch.Tensor, max_new_tokens, temperature, stop_token_ids) -> set[int]:
    """The settings checked against the model and its context; the stop tokens (default: end of text)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (got {temperature})")
    limit = model.text_config.max_position_embeddings
    if ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) plus {max_new_tokens} new tokens exceed the model's "
            f"context of {limit} positions"
        )
    if stop_token_ids is None:
        eos = model.generation_config.eos_token_id
        stop_token_ids = model.text_config.eos_token_ids if eos is None else ([eos] if isinstance(eos, int) else eos)
    return set(stop_token_ids)


def _draw(logits: torch.Tensor, temperature: float, gen) -> torch.Tensor:
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(-1)


def _result(out, reasons, passes: int, prompt_tokens: list[int], t0: float, first, pad: int, max_new: int):
    """The GenerationResult of an AR run: one forward pass per token, no canvases."""
    elapsed = time.perf_counter() - t0
    total = sum(len(t) for t in out)
    stats = GenerationStats(
        canvases=0,
        steps_per_canvas=[[] for _ in out],
        converged_per_canvas=[[] for _ in out],
        decoder_forward_passes=[passes] * len(out),
        tokens_per_forward=[len(t) / passes for t in out],
        time_to_first_token=None if first is None else first - t0,
        elapsed=elapsed,
        tokens_per_second=total / elapsed if elapsed > 0 else 0.0,
        prompt_tokens=prompt_tokens,
    )
    sequences = torch.tensor([t + [pad] * (max_new - len(t)) for t in out], dtype=torch.long)
    return GenerationResult(out, [r or "length" for r in reasons], sequences, stats)


def generate_ar(model: DiffusionGemma | Runner, prompt, max_new_tokens: int = 256, **kwargs) -> GenerationResult:
    """Autoregressive generation; see `stream_ar`."""
    for event in stream_ar(model, prompt, max_new_tokens, **kwargs):
        if isinstance(event, DoneEvent):
            return event.result
    raise AssertionError("stream_ar ended without a DoneEvent")
