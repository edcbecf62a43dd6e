"""Generating JSON by a plan: draft, size, fill, read, validate, retry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..editing import fill
from ..generate import GenerationResult, SamplingParams, generate, prompt_rows
from ..runtime.runner import Runner, as_runner
from .nodes import (
    json_text,
)
from .plans import (
    JsonPlan,
    object_plan,
    schema_plan,
)
from .tokens import (
    DEFAULT_RETRIES,
    StructuredOutputError,
)

# ------------------------------------------------------------------------------------------------
# Generating


@dataclass
class JsonResult:
    value: Any  # the answer, validated against the schema
    text: str  # its JSON text (compact)
    attempts: int  # fills run (1 + retries used)
    steps: int  # denoising steps over all attempts
    result: GenerationResult  # the last fill
    errors: list[str] = field(default_factory=list)  # why earlier attempts were drawn again


def generate_json(
    model: Runner | Any,
    prompt,
    schema: dict | None,
    params: SamplingParams | None = None,
    *,
    tokenizer,
    retries: int = DEFAULT_RETRIES,
    max_new_tokens: int | None = None,
    size: str = "draft",
    **overrides,
) -> JsonResult:
    """An answer to `prompt` (text or token ids, one row) that is JSON valid against `schema`.

    The schema is compiled into a template with constrained holes and filled (see the module docstring);
    `schema=None` asks for any JSON object, in at most `max_new_tokens` (default: the checkpoint's), as
    free text after a pinned `{`. `size="draft"` (the default) sizes the values by a free draft first
    (`draft_plan`, once), `"schema"` by the schema's bounds alone. An answer that fails is filled again
    with the next seed, up to `retries` times, then StructuredOutputError. `overrides` set
    SamplingParams fields (seed, steps, sampler, ...).
    """
    runner = as_runner(model)
    m = runner.model
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= 8:
        raise ValueError("retries must be an integer in [0, 8]")
    if size not in ("draft", "schema"):
        raise ValueError(f"size must be 'draft' or 'schema' (got {size!r})")
    rows = prompt_rows(prompt, tokenizer)
    if len(rows) != 1:
        raise ValueError("generate_json takes one prompt")
    if schema is None:
        plan = object_plan(tokenizer, m.text_config.vocab_size, max_new_tokens or m.generation_config.max_new_tokens)
    elif max_new_tokens is not None:
        raise ValueError("max_new_tokens does not apply with a schema: the schema sizes the answer")
    else:
        plan = schema_plan(runner, tokenizer, schema)
    seed = overrides.pop("seed", None if params is None else params.seed)
    errors, steps = [], 0
    if size == "draft" and plan.resize is not None:
        plan, steps = draft_plan(runner, plan, rows[0], params, tokenizer=tokenizer, seed=seed, **overrides)
    for attempt in range(retries + 1):
        s = None if seed is None else seed + attempt
        result = fill(runner, plan.template, rows[0], params, allowed=plan.allowed, seed=s, **overrides)
        steps += sum(result.stats.steps_per_canvas[0])
        value, error = plan.read(runner, rows[0], result.tokens[0])
        if error is None:
            return JsonResult(value, json_text(value), attempt + 1, steps, result, errors)
        errors.append(error)
    raise unsatisfied(retries + 1, errors[-1], steps)


def draft_plan(
    model: Runner | Any, plan: JsonPlan, prompt: list[int], params: SamplingParams | None, *, tokenizer, **overrides
) -> tuple[JsonPlan, int]:
    """`plan` sized by the model: a free answer to `prompt` (as long as the plan's template, the same
    sampling), whose values size the holes (`JsonPlan.resize`: a string of n tokens is a hole of n string
    tokens with its closing quote pinned; a number keeps its sign and digit counts; an enum holds the
    options spelled in as many tokens; an array keeps its count), so the template is tokenized as the
    model writes such an answer. Returns it and the draft's denoising steps."""
    if plan.resize is None:
        raise ValueError("only a schema's plan can be sized by a draft")
    r = generate(model, [prompt], params, max_new_tokens=len(plan.template), **overrides)
    return plan.resize(tokenizer.decode(r.tokens[0])), sum(r.stats.steps_per_canvas[0])


def unsatisfied(attempts: int, last: str, steps: int = 0) -> StructuredOutputError:
    """The error after the last attempt."""
    error = StructuredOutputError(f"no valid JSON answer in {attempts} attempts (the last: {last})")
    error.steps = steps
    return error
