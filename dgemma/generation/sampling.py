"""Pure tensor functions of one denoising step: temperature, per-position statistics, acceptance, drawing,
renoising, and the stop rule. The canvas loop that strings them together lives in loop.py.

Two families:

- `*_reference` functions reproduce transformers' arithmetic operation for operation (full-vocabulary
  fp32 temporaries included), so that the exact mode returns the same token ids under the same seed.
- `canvas_stats` and `draw` do the same mathematics in chunks: only the logits buffer is full-size;
  entropy, argmax, confidence and the self-conditioning soft embedding come out of one pass over
  vocabulary chunks (the embedding read once per canvas), and samples are drawn only where the sampler
  accepts, in row chunks.

Acceptance rules ("samplers") share one small protocol: given per-position statistics, return the
positions to accept this step. Non-accepted positions are renoised with uniform random tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


def temperature(step: int, num_steps: int, t_min: float, t_max: float, device: torch.device | None = None):
    """Linear schedule: t_max on the first step (step = num_steps), t_min on the last (step = 1).

    `step` counts the steps *remaining*, as in the reference. The value is an fp32 0-dim tensor computed the
    way the reference computes it, so dividing logits by it gives identical bits.
    """
    s = torch.tensor(step, dtype=torch.int32, device=device)
    return t_min + (t_max - t_min) * (s / num_steps)


# ------------------------------------------------------------------------------------------------
# Per-position statistics


def entropy_reference(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, with torch.distributions.Categorical's arithmetic."""
    normalized = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(normalized, dim=-1)
    return -(normalized.clamp(min=torch.finfo(normalized.dtype).min) * probs).sum(-1)


@dataclass
class CanvasStats:
    """What a step needs to know about each position of the (temperature-scaled) logits [B, C, V]."""

    entropy: torch.Tensor  # [B, C] fp32
    argmax: torch.Tensor  # [B, C] int64
    confidence: torch.Tensor  # [B, C] fp32, probability of the argmax token
    soft_embeds: torch.Tensor | None  # [B, C, M] softmax(logits) @ embedding * scale, when asked for


