"""Infilling, editing and templates laid out and checked: pins, the infill canvas, the middle's length
limit, an edit's span, and the read-only scores of prompts and canvases (docs/editing.md). Their programs,
and the public `fill`, `infill` and `edit`, are in dgemma/programs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .calls import DenoiseCall, DoneEvent, EncodeCall, ScoreCall, alternatives, run
from .generate import GenerationResult
from .model import DiffusionGemma
from .runtime.runner import Runner, as_runner

SCORED_SUFFIX = 32  # tokens after the middle (suffix, then end of text) scored when choosing its length


def _check_ids(ids: list[int], vocab: int, what: str) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"{what} must be a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return ids


def _text_or_ids(value, tokenizer, what: str) -> list[int]:
    if isinstance(value, str):
        if tokenizer is None:
            raise ValueError(f"a text {what} needs a tokenizer")
        return tokenizer.encode(value, add_special_tokens=False)
    return list(value)


def _start_prompt(model: DiffusionGemma, prompt: list[int]) -> list[int]:
    """The encoder needs at least one token: an empty prefix becomes the BOS token."""
    if prompt:
        return prompt
    bos = model.text_config.bos_token_id
    if bos is None:
        raise ValueError("an empty prefix needs a bos_token_id in the config")
    return [bos]


def end_of_text_ids(model: DiffusionGemma) -> list[int]:
    """The token ids that end a text: generation_config.json's eos_token_id, else config.json's.

    The first is the one infilling pins after the suffix; any of them ends a middle (`cut_at_end`).
    """
    eos = model.generation_config.eos_token_id
    ids = model.text_config.eos_token_ids if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if not ids:
        raise ValueError("infilling pins end-of-text after the suffix and needs an eos_token_id in the config")
    return list(ids)


def max_middle_length(model: DiffusionGemma) -> int:
    """The longest middle an infill canvas holds: `canvas_length - 1`.

    One canvas position is left after the middle, so the middle always sees what follows it (the first
    suffix token, or the end-of-text pin when the suffix is empty); a middle as long as the canvas would
    see nothing after it, which is a continuation, not an infill. (A canvas of 1 allows a middle of 1.)
    """
    return max(model.config.canvas_length - 1, 1)


def infill_limit(model: DiffusionGemma, suffix: list[int]) -> int:
    """The longest middle an infill before `suffix` takes: one that leaves the canvas room for the suffix
    and its end, up to half the canvas (so that the middle still sees what follows it), and at most
    `max_middle_length`. The library and the server take the same rule: a longer middle asked for is
    reduced to it."""
    c = model.config.canvas_length
    return max(1, min(max_middle_length(model), c - min(len(suffix) + 1, c // 2)))


def infill_template(model: DiffusionGemma, suffix_ids: list[int], middle_length: int) -> list[int | None]:
    """The canvas an infill denoises: `[middle_length holes (None) | suffix | end-of-text ...]`.

    As much of the suffix as fits after the holes is pinned, and the rest of the canvas is pinned to the
    first end-of-text token (the text ends after the suffix). The template is `canvas_length` long;
    suffix tokens beyond it are not seen by the middle.
    """
    limit = max_middle_length(model)
    if isinstance(middle_length, bool) or not isinstance(middle_length, int) or not 0 < middle_length <= limit:
        raise ValueError(f"middle_length must be an integer in [1, {limit}] (got {middle_length!r})")
    suffix_ids = _check_ids(list(suffix_ids), model.text_config.vocab_size, "suffix")
    end = end_of_text_ids(model)[0]
    return _infill_template(middle_length, suffix_ids, model.config.canvas_length, end)[0]


def cut_at_end(model: DiffusionGemma, middle_ids: list[int]) -> list[int]:
    """`middle_ids` up to its first end-of-text token (excluded): where the model says the text ends.

    Returned unchanged (as a new list) when it holds none; may be empty.
    """
    ends = set(end_of_text_ids(model))
    return next((list(middle_ids[:i]) for i, t in enumerate(middle_ids) if t in ends), list(middle_ids))


def fill_rows(model: DiffusionGemma, template, prompt, overrides: dict) -> tuple[list[list[int]], torch.Tensor, dict]:
    """A fill's templates checked and laid out: the prompts (one per template; an empty one is the BOS
    token), the templates as pins [rows, length], and the settings (stop tokens off unless given; the
    length is the template's, so `max_new_tokens` is refused)."""
    batch = template if template and isinstance(template[0], list) else [template]
    if not batch or not all(isinstance(t, list) and t for t in batch):
        raise ValueError("template must be a non-empty list of token ids and None (holes)")
    if len({len(t) for t in batch}) != 1:
        raise ValueError("the templates of a batch must have the same length")
    vocab = model.text_config.vocab_size
    for i, t in enumerate(batch):
        _check_ids([x for x in t if x is not None], vocab, f"template {i}")
        if all(x is not None for x in t):
            raise ValueError(f"template {i} has no hole (None) to fill")
    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt or []] * len(batch)
    if len(prompts) != len(batch):
        raise ValueError(f"{len(prompts)} prompts for {len(batch)} templates")
    prompts = [_start_prompt(model, _check_ids(list(p), vocab, "prompt")) for p in prompts]
    if "max_new_tokens" in overrides:
        raise ValueError(
            "max_new_tokens does not apply here: the template's length (for infill, the middle length) "
            "decides how many tokens are generated"
        )
    return prompts, template_pins(batch), {"stop_token_ids": [], **overrides}


