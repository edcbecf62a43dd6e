"""Predicted outputs: the answer as a client expects it seeds the canvas (OpenAI's `prediction`).

A prediction is token ids aligned from the answer's first generated token; what does not fit in the
generated length is dropped. Each canvas starts from the prediction's tokens at its positions instead of
uniform noise (pinned positions still win), and lower in its step schedule, as SDEdit starts an image from
a noised copy halfway down: the denoiser reads the predicted canvas on its first step, accepts the
positions it is sure of, renoises the rest and goes on as usual, at the temperatures and with the steps
left of a canvas half done. A right prediction ends a canvas in the two steps the stop rule needs.

A wrong one must cost nothing: after the first step, a row whose draft keeps less than half of the
prediction's tokens holds a prediction the model mostly disagrees with (a self-consistent wrong answer
misleads it more than noise does), and starts again from noise through the rest of the full schedule,
as if never seeded: one step is spent. benchmarks/reuse_predict.py measures both choices, docs/server.md has the
numbers. The result counts, per row, the prediction tokens placed on the canvas that the answer kept at
their position (accepted) and the others (rejected), as OpenAI's usage does.
"""

from __future__ import annotations

import math

import torch

from .sampling import RequestError, random_tokens

# A seeded canvas starts at this fraction of max_denoising_steps (steps left, and the temperature there).
# On Sudoku 1, 0.5 and 0.25 end right and nearly right predictions in the same steps; the code model, whose
# stop rule never fires, spends 1, 0.5 and 0.25 of its forwards: 0.5 halves them without going further.
SEEDED_START = 0.5
# A seeded row whose first draft keeps less than this share of the prediction's placed tokens is misled.
# Sudoku's first drafts keep 100% of the solution, 72-83% of it with 10 cells wrong, 2-45% of a random grid.
SEED_AGREEMENT = 0.5


def check_prediction(prediction, rows: int, length: int, vocab: int) -> list[list[int]]:
    """`prediction` (token ids for every row, or one list per row) as one list per row, each cut to the
    `length` tokens generated (what does not fit is dropped unread, as OpenAI drops it); a RequestError
    naming `prediction` for anything else."""
    if isinstance(prediction, torch.Tensor) or not isinstance(prediction, list | tuple):
        raise RequestError("prediction must be a list of token ids (or one such list per prompt)", "prediction")
    per_row = bool(prediction) and isinstance(prediction[0], list | tuple)  # else ids (a list among them: refused)
    if per_row and len(prediction) != rows:
        raise RequestError(f"prediction has {len(prediction)} rows for a batch of {rows} prompts", "prediction")
    given = [
        row[:length] if isinstance(row, list | tuple) else row for row in (prediction if per_row else [prediction])
    ]
    for i, row in enumerate(given):
        if not isinstance(row, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise RequestError("prediction must be a list of token ids (or one such list per prompt)", "prediction")
        bad = [t for t in row if not 0 <= t < vocab]
        if bad:
            where = f"prediction {i}" if per_row else "prediction"
            raise RequestError(f"{where} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prediction")
    return [list(row) for row in given] * (1 if per_row else rows)


def prediction_tensor(rows: list[list[int]], device) -> torch.Tensor:
    """The rows as [B, L] token ids, -1 past each row's end (the layout of `pins`)."""
    out = torch.full((len(rows), max(map(len, rows), default=0)), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


def seeded_start(max_steps: int, share: float) -> int:
    """The first step (counted as steps remaining) of a canvas whose free positions a prediction seeds in
    `share` (0 to 1): `max_steps` lowered toward SEEDED_START of it in proportion, so that a canvas holding a
    few predicted tokens is denoised as one of noise; at least the two steps the stop rule needs."""
    return max(min(2, max_steps), math.ceil(max_steps * (1 - (1 - SEEDED_START) * share)))


def placed(window: torch.Tensor | None, covered: torch.Tensor, max_steps: int) -> tuple[torch.Tensor | None, int]:
    """A canvas's prediction tokens [B, C] (`window`, -1 where none) where they are placed, -1 where pins,
    the length or a finished row cover them (`covered`), or None when none is; and the step the canvas
    starts at (`seeded_start`)."""
    if window is None:  # no prediction
        return None, max_steps
    seeds = window.masked_fill(covered, -1)
    count, free = int((seeds >= 0).sum()), int((~covered).sum())
    return (seeds, seeded_start(max_steps, count / free)) if count else (None, max_steps)


def misled_rows(argmax: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows whose first draft `argmax` [B, C] keeps less than SEED_AGREEMENT of the prediction
    tokens `seeds` placed on their canvas (-1 elsewhere): a prediction the model mostly disagrees with."""
    kept = ((argmax == seeds) & (seeds >= 0)).sum(-1)
    return kept < SEED_AGREEMENT * (seeds >= 0).sum(-1)


def prediction_counts(
    prediction: torch.Tensor | None, pins: torch.Tensor | None, tokens: list[list[int]]
) -> tuple[list[int] | None, list[int] | None]:
    """Per row, (accepted, rejected) prediction tokens: of those placed on the canvas (not pinned), the
    ones equal to the answer's token at the same position, and the others (past the answer's end too);
    (None, None) without a prediction."""
    if prediction is None:
        return None, None
    accepted, rejected = [], []
    for r, answer in enumerate(tokens):
        row = prediction[r].tolist()
        pinned = [False] * len(row) if pins is None else (pins[r, : len(row)] >= 0).tolist()
        spots = [i for i, t in enumerate(row) if t >= 0 and not (i < len(pinned) and pinned[i])]
        kept = sum(1 for i in spots if i < len(answer) and answer[i] == row[i])
        accepted.append(kept)
        rejected.append(len(spots) - kept)
    return accepted, rejected


def drop_misleading(canvas, stopper, vocab: int, generator) -> bool:
    """After a seeded canvas's first step (loop._Canvas), the rows whose draft mostly disagrees with their
    prediction (`misled_rows`) start again from noise, as if never seeded (the step they spent is counted);
    True if any did (the canvas then goes on with an unseeded canvas's schedule)."""
    rows = misled_rows(canvas.argmax, canvas.seeds) & ~canvas.done
    if not bool(rows.any()):
        return False
    noise = random_tokens(canvas.tokens.shape, vocab, canvas.tokens.device, generator)
    canvas.tokens = torch.where(rows[:, None] & ~canvas.pinned, noise, canvas.tokens)
    if canvas.sc is not None:  # no self-conditioning: a first step's input
        canvas.sc = canvas.sc.masked_fill(rows[:, None, None], 0)
    canvas.stable_steps.masked_fill_(rows[:, None], 0)
    stopper.forget(rows)
    return True
