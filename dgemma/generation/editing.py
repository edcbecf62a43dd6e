"""Infilling, editing and templates laid out and checked: pins, the infill canvas, the middle's length
limit, an edit's span, and the read-only scores of prompts and canvases (docs/editing.md). Their programs,
and the tasks Fill, Infill and Edit, are in dgemma/generation/programs.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..model.model import DiffusionGemma
from ..runtime.runner import Runner, as_runner
from .engine import Answer, DenoiseCall, DoneEvent, EncodeCall, ScoreCall, alternatives
from .loop import GenerationResult, check_ids, end_of_text_ids, left_pad
from .sampling import RequestError, SamplingParams

SCORED_SUFFIX = 32  # tokens after the middle (suffix, then end of text) scored when choosing its length


def _start_prompt(model: DiffusionGemma, prompt: list[int]) -> list[int]:
    """The encoder needs at least one token: an empty prefix becomes the BOS token."""
    if prompt:
        return prompt
    bos = model.text_config.bos_token_id
    if bos is None:
        raise ValueError("an empty prefix needs a bos_token_id in the config")
    return [bos]


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
    suffix_ids = check_ids(list(suffix_ids), model.text_config.vocab_size, "suffix")
    end = end_of_text_ids(model)[0]
    return infill_template_of(middle_length, suffix_ids, model.config.canvas_length, end)[0]


def cut_at_end(model: DiffusionGemma, middle_ids: list[int]) -> list[int]:
    """`middle_ids` up to its first end-of-text token (excluded): where the model says the text ends.

    Returned unchanged (as a new list) when it holds none; may be empty.
    """
    ends = set(end_of_text_ids(model))
    return next((list(middle_ids[:i]) for i, t in enumerate(middle_ids) if t in ends), list(middle_ids))


def fill_rows(
    model: DiffusionGemma, template, prompt, params: SamplingParams
) -> tuple[list[list[int]], torch.Tensor, SamplingParams]:
    """A fill's templates checked and laid out: the prompts (one per template; an empty one is the BOS
    token), the templates as pins [rows, length], and the settings (stop tokens off unless given; the
    length is the template's, so `max_new_tokens` is refused)."""
    batch = template if template and isinstance(template[0], list) else [template]
    if not batch or not all(isinstance(t, list) and t for t in batch):
        raise RequestError("template must be a non-empty list of token ids and None (holes)", "template")
    if len({len(t) for t in batch}) != 1:
        raise RequestError("the templates of a batch must have the same length", "template")
    vocab = model.text_config.vocab_size
    for i, t in enumerate(batch):
        check_ids([x for x in t if x is not None], vocab, f"template {i}")
        if all(x is not None for x in t):
            raise RequestError(f"template {i} has no hole (None) to fill", "template")
    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt or []] * len(batch)
    if len(prompts) != len(batch):
        raise RequestError(f"{len(prompts)} prompts for {len(batch)} templates", "prompt")
    prompts = [_start_prompt(model, check_ids(list(p), vocab, "prompt")) for p in prompts]
    if params.max_new_tokens is not None:
        raise RequestError(
            "max_new_tokens does not apply here: the template's length (for infill, the middle length) "
            "decides how many tokens are generated",
            "max_tokens",
        )
    if params.stop_token_ids is None:
        params = dataclasses.replace(params, stop_token_ids=[])
    return prompts, template_pins(batch), params


def template_pins(templates: list[list[int | None]]) -> torch.Tensor:
    """Templates of equal length as generate's `pins` [rows, length]: the given ids, -1 at the holes."""
    return torch.tensor([[-1 if t is None else t for t in row] for row in templates], dtype=torch.long)


def infill_template_of(middle: int, suffix: list[int], canvas: int, end: int) -> tuple[list[int | None], int]:
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

    def answer(self) -> Answer:
        details: dict = {"middle_length": self.middle_length}
        if self.scores:
            details["middle_scores"] = {str(n): round(s, 4) for n, s in self.scores.items()}
        return Answer(None, self.middle, self.result, details, None, self.row)


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
    prefix: list[int],
    suffix: list[int],
    middle_length: int | str = "auto",
    length_score: str = "encoder",
    longest: int | None = None,
) -> InfillPlan:
    """Validate an infill and lay out its rows: "auto" tries 2, 4, 8, ... up to `longest` (default:
    `infill_limit`; at most `max_middle_length`), an integer that one length, reduced to that limit when
    longer (the result's `middle_length` says the length used; the server's `max_tokens` is this integer).
    ValueErrors name what is wrong."""
    model = as_runner(model).model
    if length_score not in ("encoder", "denoiser"):
        raise RequestError(f"length_score must be 'encoder' or 'denoiser' (got {length_score!r})", "length_score")
    prefix = check_ids(list(prefix), model.text_config.vocab_size, "prefix")
    suffix = check_ids(list(suffix), model.text_config.vocab_size, "suffix")
    limit = infill_limit(model, suffix) if longest is None else max(1, min(longest, max_middle_length(model)))
    if middle_length == "auto":
        lengths = [n for n in (2, 4, 8, 16, 32, 64, 128, 256, 512) if n <= limit] or [limit]
    elif isinstance(middle_length, int) and not isinstance(middle_length, bool) and middle_length > 0:
        lengths = [min(middle_length, limit)]  # editors ask for 128-256: the most that still sees the suffix
    else:
        message = f"middle_length must be 'auto' or an integer in [1, {limit}] (got {middle_length!r})"
        raise RequestError(message, "middle_length")
    templates = [infill_template(model, suffix, n) for n in lengths]
    return InfillPlan(prefix, suffix, _start_prompt(model, prefix), lengths, templates, length_score)