def template_pins(templates: list[list[int | None]]) -> torch.Tensor:
    """Templates of equal length as generate's `pins` [rows, length]: the given ids, -1 at the holes."""
    return torch.tensor([[-1 if t is None else t for t in row] for row in templates], dtype=torch.long)


def _infill_template(middle: int, suffix: list[int], canvas: int, end: int) -> tuple[list[int | None], int]:
    """`infill_template` without a model (a middle of 0 gives a template without holes), and how many
    suffix tokens it shows."""
    visible = suffix[: max(canvas - middle, 0)]
    template = [None] * middle + visible + [end] * (canvas - middle - len(visible))
    return template, len(visible)


@dataclass
class InfillResult:
    middle: list[int]  # the generated middle, cut at its first end-of-text token
    tokens: list[int]  # prefix + middle + suffix
    middle_length: int  # the holes of the chosen canvas (the middle is shorter when it ended the text)
    scores: dict[int, float]  # middle length -> its length_score (with middle_length="auto")
    result: GenerationResult
    text: str | None = None
    middle_text: str | None = None
    row: int = 0  # the row of `result` the middle comes from


@dataclass
class InfillPlan:
    """An infill, validated and laid out before anything runs: the middle lengths to try, one canvas
    template per length (a row each, every row with the same prompt), and how the length is chosen.
    `infill` is plan_infill, then `fill(plan.templates, plan.prompts)`, then choose_middle; a server runs
    the fill on its engine and the same choice after it."""

    prefix: list[int]
    suffix: list[int]
    prompt: list[int]  # what the encoder reads: the prefix (the BOS token for an empty one)
    lengths: list[int]  # middle lengths, one per row
    templates: list[list[int | None]]
    length_score: str

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prompt] * len(self.lengths)

    def pins(self) -> torch.Tensor:
        """The templates as fill's pins [rows, canvas] (-1 at the holes)."""
        return template_pins(self.templates)


def plan_infill(
    model: DiffusionGemma | Runner,
    prefix: list[int] | str,
    suffix: list[int] | str,
    middle_length: int | str = "auto",
    *,
    tokenizer=None,
    length_score: str = "encoder",
    longest: int | None = None,
) -> InfillPlan:
    """Validate an infill and lay out its rows: "auto" tries 2, 4, 8, ... up to `longest` (default:
    `infill_limit`; at most `max_middle_length`), an integer that one length, reduced to that limit when
    longer (the result's `middle_length` says the length used; the server's `max_tokens` is this integer).
    ValueErrors name what is wrong."""
    model = as_runner(model).model
    if length_score not in ("encoder", "denoiser"):
        raise ValueError(f"length_score must be 'encoder' or 'denoiser' (got {length_score!r})")
    prefix = _check_ids(_text_or_ids(prefix, tokenizer, "prefix"), model.text_config.vocab_size, "prefix")
    suffix = _check_ids(_text_or_ids(suffix, tokenizer, "suffix"), model.text_config.vocab_size, "suffix")
    limit = infill_limit(model, suffix) if longest is None else max(1, min(longest, max_middle_length(model)))
    if middle_length == "auto":
        lengths = [n for n in (2, 4, 8, 16, 32, 64, 128, 256, 512) if n <= limit] or [limit]
    elif isinstance(middle_length, int) and not isinstance(middle_length, bool) and middle_length > 0:
        lengths = [min(middle_length, limit)]  # editors ask for 128-256: the most that still sees the suffix
    else:
        raise ValueError(f"middle_length must be 'auto' or an integer in [1, {limit}] (got {middle_length!r})")
    templates = [infill_template(model, suffix, n) for n in lengths]
    return InfillPlan(prefix, suffix, _start_prompt(model, prefix), lengths, templates, length_score)


