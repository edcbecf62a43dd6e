"""The block-diffusion training objective (stage 1: supervised denoising), one step's loss.

Per example (shared/reference/training-objective.md, sections 1 and 12; where the references differ the
choice is named in a comment with the reference it follows):

1. Split the response into canvases of C tokens, filling the last with end-of-text tokens
   (response-relative fill, Google/NeMo/TRL). Pick one canvas s uniformly (all references).
2. Draw a noise level t ~ U(eps, 1 - eps), eps = 1e-4 (Google, TRL; NeMo uses U(1e-3, 1)). Each canvas
   position is replaced by a uniformly random token id from the whole vocabulary with probability t (the
   end-of-text fill included; there is no mask token).
3. Encoder pass, with gradients, over the clean sequence [prompt ; every canvas]: causal, writing the
   KV cache. Its hidden states give the next-token co-loss.
4. Decoder pass 1, without gradients and with an exactly-zero self-conditioning signal, on the noisy
   canvas, seeing the clean prefix (prompt and earlier canvases) through the cache and nothing after it;
   sliding layers see the window ending at the canvas start, as at inference.
5. Decoder pass 2, with gradients: self-conditioned on pass 1's logits with probability 0.5, otherwise an
   exactly-zero signal (an all-zero embedding, not zero logits).
6. Loss = cross-entropy of pass 2 against the clean canvas at every position (corrupted or not, the fill
   included; no 1/t weight, no shift) + 1.0 x next-token cross-entropy of the encoder over every valid
   (i, i+1) pair. Adapting an autoregressive model (docs/adaptation.md) may add `teacher_kl_weight` x
   KL(teacher || denoiser) at each canvas position: the frozen AR model's next-token distribution of the
   canvas token given the clean text before it, which the denoiser learns from as well as from the token.
   Both are averaged per example, then over the batch (Google; NeMo/TRL use a token mean:
   `normalization: token`). No MoE auxiliary loss; the trainer freezes the router.

Implementation: the rows of a batch are aligned so that every selected canvas starts at the same index L
(rows are left-padded by L - their prefix length; attention depends only on position differences, so
the shift changes nothing). One encoder pass fills a cache that keeps every position, and both decoder
passes read `cache.prefix(L)`: exactly the keys each canvas is allowed to see.

Randomness is drawn per sample from a generator seeded by (seed, draw index): the same sample gets the
same noise whatever the batch split across processes or micro-batches, and a resumed run draws the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..images import preprocess
from ..model.config import TextConfig
from ..model.model import DiffusionGemma
from ..model.vision import Pixels
from .data import Example

LOSSES = ("flat", "reweighted", "mean_loo")
NORMALIZATIONS = ("example", "token")


@dataclass
class ObjectiveConfig:
    eps: float = 1e-4  # t ~ U(eps, 1 - eps)
    self_conditioning_prob: float = 0.5  # share of examples whose pass 2 is self-conditioned
    diffusion_loss_weight: float = 1.0
    encoder_loss_weight: float = 1.0  # the next-token co-loss
    loss: str = "flat"  # flat (the released recipes) | reweighted (1/(1-t), clipped) | mean_loo
    reweight_clip: float = 100.0
    normalization: str = "example"  # per-example mean then batch mean | token mean over the batch
    # tokens per chunk of the logits: both cross-entropies and pass 1's soft embedding take [chunk, V]
    # logits at a time (recomputed in the backward pass), never [tokens, V] at once
    logit_chunk_tokens: int = 512
    # which next tokens the encoder loss scores: "all" (prompt and response, the released recipes) or
    # "response" (only response tokens that are not pinned: what an AR twin of a task model must predict)
    encoder_targets: str = "all"
    # KL(frozen AR teacher's next-token distribution || the denoiser's) at each canvas position whose token
    # is a next-token target, when a teacher is given (the trainer's: a frozen copy of the starting model)
    teacher_kl_weight: float = 0.0

    def __post_init__(self) -> None:
        errors = []
        if not 0 < self.eps < 0.5:
            errors.append(f"eps must be in (0, 0.5) (got {self.eps})")
        if not 0 <= self.self_conditioning_prob <= 1:
            errors.append(f"self_conditioning_prob must be in [0, 1] (got {self.self_conditioning_prob})")
        if self.loss not in LOSSES:
            errors.append(f"loss must be one of {LOSSES} (got {self.loss!r})")
        if self.normalization not in NORMALIZATIONS:
            errors.append(f"normalization must be one of {NORMALIZATIONS} (got {self.normalization!r})")
        if self.diffusion_loss_weight < 0 or self.encoder_loss_weight < 0 or self.teacher_kl_weight < 0:
            errors.append("loss weights must be >= 0")
        if self.encoder_targets not in ("all", "response"):
            errors.append(f"encoder_targets must be 'all' or 'response' (got {self.encoder_targets!r})")
        if self.reweight_clip <= 0 or self.logit_chunk_tokens <= 0:
            errors.append("reweight_clip and logit_chunk_tokens must be > 0")
        if errors:
            raise ValueError("invalid objective: " + "; ".join(errors))


@dataclass
class Sample:
    """One training draw: an example with its canvas, noise level, corruption and self-conditioning coin."""

    example: Example
    canvas: int
    t: float
    flip: torch.Tensor  # [C] bool: positions replaced by noise
    noise: torch.Tensor  # [C] the random replacement tokens
    self_condition: bool


def draw_sample(
    example: Example, draw: int, seed: int, canvas_length: int, vocab_size: int, cfg: ObjectiveConfig
) -> Sample:
    g = torch.Generator().manual_seed((seed * 1_000_003 + draw) % (2**63))
    num_canvases = max(1, math.ceil(len(example.response) / canvas_length))
    canvas = int(torch.randint(0, num_canvases, (1,), generator=g))
    t = cfg.eps + (1 - 2 * cfg.eps) * float(torch.rand((), generator=g))
    flip = torch.rand(canvas_length, generator=g) < t
    noise = torch.randint(0, vocab_size, (canvas_length,), generator=g)
    coin = float(torch.rand((), generator=g)) < cfg.self_conditioning_prob
    return Sample(example, canvas, t, flip, noise, coin)


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] clean sequences, aligned so every selected canvas starts at `canvas_start`
    valid: torch.Tensor  # [B, T] real tokens
    ar_targets: torch.Tensor  # [B, T] bool: position i+1 is a next-token target of position i
    canvas_start: int  # L
    clean: torch.Tensor  # [B, C] the selected canvases
    noisy: torch.Tensor  # [B, C]
    supervised: torch.Tensor  # [B, C] bool: canvas positions in the diffusion loss
    t: torch.Tensor  # [B]
    self_condition: torch.Tensor  # [B] bool
    pixels: Pixels | None = None  # the prompts' images, row after row (as their placeholders come)

    @property
    def tokens(self) -> int:
        """Tokens processed (encoder sequence plus the canvas), for throughput."""
        return int(self.valid.sum()) + self.clean.numel()


def fill_token(text: TextConfig) -> int:
    """The token a response shorter than its canvases is filled with (response-relative end-of-text fill):
    the model's first end-of-text token."""
    return text.eos_token_ids[0] if text.eos_token_ids else 1


