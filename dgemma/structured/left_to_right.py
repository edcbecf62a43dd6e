"""The same schema decoded left to right under its grammar (the autoregressive twin of a fill)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import torch

from ..editing import end_of_text_ids
from ..generate import GenerationResult, GenerationStats, prompt_rows
from ..runtime.runner import Runner, as_runner
from .nodes import (
    grammar_state,
    json_text,
)
from .plans import JsonPlan, JsonResult, schema_plan, unsatisfied

# ------------------------------------------------------------------------------------------------
# The same schema decoded left to right (the autoregressive twin of a fill)


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
    plan = schema_plan(runner, tokenizer, schema)
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