def prompt_logprobs_program(prompt: list[int], k: int = 0):
    """The causal encoder's log-probability of each prompt token given the ones before it (None for the
    first), and the k likeliest tokens at each position as (id, log-probability): one Score call over the
    whole prompt, what an evaluation harness reads from `echo` with `logprobs` (the encoder's co-loss
    trained exactly this). A program (dgemma/calls.py)."""
    if not prompt:
        raise ValueError("prompt_logprobs needs a non-empty prompt")
    if len(prompt) == 1:
        yield DoneEvent(([None], [None]))
        return
    scored = yield ScoreCall(prompt[:1], [prompt[1:]], top=k)
    top = scored.top[0] if k else [[] for _ in prompt[1:]]
    yield DoneEvent(([None, *scored.logprobs[0].tolist()], [None, *top]))


def prompt_logprobs(
    model: DiffusionGemma | Runner, prompt: list[int], k: int = 0
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """`prompt_logprobs_program` run alone."""
    return run(as_runner(model), prompt_logprobs_program(prompt, k))


def canvas_logprobs_program(model: DiffusionGemma, prompt: list[int], canvas: list[int], k: int = 0):
    """A read-only denoising pass: the canvas is read as it is (nothing sampled, nothing renoised, no
    self-conditioning), and each of its tokens gets the denoiser's log-probability there, with the k
    likeliest tokens at each position. A canvas shorter than the model's is followed by end-of-text
    tokens, as an infill's is (those are not reported); a longer one is refused. A program."""
    c = model.config.canvas_length
    vocab = model.text_config.vocab_size
    prompt, canvas = _check_ids(list(prompt), vocab, "prompt"), _check_ids(list(canvas), vocab, "canvas")
    if not prompt or not 0 < len(canvas) <= c:
        raise ValueError(f"canvas_logprobs needs a prompt and a canvas of 1 to {c} tokens")
    full = canvas + end_of_text_ids(model)[:1] * (c - len(canvas))
    cache = model.new_cache(1, len(prompt))
    yield EncodeCall(torch.tensor([prompt], device=model.device), cache)
    ids = torch.tensor([full], device=model.device)
    logits = yield DenoiseCall(ids, cache)
    logp = torch.log_softmax(logits[0, : len(canvas)].float(), dim=-1)
    chosen = logp.gather(-1, ids[0, : len(canvas), None]).squeeze(-1).tolist()
    yield DoneEvent((chosen, alternatives(logp, k)))


def canvas_logprobs(
    model: DiffusionGemma | Runner, prompt: list[int], canvas: list[int], k: int = 0
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """`canvas_logprobs_program` run alone."""
    runner = as_runner(model)
    return run(runner, canvas_logprobs_program(runner.model, prompt, canvas, k))


def plan_edit(
    model: DiffusionGemma, ids: list[int] | str, span: tuple[int, int], new_length: int | None, tokenizer=None
) -> tuple[list[int], list[int], int]:
    """An edit checked and laid out as an infill: the prefix (before the span), the suffix (after it) and
    the replacement's length (the span's unless `new_length` says otherwise)."""
    ids = _check_ids(_text_or_ids(ids, tokenizer, "text"), model.text_config.vocab_size, "text")
    if not (isinstance(span, tuple | list) and len(span) == 2 and all(isinstance(x, int) for x in span)):
        raise ValueError(f"span must be a (start, end) pair of token positions (got {span!r})")
    a, b = span
    if not 0 <= a <= b <= len(ids):
        raise ValueError(f"span {span} is not within the text's {len(ids)} tokens (need 0 <= start <= end <= len)")
    n = (b - a) if new_length is None else new_length
    limit = max_middle_length(model)
    if not isinstance(n, int) or not 0 < n <= limit:
        raise ValueError(
            f"the replacement must have between 1 and {limit} tokens (got {n}); give new_length "
            "for an insertion (an empty span)"
        )
    return ids[:a], ids[b:], n