def assemble(
    samples: list[Sample], canvas_length: int, eos_id: int, pad_id: int, encoder_targets: str = "all"
) -> Batch:
    """Pad a list of draws into one batch; `encoder_targets` picks the next tokens the encoder loss scores
    ("all", or "response": response tokens that are not pinned)."""
    c = canvas_length
    rows = []
    for s in samples:
        ex = s.example
        n = max(1, math.ceil(len(ex.response) / c))
        filled = ex.response + [eos_id] * (n * c - len(ex.response))  # response-relative end-of-text fill
        prefix = ex.prompt + filled[: s.canvas * c]
        rest = filled[s.canvas * c :]
        # Positions that may be supervised: everything, except the fill after a truncated response.
        real_end = len(ex.prompt) + len(ex.response)
        target_ok = [True] * (len(prefix) + len(rest))
        if ex.truncated:
            target_ok = [i < real_end for i in range(len(target_ok))]
        # Pinned response positions (given at inference): never noised, not scored.
        flags = list(ex.pinned or ()) + [False] * (n * c - len(ex.pinned or ()))
        pins = flags[s.canvas * c : (s.canvas + 1) * c]
        ar_ok = list(target_ok)
        if encoder_targets == "response":
            p = len(ex.prompt)
            ar_ok = [ok and i >= p and not flags[i - p] for i, ok in enumerate(target_ok)]
        rows.append((prefix, rest, target_ok, pins, ar_ok))
    start = max(len(r[0]) for r in rows)
    width = start + max(len(r[1]) for r in rows)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    target = torch.zeros(b, width, dtype=torch.bool)
    ar_target = torch.zeros(b, width, dtype=torch.bool)
    for i, (prefix, rest, ok, _, ar_ok) in enumerate(rows):
        a = start - len(prefix)
        seq = prefix + rest
        ids[i, a : a + len(seq)] = torch.tensor(seq)
        valid[i, a : a + len(seq)] = True
        target[i, a : a + len(seq)] = torch.tensor(ok)
        ar_target[i, a : a + len(seq)] = torch.tensor(ar_ok)
    # a next-token pair (i, i+1) counts when both are real tokens and i+1 is a scored position
    ar_targets = torch.zeros_like(valid)
    ar_targets[:, 1:] = valid[:, :-1] & valid[:, 1:] & ar_target[:, 1:]
    clean = ids[:, start : start + c].clone()
    pinned = torch.tensor([r[3] for r in rows], dtype=torch.bool)
    flips = torch.stack([s.flip for s in samples]) & ~pinned
    noisy = torch.where(flips, torch.stack([s.noise for s in samples]), clean)
    supervised = target[:, start : start + c] & ~pinned
    return Batch(
        ids,
        valid,
        ar_targets,
        start,
        clean,
        noisy,
        supervised,
        torch.tensor([s.t for s in samples]),
        torch.tensor([s.self_condition for s in samples]),
        _batch_pixels([s.example for s in samples]),
    )


