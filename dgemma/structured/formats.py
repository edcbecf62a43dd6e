"""String formats of a fixed shape (date, time, date-time, uuid, duration), valid by construction.

The separators are pinned and every other character is a position of its own, restricted to the
single-character tokens that may stand there; a field whose characters depend on each other (a month, an
hour) is read back as one of its values, the model's scores choosing where the fill spells none, and a
day past its month's end is moved to that end. The answer is written from the values read back, so it
always has the format (docs/structured.md).
"""

from __future__ import annotations

import calendar
import re
from typing import Any

import torch

from .nodes import MORE, _Layout, _Read
from .tokens import StructuredOutputError, TokenClasses

DIGIT, HEX = "0123456789", "0123456789abcdef"
Field = tuple[list[str], list[str] | None]  # per position its characters; the field's values (None: any)


def _values(low: int, high: int) -> Field:
    values = [f"{n:02d}" for n in range(low, high + 1)]
    return [sorted({v[k] for v in values}) for k in range(2)], values


def _free(chars: str, n: int, first: str | None = None) -> Field:
    return [first or chars] + [chars] * (n - 1), None


YEAR, MONTH, DAY = _free(DIGIT, 4, first="12"), _values(1, 12), _values(1, 31)
HOUR, MINUTE = _values(0, 23), _values(0, 59)
DATE = [YEAR, "-", MONTH, "-", DAY]
TIME = [HOUR, ":", MINUTE, ":", MINUTE]
FORMATS: dict[str, list[str | Field]] = {
    "date": DATE,
    "time": TIME,
    "date-time": [*DATE, "T", *TIME, "Z"],
    "uuid": [_free(HEX, 8), "-", _free(HEX, 4), "-", _free(HEX, 4), "-", _free(HEX, 4), "-", _free(HEX, 12)],
    "duration": ["P", _free(DIGIT, 2), "DT", HOUR, "H", MINUTE, "M", MINUTE, "S"],  # ISO 8601, up to 99 days
}


def _char_tokens(c: TokenClasses, chars: list[str], strict: bool = True) -> list[int]:
    """The single-character tokens of `chars`: of every one, in order (`strict`: a value's characters must
    all be writable), or of those the tokenizer has (a class: at least one)."""
    found = {}
    for ch in chars:
        ids = c.tokenizer.encode(ch, add_special_tokens=False)
        if len(ids) == 1 and ids[0] < c.vocab_size and c.usable(ids[0]):
            found[ch] = ids[0]
    if not found or (strict and any(ch not in found for ch in chars)):
        raise StructuredOutputError(f"this tokenizer has no single-character token for one of {''.join(chars)!r}")
    return [found[ch] for ch in chars] if strict else list(found.values())


class _Format:
    """A string of one of FORMATS: pinned separators, a position per character."""

    def __init__(self, name: str):
        self.name, self.parts = name, FORMATS[name]

    def size(self, value: Any, c: TokenClasses, syntax) -> None:
        pass  # a fixed shape: nothing to size

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str)

    def shortest(self) -> str:
        return "".join(
            p if isinstance(p, str) else (p[1][0] if p[1] else "".join(s[0] for s in p[0])) for p in self.parts
        )

    def layout(self, b: _Layout) -> None:
        c = b.classes
        b.text(b.syntax.string_open)
        self.spans = []
        for part in self.parts:
            if isinstance(part, str):
                b.text(part)
                continue
            masks = []
            for chars in part[0]:
                mask = torch.zeros(c.vocab_size, dtype=torch.bool)
                mask[_char_tokens(c, list(chars), strict=part[1] is not None)] = True
                masks.append(mask)
            self.spans.append(b.hole(masks))
        b.text(b.syntax.string_open)

    def read(self, r: _Read) -> str:
        out, spans = [], iter(self.spans)
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            span, values = next(spans), part[1]
            text = "".join(r.classes.texts[t] for t in r.tokens[span])
            if values is not None and text not in values:
                options = [_char_tokens(r.classes, list(v)) for v in values]
                text = values[r.score(span.start, options)]
            out.append(text)
        return self._repaired("".join(out))

    def _repaired(self, value: str) -> str:
        """A day past its month's end moved to that end (2025-02-30 -> 2025-02-28)."""
        if self.name not in ("date", "date-time"):
            return value
        year, month, day = int(value[:4]), int(value[5:7]), int(value[8:10])
        last = calendar.monthrange(year, month)[1]
        return value if day <= last else f"{value[:8]}{last:02d}{value[10:]}"

    def scan(self, text: str, i: int):
        """The AR grammar: a quoted string whose characters keep to the positions' sets, whose fields hold
        their values."""
        chars = [s for p in self.parts for s in (list(p) if isinstance(p, str) else p[0])]
        if i == len(text):
            yield MORE
            return
        if text[i] != '"':
            return
        body = text[i + 1 : i + 1 + len(chars)]
        if any(ch not in allowed for ch, allowed in zip(body, chars, strict=False)):
            return
        if len(body) < len(chars):
            yield MORE
        elif re.fullmatch(self._pattern(), body) and text[i + 1 + len(chars) : i + 2 + len(chars)] == '"':
            yield i + 2 + len(chars)
        elif i + 1 + len(chars) == len(text) and re.fullmatch(self._pattern(), body):
            yield MORE

    def _pattern(self) -> str:
        parts = []
        for p in self.parts:
            if isinstance(p, str):
                parts.append(re.escape(p))
            elif p[1] is not None:
                parts.append("(?:" + "|".join(p[1]) + ")")
            else:
                parts.append("".join(f"[{re.escape(s)}]" for s in p[0]))
        return "".join(parts)
