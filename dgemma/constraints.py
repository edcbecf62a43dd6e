"""Per-position allowed-token sets: which tokens a position of the generated sequence may hold.

`generate`, `stream`, `prepare` and `fill` take `allowed=`: for each position of each row's generated
sequence, None (any token) or the token ids it may hold. Every denoising step then gives the tokens
outside a position's set the lowest logit (`sampling.restrict`) before the sampler reads the step, so
the entropy that decides acceptance, the draws, the argmax draft and the self-conditioning are those of
the constrained distribution; renoising stays uniform over the vocabulary, as in training. The committed
canvas is the argmax draft, so every returned token at a constrained position is in its set.

Stored as `Allowed`: one bool row per distinct set (`classes` [K, V]) and a class index per position
(`index` [B, L], -1 where anything goes), so a set shared by many positions (a JSON string's characters,
a number's digits) is held once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

TokenSet = Collection[int] | torch.Tensor | None  # ids, a bool [V] mask, or None (any token)


@dataclass(frozen=True)
class Allowed:
    """Allowed tokens per position: `classes` [K, V] bool, `index` [B, L] long (a row of `classes`, or -1)."""

    classes: torch.Tensor
    index: torch.Tensor

    @classmethod
    def from_sets(cls, rows: Sequence[Sequence[TokenSet]], vocab_size: int) -> Allowed:
        """From one list of sets per row (rows of equal length); equal sets share a class."""
        if not rows or len({len(r) for r in rows}) != 1:
            raise ValueError("allowed needs one list of token sets per row, all of the same length")
        classes: list[torch.Tensor] = []
        keys: dict[bytes, int] = {}
        index = torch.full((len(rows), len(rows[0])), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            for i, tokens in enumerate(row):
                if tokens is None:
                    continue
                mask = token_mask(tokens, vocab_size, f"allowed[{r}][{i}]")
                key = mask.numpy().tobytes()
                if key not in keys:
                    keys[key] = len(classes)
                    classes.append(mask)
                index[r, i] = keys[key]
        stacked = torch.stack(classes) if classes else torch.zeros(0, vocab_size, dtype=torch.bool)
        return cls(stacked, index)

    def check(self, rows: int, vocab_size: int, pins: torch.Tensor | None = None) -> None:
        """ValueError unless this fits a batch of `rows` over `vocab_size` tokens (and keeps the pins)."""
        if self.classes.dtype != torch.bool or self.classes.dim() != 2 or self.classes.shape[1] != vocab_size:
            raise ValueError(f"allowed.classes must be a bool [K, {vocab_size}] tensor")
        if self.index.dim() != 2 or self.index.shape[0] != rows:
            raise ValueError(f"allowed.index must be [{rows}, length] (one row per prompt)")
        k = self.classes.shape[0]
        if bool(((self.index < -1) | (self.index >= k)).any()):
            raise ValueError(f"allowed.index holds a class outside [-1, {k})")
        if k and not bool(self.classes.any(-1).all()):
            raise ValueError("an allowed set is empty: no token could be placed there")
        if pins is None:
            return
        n = min(pins.shape[1], self.index.shape[1])
        pin, cls = pins[:, :n].cpu(), self.index[:, :n].cpu()
        both = (pin >= 0) & (cls >= 0)
        if both.any():
            ok = self.classes.cpu()[cls[both], pin[both]]
            if not bool(ok.all()):
                r, i = both.nonzero()[int((~ok).nonzero()[0])].tolist()
                raise ValueError(f"row {r}, position {i}: the pinned token {int(pin[r, i])} is not in its allowed set")

    def to(self, device) -> Allowed:
        return Allowed(self.classes.to(device), self.index.to(device))


def token_mask(tokens: TokenSet, vocab_size: int, what: str = "allowed") -> torch.Tensor:
    """A set of token ids (or a bool [V] mask) as a bool [V] mask; ValueError if empty or out of range."""
    if isinstance(tokens, torch.Tensor) and tokens.dtype == torch.bool:
        if tokens.shape != (vocab_size,):
            raise ValueError(f"{what}: a mask must have the vocabulary's {vocab_size} entries")
        mask = tokens.cpu().clone()
    else:
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{what} must be a collection of token ids")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{what} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[torch.tensor(ids, dtype=torch.long)] = True
    if not bool(mask.any()):
        raise ValueError(f"{what} is empty: no token could be placed there")
    return mask


def as_allowed(value, rows: int, vocab_size: int) -> Allowed | None:
    """`allowed=` as given (an Allowed, one row's list of sets, or one list per row) as an Allowed."""
    if value is None or isinstance(value, Allowed):
        return value
    if not isinstance(value, Sequence) or not value:
        raise ValueError("allowed must be an Allowed, a list of token sets (None for any), or one such list per row")
    one_row = not all(isinstance(r, Sequence) and not isinstance(r, str | bytes) and _is_row(r) for r in value)
    return Allowed.from_sets([value] * rows if one_row else value, vocab_size)


def _is_row(row: Sequence) -> bool:
    """A row of sets (its items are None or collections), not one set of ids."""
    return all(x is None or isinstance(x, Collection | torch.Tensor) for x in row) and not all(
        isinstance(x, int) for x in row
    )