# ------------------------------------------------------------------------------------------------
# Scores: an infill's middle lengths, a prompt's tokens, a canvas's tokens


def encoder_scores(model: DiffusionGemma, prompt: list[int], middles: list[list[int]], suffix: list[int]):
    """Mean encoder log-probability of each middle and the `SCORED_SUFFIX` tokens after it (the suffix, then
    the end of text: with a short or empty suffix the model says whether the text can end there)."""
    after = suffix + end_of_text_ids(model)[:1]
    scored = yield ScoreCall(prompt, [m + after[:SCORED_SUFFIX] for m in middles])
    return [float(lp.mean()) for lp in scored.logprobs]


def denoiser_scores(model: DiffusionGemma, prompt: list[int], middles: list[list[int]], suffix: list[int]):
    """Mean log-probability one denoising pass gives each middle and what follows it in the canvas of its
    own (cut) length, `[middle | suffix | end-of-text ...]`: the middle, the visible suffix and the first
    end-of-text pin when the canvas has one."""
    canvas_length, end = model.config.canvas_length, end_of_text_ids(model)[0]
    canvases, scored = [], []
    for m in middles:
        template, visible = infill_template_of(len(m), suffix, canvas_length, end)
        canvases.append(m + template[len(m) :])
        scored.append(min(len(m) + visible + 1, canvas_length))
    rows = len(middles)
    ids, _ = left_pad([prompt] * rows, 0, model.device)
    cache = model.new_cache(rows, ids.shape[1])
    yield EncodeCall(ids, cache)
    canvas = torch.tensor(canvases, device=model.device)
    logits = yield DenoiseCall(canvas, cache)
    token_logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, canvas[..., None]).squeeze(-1)
    return [float(token_logp[i, : scored[i]].mean()) for i in range(rows)]


def prompt_logprobs_program(prompt: list[int], k: int = 0):
    """The causal encoder's log-probability of each prompt token given the ones before it (None for the
    first), and the k likeliest tokens at each position as (id, log-probability): one Score call over the
    whole prompt, what an evaluation harness reads from `echo` with `logprobs` (the encoder's co-loss
    trained exactly this). The program of a checked Score task (dgemma/generation/programs.py)."""
    if len(prompt) == 1:
        yield DoneEvent(([None], [None]))
        return
    scored = yield ScoreCall(prompt[:1], [prompt[1:]], top=k)
    top = scored.top[0] if k else [[] for _ in prompt[1:]]
    yield DoneEvent(([None, *scored.logprobs[0].tolist()], [None, *top]))


def canvas_logprobs_program(model: DiffusionGemma, prompt: list[int], canvas: list[int], k: int = 0):
    """A read-only denoising pass: the canvas is read as it is (nothing sampled, nothing renoised, no
    self-conditioning), and each of its tokens gets the denoiser's log-probability there, with the k
    likeliest tokens at each position. A canvas shorter than the model's is followed by end-of-text
    tokens, as an infill's is (those are not reported). The program of a checked Score task."""
    full = canvas + end_of_text_ids(model)[:1] * (model.config.canvas_length - len(canvas))
    cache = model.new_cache(1, len(prompt))
    yield EncodeCall(torch.tensor([prompt], device=model.device), cache)
    ids = torch.tensor([full], device=model.device)
    logits = yield DenoiseCall(ids, cache)
    logp = torch.log_softmax(logits[0, : len(canvas)].float(), dim=-1)
    chosen = logp.gather(-1, ids[0, : len(canvas), None]).squeeze(-1).tolist()
    yield DoneEvent((chosen, alternatives(logp, k)))


def plan_edit(
    model: DiffusionGemma, ids: list[int], span: tuple[int, int], new_length: int | None
) -> tuple[list[int], list[int], int]:
    """An edit checked and laid out as an infill: the prefix (before the span), the suffix (after it) and
    the replacement's length (the span's unless `new_length` says otherwise)."""
    ids = check_ids(list(ids), model.text_config.vocab_size, "text")
    if not (isinstance(span, tuple | list) and len(span) == 2 and all(isinstance(x, int) for x in span)):
        raise RequestError(f"span must be a (start, end) pair of token positions (got {span!r})", "span")
    a, b = span
    if not 0 <= a <= b <= len(ids):
        raise RequestError(
            f"span {span} is not within the text's {len(ids)} tokens (need 0 <= start <= end <= len)", "span"
        )
    n = (b - a) if new_length is None else new_length
    limit = max_middle_length(model)
    if not isinstance(n, int) or not 0 < n <= limit:
        raise RequestError(
            f"new_length: the replacement must have between 1 and {limit} tokens (got {n}); give new_length "
            "for an insertion (an empty span)",
            "new_length",
        )
    return ids[:a], ids[b:], n
