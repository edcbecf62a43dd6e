"""Statistics of traces (dgemma.tracing): the order in which canvases commit their tokens, and whether the
confidence at commit says which tokens are right.

`left_to_right`, `commit_sizes`, `late_burst`, `tokens_per_forward` and `calibration`, gathered by `summary`;
Spearman's rho and the AUROC are written here, so dgemma needs neither scipy nor scikit-learn. What each
statistic means, and the study made with them: docs/commitment.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .tracing import CanvasTrace, Trace


def ranks(x: Sequence[float]) -> np.ndarray:
    """1-based ranks of `x`, ties given their average rank."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=r)
    return sums[inverse] / counts[inverse]


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (nan when either side is constant or has fewer than 2 values)."""
    if len(x) < 2:
        return float("nan")
    a, b = ranks(x), ranks(y)
    a, b = a - a.mean(), b - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else float("nan")


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve of `scores` for `labels` (the chance that a right token is scored above
    a wrong one, ties counting half); nan without both kinds."""
    labels = np.asarray(labels, dtype=bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    r = ranks(scores)
    return float((r[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _units(c: CanvasTrace, unit_of: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(unit index, mean finalisation step) of each unit of the canvas's content positions."""
    where = np.flatnonzero(c.content)
    steps = c.final_step[where].astype(np.float64)
    if unit_of is None:
        return where.astype(np.float64), steps
    units = unit_of[where]
    keys, inverse = np.unique(units, return_inverse=True)
    return keys.astype(np.float64), np.bincount(inverse, weights=steps) / np.bincount(inverse)


def left_to_right(traces: Sequence[Trace], unit: str = "token", window: int = 16, texts=None) -> float:
    """Mean over canvases (weighted by their content positions) of Spearman's rho between a unit's place
    and its finalisation step. `unit`: "token", "window" (`window` tokens) or "line" (needs `texts`,
    a function from token ids to their texts)."""
    rhos, weights = [], []
    for t in traces:
        for c in t.canvases:
            n = c.tokens.shape[0]
            if unit == "token":
                unit_of = None
            elif unit == "window":
                unit_of = np.arange(n) // window
            elif unit == "line":
                if texts is None:
                    raise ValueError("line granularity needs the token texts")
                unit_of = np.cumsum([0] + [p.count("\n") for p in texts(c.tokens.tolist())[:-1]])
            else:
                raise ValueError(f"unit must be token, window or line (got {unit!r})")
            places, steps = _units(c, unit_of)
            rho = spearman(places, steps)
            if not np.isnan(rho):
                rhos.append(rho)
                weights.append(int(c.content.sum()))
    return float(np.average(rhos, weights=weights)) if rhos else float("nan")


@dataclass
class CommitSizes:
    per_step: list[float]  # mean positions finalised at each step (over canvases that ran that step)
    largest_share: float  # mean share of a canvas's content finalised in its largest step
    steps_with_commits: float  # mean count of steps that finalise anything


def commit_sizes(traces: Sequence[Trace]) -> CommitSizes:
    canvases = [c for t in traces for c in t.canvases if c.content.any()]
    if not canvases:
        return CommitSizes([], float("nan"), float("nan"))
    longest = max(c.steps for c in canvases)
    totals, counts = np.zeros(longest), np.zeros(longest)
    for c in canvases:
        totals[: c.steps] += c.finalised_per_step
        counts[: c.steps] += 1
    shares = [c.finalised_per_step.max() / c.content.sum() for c in canvases]
    busy = [(c.finalised_per_step > 0).sum() for c in canvases]
    return CommitSizes((totals / counts).tolist(), float(np.mean(shares)), float(np.mean(busy)))


@dataclass
class LateBurst:
    k: int
    share: float  # of content positions finalised in the last k steps their canvas ran
    steps_used: float  # mean steps a canvas ran, as a share of the budget


def late_burst(traces: Sequence[Trace], k: int = 2) -> LateBurst:
    late = total = 0
    used = []
    for t in traces:
        for c in t.canvases:
            if not c.content.any():
                continue
            late += int((c.final_step[c.content] > c.steps - k).sum())
            total += int(c.content.sum())
            used.append(c.steps / t.max_steps)
    return LateBurst(k, late / total if total else float("nan"), float(np.mean(used)) if used else float("nan"))


def tokens_per_forward(traces: Sequence[Trace]) -> float:
    steps = sum(c.steps for t in traces for c in t.canvases)
    return sum(int(c.content.sum()) for t in traces for c in t.canvases) / steps if steps else float("nan")


@dataclass
class Calibration:
    bins: list[tuple[float, float, int, float, float]]  # (low, high, count, mean confidence, accuracy)
    ece: float  # expected calibration error: count-weighted |accuracy - confidence|
    auroc: float
    accuracy: float
    count: int


def calibration(
    traces: Sequence[Trace], right: Callable[[Trace, CanvasTrace], np.ndarray], n_bins: int = 10
) -> Calibration:
    """Confidence at commit against correctness; `right(trace, canvas)` gives [C] per position 1 (the
    right token), 0 (a wrong one) or -1 (not known: left out); only content positions are read."""
    conf, ok = [], []
    for t in traces:
        for c in t.canvases:
            verdict = np.asarray(right(t, c)).astype(np.int8)
            known = c.content & (verdict >= 0)
            conf.append(c.commit_confidence[known])
            ok.append(verdict[known] == 1)
    conf, ok = np.concatenate(conf) if conf else np.zeros(0), np.concatenate(ok) if ok else np.zeros(0, bool)
    edges = np.linspace(0, 1, n_bins + 1)
    which = np.clip(np.digitize(conf, edges[1:-1]), 0, n_bins - 1)
    bins, ece = [], 0.0
    for i in range(n_bins):
        m = which == i
        if m.any():
            bins.append(
                (float(edges[i]), float(edges[i + 1]), int(m.sum()), float(conf[m].mean()), float(ok[m].mean()))
            )
            ece += m.sum() * abs(ok[m].mean() - conf[m].mean())
    n = len(conf)
    return Calibration(
        bins, ece / n if n else float("nan"), auroc(conf, ok), float(ok.mean()) if n else float("nan"), n
    )


def summary(traces: Sequence[Trace], texts=None, k: int = 2, window: int = 16) -> dict:
    """The statistics of `traces` as one JSON-ready dict (calibration is added by the caller that knows
    the right answers)."""
    sizes, burst = commit_sizes(traces), late_burst(traces, k)
    out = {
        "generations": len(traces),
        "canvases": sum(len(t.canvases) for t in traces),
        "content_tokens": sum(int(c.content.sum()) for t in traces for c in t.canvases),
        "left_to_right": {
            "token": left_to_right(traces, "token"),
            f"window{window}": left_to_right(traces, "window", window),
        },
        "commit_sizes": {
            "per_step": sizes.per_step,
            "largest_share": sizes.largest_share,
            "steps_with_commits": sizes.steps_with_commits,
        },
        "late_burst": {"k": burst.k, "share": burst.share, "steps_used": burst.steps_used},
        "tokens_per_forward": tokens_per_forward(traces),
    }
    if texts is not None:
        out["left_to_right"]["line"] = left_to_right(traces, "line", texts=texts)
    return out
