"""Autoregressive decoding on the same weights: next-token prediction through `encode` with the KV cache.

DiffusionGemma's encoder is a causal language model with the tied LM head (training keeps it so with a
next-token co-loss), so the model can also decode one token at a time. This is the apples-to-apples
baseline for speed comparisons, and a fallback where parallel denoising does not pay off. The
grammar-constrained JSON baseline of structured output (`generate_json_ar`) decodes this way too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import torch

from .generation.engine import DoneEvent, TokensEvent
from .generation.loop import GenerationResult, GenerationStats, end_of_text_ids, left_pad, prompt_rows, text_ends
from .generation.programs import JsonResult, sizes_of
from .model.model import DiffusionGemma
from .runtime.runner import Runner, as_runner
from .structured.nodes import grammar_state, json_text
from .structured.plans import JsonPlan, schema_plan, unsatisfied


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
    return set(text_ends(model) if stop_token_ids is None else stop_token_ids)


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


# ------------------------------------------------------------------------------------------------
# Left-to-right JSON by grammar: the baseline of structured output


@torch.no_grad()
def decode_grammar(model: Runner | Any, plan: JsonPlan, prompt: list[int]) -> tuple[list[int], int, str | None]:
    """A schema's answer decoded token by token by the causal encoder, as a grammar engine does: greedy,
    each step takes the likeliest token whose text keeps the answer a prefix of a valid one
    (`grammar_state`), and the end of text once the answer is whole. The tokens are the model's own
    (a `","` that closes a string and opens the next key is one token, as in training). At most as many
    tokens as the plan's template. Returns the tokens, the forward passes, and why it failed (None)."""
    runner = as_runner(model)
    m, c = runner.model, plan.classes
    ends = set(end_of_text_ids(m))
    cache = m.new_cache(1, len(prompt) + len(plan.template) + 1)

    def feed(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], device=m.device)
        return runner.encode(ids, cache, return_logits=True).logits[0, -1].float()

    logits, out, text = feed(prompt), [], ""
    while len(out) < len(plan.template):
        for t in _likeliest_first(logits):
            if t in ends:
                if grammar_state(plan.root, text)[1]:
                    return out, len(out) + 1, None
            elif t < c.vocab_size and c.usable(t) and any(grammar_state(plan.root, text + c.texts[t])):
                break
        else:
            return out, len(out) + 1, f"no token continues {text!r} within the schema"
        out.append(t)
        text += c.texts[t]
        logits = feed([t])
    return out, len(out) + 1, f"the answer is longer than {len(plan.template)} tokens"


def _likeliest_first(logits: torch.Tensor, first: int = 64) -> Iterator[int]:
    """Token ids in order of decreasing logit: the top `first` at once (almost always enough), the whole
    vocabulary sorted only when none of them is taken."""
    top = logits.topk(min(first, logits.numel())).indices.tolist()
    yield from top
    if len(top) < logits.numel():
        seen = set(top)
        yield from (t for t in torch.argsort(logits, descending=True).tolist() if t not in seen)


def generate_json_ar(model: Runner | Any, prompt, schema: dict, *, tokenizer) -> JsonResult:
    """`generate_json`'s answer decoded left to right under the same schema (`decode_grammar`): the
    autoregressive baseline, on the same weights. Greedy, so there is nothing to retry:
    StructuredOutputError if the decoding fails or the answer does not validate. `steps` counts forward
    passes."""
    runner = as_runner(model)
    rows = prompt_rows(prompt, tokenizer)
    if len(rows) != 1:
        raise ValueError("generate_json_ar takes one prompt")
    plan = schema_plan(sizes_of(runner.model), tokenizer, schema)
    t0 = time.perf_counter()
    tokens, forwards, error = decode_grammar(runner, plan, rows[0])
    if error is None:
        value = json.loads(tokenizer.decode(tokens))
        error = next((e.message for e in plan.validator.iter_errors(value)), None)
    if error is not None:
        raise unsatisfied(1, error, forwards)
    elapsed = time.perf_counter() - t0
    stats = GenerationStats(
        canvases=1,
        steps_per_canvas=[[]],
        converged_per_canvas=[[True]],
        decoder_forward_passes=[forwards],
        tokens_per_forward=[len(tokens) / forwards],
        time_to_first_token=None,
        elapsed=elapsed,
        tokens_per_second=len(tokens) / elapsed if elapsed > 0 else 0.0,
        prompt_tokens=[len(rows[0])],
    )
    result = GenerationResult([tokens], ["stop"], torch.tensor([tokens]), stats)
    return JsonResult(value, json_text(value), 1, forwards, result)