def _batch_pixels(examples: list[Example]) -> Pixels | None:
    """The images of a batch's prompts, preprocessed now (examples keep paths, not pixels)."""
    groups = []
    for ex in examples:
        if ex.images:
            patch, pooling = ex.image_geometry
            groups.append(preprocess(ex.images, ex.image_budget, patch_size=patch, pooling_kernel_size=pooling)[0])
    return Pixels.cat(groups) if groups else None


def _mean(per_token: torch.Tensor, weight: torch.Tensor, normalization: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, per-example means) of per-token losses [B, N] over the positions where weight is 1."""
    counts = weight.sum(-1)
    per_example = (per_token * weight).sum(-1) / counts.clamp(min=1)  # no tokens: zero loss, not NaN
    if normalization == "token":
        return (per_token * weight).sum() / counts.sum().clamp(min=1), per_example
    return per_example.mean(), per_example


def _chunks(hidden: torch.Tensor, cfg: ObjectiveConfig) -> list[slice]:
    """Position chunks of hidden [B, T, M]: logit_chunk_tokens tokens (over the batch rows) per chunk."""
    step = max(1, cfg.logit_chunk_tokens // hidden.shape[0])
    return [slice(a, a + step) for a in range(0, hidden.shape[1], step)]


def _chunked(fn, *args: torch.Tensor | None) -> torch.Tensor:
    """fn(*args) on one chunk, its logits recomputed in the backward pass rather than kept."""
    return checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args)


def _chunk_loss(
    model: DiffusionGemma,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    observed: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of the logits of one chunk of positions against `targets`; with `observed`
    (mean_loo), `shift` [B] is first added to the logit of the token observed at each position."""
    logits = model.lm_head(hidden)
    if observed is not None:
        logits = logits.scatter_add(-1, observed[..., None], shift[:, None, None].expand(-1, logits.shape[1], 1))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none").view(
        targets.shape
    )


def encoder_loss(model: DiffusionGemma, hidden: torch.Tensor, batch: Batch, cfg: ObjectiveConfig):
    """Next-token cross-entropy of the encoder over the valid pairs, in chunks of positions; each chunk's
    logits are recomputed in the backward pass rather than kept (they are [B, chunk, V] in fp32)."""
    h, targets, weight = hidden[:, :-1], batch.ids[:, 1:], batch.ar_targets[:, 1:].float()
    parts = [_chunked(partial(_chunk_loss, model), h[:, c], targets[:, c]) for c in _chunks(h, cfg)]
    return _mean(torch.cat(parts, dim=1), weight, cfg.normalization)


def soft_embedding(model: DiffusionGemma, hidden: torch.Tensor, cfg: ObjectiveConfig) -> torch.Tensor:
    """model.soft_embedding(model.lm_head(hidden)), a chunk of positions at a time (no gradient)."""
    return torch.cat([model.soft_embedding(model.lm_head(hidden[:, c])) for c in _chunks(hidden, cfg)], dim=1)


def diffusion_loss(model: DiffusionGemma, hidden: torch.Tensor, batch: Batch, cfg: ObjectiveConfig):
    """Cross-entropy of the denoiser's logits (from `hidden`, a chunk of positions at a time) against the
    clean canvas: (mean, per-example means)."""
    shift = None
    if cfg.loss == "mean_loo":
        # Leave-one-out parameterisation: add log(1 + K a / (1 - a)), a = 1 - t, to the logit of the token
        # observed at each position (arXiv 2605.22765; TRL/Unsloth `mean_loo`). The sampler would have to
        # apply the same shift; dgemma's does not, so use this only for experiments.
        alpha = 1 - batch.t
        shift = torch.log1p(model.text_config.vocab_size * alpha / (1 - alpha)).float()
    fn = partial(_chunk_loss, model)
    parts = [
        _chunked(fn, hidden[:, c], batch.clean[:, c], None if shift is None else batch.noisy[:, c], shift)
        for c in _chunks(hidden, cfg)
    ]
    mean, per_example = _mean(torch.cat(parts, dim=1), batch.supervised.float(), cfg.normalization)
    if cfg.loss == "reweighted":  # w(t) = -a'/a = 1/(1 - t), clipped (Megatron-Bridge)
        w = (1.0 / (1.0 - batch.t)).clamp(max=cfg.reweight_clip).to(per_example.dtype)
        mean = (per_example * w).mean()
    return mean, per_example