def _chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows per chunk of a [chunk, V] fp32 temporary: near 1 MB on a CPU (cache-sized, at most 64 rows);
    up to 256 MB on a GPU, where each chunk costs kernel launches (a 256-token canvas of the real
    model's 262k vocabulary is then one chunk rather than 256)."""
    if device.type == "cuda":
        return max(1, 2**26 // vocab)
    return max(1, min(64, 2**18 // vocab))


def chunk_columns(rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary entries per chunk of a [rows, chunk] fp32 temporary: about 1 MB on a CPU (a core's L2
    cache: 4 MB chunks made the LM head and the sampler pass 10-20% slower), the whole vocabulary (up to
    256 MB) on a GPU, where each chunk costs kernel launches."""
    budget = 2**28 if device.type == "cuda" else 2**20
    return max(1, min(vocab, budget // (4 * rows)))


def row_max(flat: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum and the index of its first occurrence (torch.max(flat, -1)) of a [N, V] tensor,
    in one pass over it: the maxima of blocks of `block` entries, their maximum, the first block that
    holds it, then the first maximum inside that block. On a CPU this is several times faster than
    max(dim) or argmax over whole rows (their index-tracking reductions are slow); same values and
    indices, ties included."""
    v = flat.shape[1]
    main = v - v % block
    maxima = flat[:, :main].unflatten(-1, (main // block, block)).amax(-1)  # [N, V // block]
    if main < v:
        maxima = torch.cat([maxima, flat[:, main:].amax(-1, keepdim=True)], dim=-1)
    top = maxima.amax(-1)
    start = (maxima == top[:, None]).to(torch.uint8).argmax(-1) * block  # the first block with the maximum
    columns = (start[:, None] + torch.arange(block, device=flat.device)).clamp_(max=v - 1)
    inside = flat.gather(1, columns) == top[:, None]  # a short last block repeats column V-1: harmless
    return top, start + inside.to(torch.uint8).argmax(-1)


@torch.no_grad()
def canvas_stats(
    logits: torch.Tensor,
    embedding: torch.Tensor | None = None,
    embed_scale: torch.Tensor | None = None,
    chunk: int | None = None,
) -> CanvasStats:
    """Entropy, argmax, confidence and (optionally) the soft embedding softmax(logits) @ embedding * scale.

    The maximum m comes from whole rows; then one pass over vocabulary chunks of `chunk` entries
    accumulates, with e = exp(l - m) (at most 1), the sums Z = sum e, D = sum e l and S = e @ embedding,
    [rows, chunk] x [chunk, M] at a time: the embedding is read once for the whole canvas and every
    product is large enough to run near the matmul rate. Then logsumexp = m + log Z, the entropy
    H = logsumexp - D / Z, the confidence 1 / Z and the soft embedding S / Z * scale. Only [rows, chunk]
    temporaries are allocated besides the logits themselves; the sums accumulate in fp32.
    """
    b, c, v = logits.shape
    flat = logits.view(b * c, v)
    n = flat.shape[0]
    chunk = chunk or chunk_columns(n, v, logits.device)
    # block maxima pay off on a CPU's long rows; short ones (a toy's 512 entries) are faster with max(dim)
    blocks = flat.device.type == "cpu" and v >= 2048 and n * v >= 2**16
    top, argmax = row_max(flat) if blocks else flat.max(dim=-1)
    total, dot = flat.new_zeros(n), flat.new_zeros(n)
    soft = None if embedding is None else torch.zeros(n, embedding.shape[1], device=flat.device)
    work = flat.new_empty(n, min(chunk, v))  # one temporary for every chunk: no allocation per chunk
    for a in range(0, v, chunk):
        part = flat[:, a : a + chunk]
        e = torch.sub(part, top[:, None], out=work[:, : part.shape[1]]).exp_()
        total += e.sum(-1)
        dot += torch.linalg.vecdot(e, part)
        if soft is None:
            continue
        if embedding.dtype == torch.float32:
            soft.addmm_(e, embedding[a : a + chunk])
        else:
            soft += e.to(embedding.dtype) @ embedding[a : a + chunk]
    entropy = top + total.log() - dot / total
    confidence = total.reciprocal()
    if soft is not None:
        soft = (soft * (embed_scale / total[:, None])).to(embedding.dtype)
    entropy.clamp_(min=0.0)  # rounding can make a near-certain position's entropy slightly negative
    return CanvasStats(
        entropy.view(b, c),
        argmax.view(b, c),
        confidence.view(b, c),
        None if soft is None else soft.view(b, c, -1),
    )


@torch.no_grad()
def draw(
    logits: torch.Tensor, where: torch.Tensor, generator: torch.Generator | None = None, chunk: int | None = None
) -> torch.Tensor:
    """One sample from softmax(logits) at each position where `where` is True; other entries are 0.

    Exactly the distribution of drawing everywhere and keeping the accepted draws, at a fraction of the cost.
    """
    b, c, v = logits.shape
    chunk = chunk or _chunk_rows(v, logits.device)
    out = torch.zeros(b * c, dtype=torch.long, device=logits.device)
    positions = where.reshape(-1).nonzero().squeeze(-1)
    flat = logits.view(b * c, v)
    for a in range(0, positions.numel(), chunk):
        pos = positions[a : a + chunk]
        probs = torch.softmax(flat[pos], dim=-1)
        out[pos] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return out.view(b, c)


def random_tokens(shape, vocab_size: int, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform random token ids: a fresh canvas, or the renoising of rejected positions."""
    return torch.randint(0, vocab_size, shape, device=device, generator=generator)


@torch.no_grad()
def top_logprobs(logits: torch.Tensor, k: int, chunk: int | None = None):
    """log-sum-exp [B, C] of `logits` [B, C, V], and the `k` most likely tokens' log-probabilities and ids
    [B, C, k] (k may be 0), in row chunks: no [B, C, V] log-softmax is made."""
    b, c, v = logits.shape
    chunk = chunk or _chunk_rows(v, logits.device)
    flat = logits.view(b * c, v)
    lse = flat.new_empty(b * c)
    values = flat.new_empty(b * c, k)
    ids = torch.empty(b * c, k, dtype=torch.long, device=flat.device)
    for a in range(0, b * c, chunk):
        rows = flat[a : a + chunk]
        lse[a : a + chunk] = rows.logsumexp(-1)
        if k:
            top = rows.topk(k, dim=-1)
            values[a : a + chunk] = top.values - lse[a : a + chunk, None]
            ids[a : a + chunk] = top.indices
    return lse.view(b, c), values.view(b, c, k), ids.view(b, c, k)


@torch.no_grad()
def restrict(logits: torch.Tensor, classes: torch.Tensor, index: torch.Tensor, chunk: int | None = None) -> None:
    """In place: at each position whose `index` [B, C] is k >= 0, every token outside `classes[k]` (a bool
    [K, V] row of allowed tokens) gets the lowest finite logit, so that its probability is exactly 0.

    Applied to a step's processed logits before anything reads them, so the entropy, the acceptance, the
    draws, the argmax and the self-conditioning all see the constrained distribution. The lowest finite
    value rather than -inf keeps the entropy's p * logit terms at 0, not NaN. Row chunks bound the
    [chunk, V] mask; no read back to the host.
    """
    b, c, v = logits.shape
    chunk = chunk or _chunk_rows(v, logits.device)
    flat, idx = logits.view(b * c, v), index.reshape(-1)
    low = torch.finfo(logits.dtype).min
    for a in range(0, b * c, chunk):
        i = idx[a : a + chunk]
        outside = ~classes[i.clamp(min=0)]
        outside &= (i >= 0)[:, None]
        flat[a : a + chunk].masked_fill_(outside, low)


# ------------------------------------------------------------------------------------------------
# Acceptance rules


class Sampler(Protocol):
    """Decides which canvas positions keep their newly drawn token this step."""

    name: str

    def accept(self, stats: CanvasStats, step_index: int, candidates: torch.Tensor) -> torch.Tensor:
        """Boolean [B, C]: positions to accept. `step_index` counts from 1; `candidates` [B, C] marks the
        positions that may be accepted (pinned positions are excluded: they are always kept)."""
        ...


def _lowest_entropy_first(stats: CanvasStats, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropies sorted ascending with non-candidates pushed to the end, and the sort order."""
    ent = stats.entropy.masked_fill(~candidates, float("inf"))
    return torch.sort(ent, dim=-1)


def _scatter(sorted_mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(sorted_mask).scatter(-1, order, sorted_mask)


@dataclass
class EntropyBound:
    """Accept the lowest-entropy positions while (sum of their entropies - the largest) <= bound.

    The lowest-entropy position is always accepted. From arXiv 2505.24857; DiffusionGemma's default.
    """

    bound: float = 0.1
    name: str = "entropy-bound"

    def accept(self, stats: CanvasStats, step_index: int, candidates: torch.Tensor) -> torch.Tensor:
        sorted_ent, order = _lowest_entropy_first(stats, candidates)
        finite = torch.nan_to_num(sorted_ent, posinf=0.0)
        keep = (finite.cumsum(-1) - finite <= self.bound) & torch.isfinite(sorted_ent)
        return _scatter(keep, order)


@dataclass
class ConfidenceThreshold:
    """Accept every position whose most likely token has probability >= threshold (and always the single
    most confident position, so every step makes progress)."""

    threshold: float = 0.9
    name: str = "confidence"

    def accept(self, stats: CanvasStats, step_index: int, candidates: torch.Tensor) -> torch.Tensor:
        conf = stats.confidence.masked_fill(~candidates, -1.0)
        best = torch.zeros_like(candidates).scatter(-1, conf.argmax(-1, keepdim=True), True)
        return ((conf >= self.threshold) | best) & candidates


@dataclass
class FixedCount:
    """Accept the `tokens_per_step * step_index` lowest-entropy positions: a fixed number more each step."""

    tokens_per_step: int = 16
    name: str = "fixed"

    def accept(self, stats: CanvasStats, step_index: int, candidates: torch.Tensor) -> torch.Tensor:
        sorted_ent, order = _lowest_entropy_first(stats, candidates)
        rank = torch.arange(sorted_ent.shape[-1], device=sorted_ent.device)
        keep = (rank < self.tokens_per_step * step_index) & torch.isfinite(sorted_ent)
        return _scatter(keep.expand_as(sorted_ent), order)


SAMPLERS = {"entropy-bound": EntropyBound, "confidence": ConfidenceThreshold, "fixed": FixedCount}


def entropy_bound_mask_reference(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """The reference's acceptance (every position a candidate), kept operation for operation."""
    sorted_ent, order = torch.sort(entropy, dim=-1, descending=False)
    keep = torch.cumsum(sorted_ent, dim=-1) - sorted_ent <= bound
    return torch.scatter(input=torch.zeros_like(keep), dim=-1, index=order, src=keep)


# ------------------------------------------------------------------------------------------------
# The stop rule


class StableAndConfident:
    """Stop a row when its argmax canvas equals that of each of the previous `stability_threshold` steps
    and the mean entropy over the positions that matter is below `confidence_threshold`."""

    def __init__(self, stability_threshold: int, confidence_threshold: float, canvas_shape=None, device=None):
        self.stability_threshold = stability_threshold
        self.confidence_threshold = confidence_threshold
        self.history: torch.Tensor | None = None  # [stability_threshold, B, C], -1 before the first steps
        if canvas_shape is not None and stability_threshold > 0:  # needed when the first call sees some rows
            self.history = torch.full((stability_threshold, *canvas_shape), -1, dtype=torch.long, device=device)

    def forget(self, rows: torch.Tensor) -> None:
        """Rows ([B] bool) whose canvas starts again: no earlier step counts toward their stability."""
        if self.history is not None:
            self.history[:, rows] = -1

    def __call__(
        self,
        argmax: torch.Tensor,
        entropy: torch.Tensor,
        counted: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`counted` [b, C] selects the positions that enter the rule (all by default); `rows` says which rows
        of the full batch these b rows are (all by default)."""
        if self.stability_threshold == 0:
            stable = torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device)
        else:
            if self.history is None:
                self.history = argmax.new_full((self.stability_threshold, *argmax.shape), -1)
            history = self.history if rows is None else self.history[:, rows]
            same = history == argmax[None]
            if counted is not None:
                same |= ~counted[None]
            stable = same.all(dim=-1).all(dim=0)
            history = torch.roll(history, shifts=-1, dims=0)
            history[-1] = argmax
            if rows is None:
                self.history = history
            else:
                self.history[:, rows] = history
        if counted is None:
            mean_entropy = entropy.mean(-1)
        else:
            mean_entropy = (entropy * counted).sum(-1) / counted.sum(-1).clamp(min=1)
        return stable & (mean_entropy < self.confidence_threshold)


# ------------------------------------------------------------------------------------------------
# One step's transition of the canvas, given the step's processed (temperature-scaled) logits


@dataclass
class Transition:
    tokens: torch.Tensor  # [B, C] the next (noisy) canvas
    argmax: torch.Tensor  # [B, C] the draft
    accepted: torch.Tensor  # [B, C] bool
    entropy: torch.Tensor  # [B, C]
    soft_embeds: torch.Tensor | None = None  # [B, C, M] (fast transition)
    confidence: torch.Tensor | None = None  # [B, C] the argmax's probability (fast transition)


def reference_transition(logits: torch.Tensor, canvas: torch.Tensor, bound: float) -> Transition:
    """transformers' step: draw everywhere, accept by entropy bound, renoise the rest (global generator)."""
    b, c, v = logits.shape
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    sampled = torch.multinomial(probs.view(-1, v), num_samples=1).view(b, c)
    del probs
    argmax = logits.argmax(-1)
    entropy = entropy_reference(logits)
    accept = entropy_bound_mask_reference(entropy, bound)
    tokens = torch.where(accept, sampled, canvas)
    tokens = torch.where(~accept, random_tokens((b, c), v, logits.device), tokens)
    return Transition(tokens, argmax, accept, entropy)


def fast_transition(
    logits: torch.Tensor,
    sampler: Sampler,
    step_index: int,
    pinned: torch.Tensor,
    pin_values: torch.Tensor,
    generator: torch.Generator | None = None,
    embedding: torch.Tensor | None = None,
    embed_scale: torch.Tensor | None = None,
    stats: Callable[..., CanvasStats] = canvas_stats,
    greedy: bool = False,
) -> Transition:
    """The same distribution as `reference_transition` for the entropy-bound sampler, computed with
    [chunk, V] temporaries, drawing only at accepted positions. Pinned positions keep their values.
    `stats` computes the statistics: `canvas_stats`, or a runner's compiled version of it. With `greedy`,
    accepted positions take their argmax instead of a draw (which positions are accepted is unchanged)."""
    stats = stats(logits, embedding, embed_scale)
    accept = sampler.accept(stats, step_index, ~pinned)
    drawn = stats.argmax if greedy else draw(logits, accept, generator)
    noise = random_tokens(drawn.shape, logits.shape[-1], logits.device, generator)
    tokens = torch.where(pinned, pin_values, torch.where(accept, drawn, noise))
    argmax = torch.where(pinned, pin_values, stats.argmax)
    return Transition(tokens, argmax, accept | pinned, stats.entropy, stats.soft_embeds, stats.confidence)


# ------------------------------------------------------------------------------------------------
# The settings of a request: every sampling setting, its default, range and help


MODES = ("fast", "exact")
# the settings a checkpoint's generation_config.json supplies when a call leaves them None
CHECKPOINT_DEFAULTED = (
    "max_new_tokens",
    "max_denoising_steps",
    "entropy_bound",
    "t_min",
    "t_max",
    "stability_threshold",
    "confidence_threshold",
)


def _setting(default: Any, help: str, *, low=None, high=None, open_low=False, choices=None, kind=None):
    """A SamplingParams field with its metadata: help, range (low, high; low excluded when open_low) or
    choices, and its kind (int, float, str, bool)."""
    metadata = {"help": help, "low": low, "high": high, "open_low": open_low, "choices": choices, "kind": kind}
    return field(default=default, metadata=metadata)


@dataclass
class SamplingParams:
    """How to generate. Fields left None take the checkpoint's generation_config.json (or the reference
    defaults: 48 steps, entropy bound 0.1, temperature 0.8 -> 0.4, stop when stable for 1 step and mean
    entropy < 0.005, 256 new tokens)."""

    max_new_tokens: int | None = _setting(None, "tokens to generate, exactly", low=1, high=2**20, kind=int)
    max_denoising_steps: int | None = _setting(None, "most denoising steps per canvas", low=1, high=1024, kind=int)
    entropy_bound: float | None = _setting(
        None,
        "entropy-bound sampler: accept positions, lowest entropy first, while their entropies sum below this",
        low=0.0,
        high=1e4,
        open_low=True,
        kind=float,
    )
    t_min: float | None = _setting(
        None, "temperature on a canvas's last step", low=0.0, high=10.0, open_low=True, kind=float
    )
    t_max: float | None = _setting(
        None, "temperature on a canvas's first step", low=0.0, high=10.0, open_low=True, kind=float
    )
    stability_threshold: int | None = _setting(
        None, "stop rule: the draft unchanged for this many steps", low=0, high=1024, kind=int
    )
    confidence_threshold: float | None = _setting(
        None, "stop rule: ... and its mean entropy below this", low=0.0, high=100.0, open_low=True, kind=float
    )
    stop_token_ids: list[int] | None = None  # default: the generation config's eos_token_id
    sampler: str = _setting("entropy-bound", "which positions a step accepts", choices=tuple(SAMPLERS), kind=str)
    confidence: float = _setting(
        0.9, "confidence sampler: accept positions with p(top) at least this", low=0.0, high=1.0, open_low=True,
        kind=float,
    )  # fmt: skip
    tokens_per_step: int = _setting(16, "fixed sampler: positions accepted per step", low=1, high=4096, kind=int)
    mode: str = _setting(
        "fast", "fast: same distribution, less work; exact: transformers' token ids", choices=MODES, kind=str
    )
    seed: int | None = _setting(None, "random seed (None: a fresh one)", low=0, high=2**63 - 1, kind=int)
    greedy: bool = _setting(
        False, "accepted positions take their most likely token, not a draw (what temperature 0 asks)", kind=bool
    )
    early_commit: bool = _setting(False, "stream and freeze a canvas's leading tokens once they settle", kind=bool)
    early_commit_steps: int = _setting(
        3, "early commit: after this many steps with the same argmax", low=1, high=1024, kind=int
    )
    early_commit_entropy: float = _setting(
        0.1, "early commit: ... and an entropy below this at each", low=0.0, high=100.0, open_low=True, kind=float
    )

    def resolve(self, defaults, eos_fallback: list[int]) -> SamplingParams:
        """A copy with every None filled in from `defaults` (a GenerationConfig), validated (a ValueError
        names what is wrong)."""
        p = dataclasses.replace(self)
        for name in CHECKPOINT_DEFAULTED:
            if getattr(p, name) is None:
                setattr(p, name, getattr(defaults, name))
        if p.stop_token_ids is None:
            eos = defaults.eos_token_id
            p.stop_token_ids = eos_fallback if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        errors = validate(dataclasses.asdict(p))
        if p.mode == "exact" and (p.sampler != "entropy-bound" or p.early_commit or p.greedy):
            errors.append(
                "mode 'exact' reproduces transformers' generate: it has the entropy-bound sampler only, "
                "no early commit and no greedy draws"
            )
        if errors:
            message = "invalid sampling parameters: " + "; ".join(errors)
            named = sorted((message.find(n), -len(n), n) for n in SETTINGS if n in message)  # the first named
            raise RequestError(message, named[0][2] if named else None)
        return p

    def make_sampler(self):
        """The acceptance rule these settings name (SAMPLERS, above), with its own setting."""
        own = {"entropy-bound": self.entropy_bound, "confidence": self.confidence, "fixed": self.tokens_per_step}
        return SAMPLERS[self.sampler](own[self.sampler])


# name -> metadata (help, low, high, open_low, choices, kind) of every setting
SETTINGS: dict[str, dict[str, Any]] = {
    f.name: dict(f.metadata) for f in dataclasses.fields(SamplingParams) if f.metadata
}


class RequestError(ValueError):
    """A request that cannot run, found before any model pass: `param` is the field at fault, in the names
    of the task (dgemma.generation.programs), which every front end maps to its own (`named`), and `code`
    the kind of fault where a client tells kinds apart ("context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def named(self, names: dict[str, str]) -> RequestError:
        """The same error in a front end's names (`names`: a task's field -> the front end's)."""
        param = names.get(self.param, self.param)
        if param == self.param:
            return self
        message = self.message
        if self.param is not None and message.startswith(self.param):
            message = param + message[len(self.param) :]
        return type(self)(message, param, self.code)


def check(name: str, value: Any) -> str | None:
    """Why `value` is not a valid value of the setting `name`, or None (None itself is valid: 'default')."""
    meta = SETTINGS[name]
    if value is None:
        return None
    kind = meta["kind"]
    if meta["choices"] is not None:
        return None if value in meta["choices"] else f"{name} must be one of {meta['choices']} (got {value!r})"
    if kind is bool:
        return None if isinstance(value, bool) else f"{name} must be true or false (got {value!r})"
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int and not (number and float(value).is_integer()):
        return f"{name} must be an integer (got {value!r})"
    if not number or not math.isfinite(value):
        return f"{name} must be a finite number (got {value!r})"
    low, high, open_low = meta["low"], meta["high"], meta["open_low"]
    if value < low or value > high or (open_low and value == low):
        shown = f"{low}, {high}" if kind is int else f"{low:g}, {high:g}"
        what = "an integer" if kind is int else "a number"
        return f"{name} must be {what} in {'(' if open_low else '['}{shown}] (got {value!r})"
    return None


def validate(values: dict[str, Any]) -> list[str]:
    """Every problem with these settings (any subset of SamplingParams' fields), as messages naming them;
    GenerationConfig checks its own values with this too."""
    errors = [e for name, v in values.items() if name in SETTINGS and (e := check(name, v))]
    t_min, t_max = values.get("t_min"), values.get("t_max")
    if not errors and t_min is not None and t_max is not None and not t_min < t_max:
        errors.append(f"need t_min < t_max (got t_min={t_min}, t_max={t_max})")
    return errors
