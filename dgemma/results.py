"""What a generation reports: its events (drafts, final tokens), its result and statistics, and the
per-row bookkeeping both canvas loops (dgemma/generate.py, dgemma/reference.py) keep."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .settings import SamplingParams


@dataclass
class DraftEvent:
    """After each denoising step: the argmax canvas of every row (finished rows keep their last draft)."""

    canvas_index: int
    step: int  # 1 for the first step of a canvas
    drafts: torch.Tensor  # [B, C]
    accepted: torch.Tensor  # [B, C] bool: positions accepted (or pinned) this step
    # with step_stats: of the distribution the sampler read (after temperature and constraints); a row
    # that has stopped keeps its last values
    entropy: torch.Tensor | None = None  # [B, C] fp32
    confidence: torch.Tensor | None = None  # [B, C] fp32, the argmax's probability


@dataclass
class TokensEvent:
    """Tokens of one row that are final: a committed canvas, or its leading part under early commit."""

    row: int
    tokens: list[int]
    canvas_index: int
    early: bool = False


@dataclass
class GenerationStats:
    canvases: int
    steps_per_canvas: list[list[int]]  # per row: denoising steps that row ran in each canvas
    # per row and canvas: the stop rule (stable and confident) ended it, at or before the step cap (or, with
    # early commit, every position was committed; a row that had already stopped counts as ended)
    converged_per_canvas: list[list[bool]]
    decoder_forward_passes: list[int]
    tokens_per_forward: list[float]
    time_to_first_token: float | None  # seconds from the call to the first final token
    elapsed: float
    tokens_per_second: float
    prompt_tokens: list[int]


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # per row: new tokens, stop token excluded, at most max_new_tokens
    finish_reasons: list[str]  # "stop" (a stop token) or "length" (max_new_tokens)
    sequences: torch.Tensor  # [B, canvases * C]: the committed canvases, pad after a stop token
    stats: GenerationStats
    text: list[str] | None = None
    # with `logprobs=k`: per row and token, the denoiser's log-probability of it at its canvas's last step
    # (before temperature), and the k likeliest tokens there as (id, log-probability)
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


class Output:
    """Per-row bookkeeping of what has been returned, and why a row finished."""

    def __init__(self, batch: int, p: SamplingParams, prompt_tokens: list[int], pad_id: int, device, t0: float):
        max_new_tokens, stop_ids = p.max_new_tokens, p.stop_token_ids
        self.t0, self.pad_id, self.prompt_tokens = t0, pad_id, prompt_tokens
        self.passes = torch.zeros(batch, dtype=torch.long, device=device)  # denoising passes per row
        self.steps_per_canvas: list[list[int]] = [[] for _ in range(batch)]
        self.converged_per_canvas: list[list[bool]] = [[] for _ in range(batch)]
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.logprobs: list[list[float]] = [[] for _ in range(batch)]  # with logprobs: one per token
        self.top: list[list[list[tuple[int, float]]]] = [[] for _ in range(batch)]
        self.reasons: list[str | None] = [None] * batch
        self.max_new = max_new_tokens
        self.stop_ids = set(stop_ids)
        self.first_token_time: float | None = None

    def end_canvas(self, steps: torch.Tensor, converged: torch.Tensor) -> None:
        """A canvas ended: the steps each row ran in it, and whether its stop rule ended it."""
        for r, (n, done) in enumerate(zip(steps.tolist(), converged.tolist(), strict=True)):
            self.steps_per_canvas[r].append(n)  # one device read per canvas, not one per row
            self.converged_per_canvas[r].append(done)

    def result(self, sequences: torch.Tensor, logprobs: bool = False) -> GenerationResult:
        """The GenerationResult of the committed canvases `sequences` [B, canvases * C]."""
        elapsed = time.perf_counter() - self.t0
        counted = (sequences[:, : self.max_new] != self.pad_id).sum(-1)
        passes = self.passes.tolist()
        total = sum(len(t) for t in self.tokens)
        first = self.first_token_time
        stats = GenerationStats(
            canvases=len(self.steps_per_canvas[0]),
            steps_per_canvas=self.steps_per_canvas,
            converged_per_canvas=self.converged_per_canvas,
            decoder_forward_passes=passes,
            tokens_per_forward=[float(n) / max(f, 1) for n, f in zip(counted.tolist(), passes, strict=True)],
            time_to_first_token=None if first is None else first - self.t0,
            elapsed=elapsed,
            tokens_per_second=total / elapsed if elapsed > 0 else 0.0,
            prompt_tokens=self.prompt_tokens,
        )
        result = GenerationResult(self.tokens, [r or "length" for r in self.reasons], sequences, stats)
        if logprobs:
            result.logprobs, result.top_logprobs = self.logprobs, self.top
        return result

    def finished(self, row: int) -> bool:
        return self.reasons[row] is not None

    def take(self, row: int, tokens: list[int], canvas_index: int, early: bool, logprobs=None) -> TokensEvent | None:
        """Append final tokens to a row up to a stop token or the length limit (and, given as (log-probabilities,
        alternatives) aligned with `tokens`, their log-probabilities); None if nothing is new."""
        out = []
        for t in tokens:
            if t in self.stop_ids:
                self.reasons[row] = "stop"
                break
            out.append(t)
            if len(self.tokens[row]) + len(out) >= self.max_new:
                self.reasons[row] = "length"
                break
        self.tokens[row].extend(out)
        if logprobs is not None:
            self.logprobs[row].extend(logprobs[0][: len(out)])
            self.top[row].extend(logprobs[1][: len(out)])
        if not out:
            return None
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        return TokensEvent(row, out, canvas_index, early)


def sequence_canvas(final: torch.Tensor, stop: torch.Tensor, pad_id: int, was_finished: torch.Tensor):
    """The reference's committed canvas: pad after the first stop token, all pad for rows finished before."""
    is_stop = torch.isin(final, stop)
    seen = is_stop.cumsum(-1)
    after = (seen > 0) & ~((seen == 1) & is_stop)
    out = final.masked_fill(after, pad_id)
    out[was_finished] = pad_id
    return out, is_stop.any(-1)