def _chunk_kl(model: DiffusionGemma, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-position KL(target || the logits of `hidden`), `target` log-probabilities [B, chunk, V]."""
    logq = torch.log_softmax(model.lm_head(hidden), dim=-1)
    return (target.exp() * (target - logq)).sum(-1)


def teacher_kl(
    model: DiffusionGemma, hidden: torch.Tensor, teacher: DiffusionGemma, batch: Batch, cfg: ObjectiveConfig
):
    """KL(teacher || denoiser) over the canvas, the denoiser's logits from `hidden` [B, C, M]: the frozen AR
    teacher reads the clean text up to each canvas token (causal, no gradient) and predicts it from the
    position before. Weighted where that token is a next-token target: (mean, per-example means)."""
    start, c = batch.canvas_start, batch.clean.shape[1]
    with torch.no_grad():
        width = start + c - 1
        cache = teacher.new_cache(batch.ids.shape[0], max(width, 1))
        ids, valid = batch.ids[:, :width], batch.valid[:, :width]
        before = teacher.encode(ids, cache, attention_mask=valid).hidden_states[:, max(start - 1, 0) :]
        if start == 0:  # the canvas's first token has no text before it: no target there
            before = torch.cat([before.new_zeros(before.shape[0], 1, before.shape[2]), before], dim=1)
    weight = batch.ar_targets[:, start : start + c].float() * batch.supervised.float()
    if start == 0:
        weight[:, 0] = 0
    parts = []
    for chunk in _chunks(hidden, cfg):
        with torch.no_grad():
            target = torch.log_softmax(teacher.lm_head(before[:, chunk]), dim=-1)
        parts.append(_chunked(partial(_chunk_kl, model), hidden[:, chunk], target))
    return _mean(torch.cat(parts, dim=1), weight, cfg.normalization)


def block_diffusion_loss(
    model: DiffusionGemma, batch: Batch, cfg: ObjectiveConfig, teacher: DiffusionGemma | None = None
) -> tuple[torch.Tensor, dict]:
    """The loss of one batch and its parts (floats, for logging); `teacher`, a frozen AR model, adds the
    KL of `cfg.teacher_kl_weight`."""
    device = model.device
    batch = Batch(*(x.to(device) if isinstance(x, torch.Tensor | Pixels) else x for x in vars(batch).values()))
    b, width = batch.ids.shape
    if cfg.encoder_loss_weight == 0:  # no next-token loss: encode only the prefix the canvases may see
        width = batch.canvas_start
    cache = model.new_cache(b, width, keep_all=True)
    mask = batch.valid[:, :width]
    hidden = model.encode(batch.ids[:, :width], cache, attention_mask=mask, pixels=batch.pixels).hidden_states
    ar = encoder_loss(model, hidden, batch, cfg)[0] if cfg.encoder_loss_weight else hidden.new_zeros(())
    if cfg.diffusion_loss_weight == 0:  # a plain autoregressive model (e.g. an AR twin): no decoder passes
        loss = cfg.encoder_loss_weight * ar
        return loss, {"loss": float(loss.detach()), "diffusion_loss": 0.0, "encoder_loss": float(ar.detach())}
    view = cache.prefix(batch.canvas_start)  # the clean prefix only: no canvas sees itself or later ones
    with torch.no_grad():
        soft = soft_embedding(model, model.denoise_hidden(batch.noisy, view), cfg)
    hidden = model.denoise_hidden(
        batch.noisy,
        view,
        soft * batch.self_condition.to(soft.dtype)[:, None, None],  # off rows: exactly zero
    )
    diff, _ = diffusion_loss(model, hidden, batch, cfg)
    loss = cfg.diffusion_loss_weight * diff + cfg.encoder_loss_weight * ar
    parts = {"diffusion_loss": float(diff.detach()), "encoder_loss": float(ar.detach())}
    if teacher is not None and cfg.teacher_kl_weight:
        kl, _ = teacher_kl(model, hidden, teacher, batch, cfg)
        loss = loss + cfg.teacher_kl_weight * kl
        parts["teacher_kl"] = float(kl.detach())
    return loss, {"loss": float(loss.detach()), **parts}
