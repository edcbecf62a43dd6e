"""The template being built, and one node per schema value that lays itself out and reads itself back; the
grammar of a schema's answers for left-to-right decoding."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .tokens import JSON, MAX_TEMPLATE_TOKENS, Syntax, TemplateTooLong, TokenClasses, check_deadline, json_text

# ------------------------------------------------------------------------------------------------
# Layout: the template being built


@dataclass
class _Layout:
    classes: TokenClasses
    syntax: Syntax = JSON
    template: list[int | None] = field(default_factory=list)
    allowed: list[torch.Tensor | None] = field(default_factory=list)
    holes: list[tuple[slice, torch.Tensor | None]] = field(default_factory=list)  # each hole, and what ends it
    pending: str = ""
    scored: bool = False  # a node reads its holes with the fill's scores (`_Read.alternatives`)

    def text(self, s: str) -> None:
        self.pending += s

    def flush(self) -> None:
        if self.pending:
            ids = self.classes.tokenizer.encode(self.pending, add_special_tokens=False)
            self.template += ids
            self.allowed += [None] * len(ids)
            self.pending = ""

    def hole(self, masks: list[torch.Tensor], end: torch.Tensor | None = None) -> slice:
        """Holes at the next positions, one per mask of allowed tokens; `end` marks the tokens that close
        the value (what follows them in the hole is dropped)."""
        self.flush()
        check_deadline()
        start = len(self.template)
        self.template += [None] * len(masks)
        self.allowed += masks
        if len(self.template) > MAX_TEMPLATE_TOKENS:
            raise TemplateTooLong(f"the schema needs more than {MAX_TEMPLATE_TOKENS} tokens of template")
        span = slice(start, start + len(masks))
        self.holes.append((span, end))
        return span


class _Invalid(Exception):
    """A filled value that its type cannot read (a lone minus sign): the answer is drawn again."""


@dataclass
class _Read:
    """What reading the filled template needs: its tokens, their texts, and a scorer for choices."""

    tokens: list[int]
    classes: TokenClasses
    score: Callable[[int, list[list[int]]], int]  # (template position, options' tokens) -> best option
    # template position -> {token: the fill's log-probability} of the tokens it has there (None: no scores)
    alternatives: Callable[[int], dict[int, float] | None] = lambda position: None

    def text(self, span: slice, end: torch.Tensor | None) -> str:
        """The text of a hole up to (not including) its first token in `end` (None: all of it)."""
        out = []
        for t in self.tokens[span]:
            if end is not None and bool(end[t]):
                break
            out.append(self.classes.texts[t])
        return "".join(out)


# ------------------------------------------------------------------------------------------------
# Nodes: one per schema value, each lays itself out and reads itself back


class _Const:
    def __init__(self, value: Any):
        self.value = value

    def layout(self, b: _Layout) -> None:
        b.text(b.syntax.write(self.value))

    def size(self, value: Any, c: TokenClasses, syntax: Syntax) -> None:
        pass

    def accepts(self, value: Any) -> bool:
        return _same(self.value, value)

    def shortest(self) -> Any:
        return self.value

    def scan(self, text: str, i: int):
        yield from _literal(json_text(self.value), text, i)

    def read(self, r: _Read) -> Any:
        return self.value


class _String:
    def __init__(self, budget: int, min_length: int, max_length: int | None):
        self.budget, self.min_length, self.max_length = budget, min_length, max_length
        self.length: int | None = None  # sized: exactly this many tokens, the closing quote pinned
        self.least = 1  # sized: the characters each of its tokens holds at least (minLength by construction)

    def size(self, value: Any, c: TokenClasses, syntax: Syntax) -> None:
        fits = isinstance(value, str) and self.min_length <= len(value)
        if fits and (self.max_length is None or len(value) <= self.max_length):
            ids = c.tokenizer.encode(value, add_special_tokens=False) if value else []
            body = c.string(syntax)[0]
            # each position holds at least `least` characters, so that n positions hold minLength
            least = -(-self.min_length // len(ids)) if ids else 0
            fits = len(ids) <= self.budget and all(t < c.vocab_size and len(c.texts[t]) >= least for t in ids)
            if fits and all(bool(body[t]) for t in ids):
                self.length, self.least = len(ids), least

    def layout(self, b: _Layout) -> None:
        b.text(b.syntax.string_open)
        body, self.close = b.classes.string(b.syntax)
        if self.length is not None:
            self.span = b.hole([body & b.classes.at_least(self.least) if self.least > 1 else body] * self.length)
            b.text(b.syntax.string_open)
            return
        # a token holds at least one character: `minLength` positions that cannot close the string
        # give at least minLength characters
        first = min(self.min_length, self.budget - 1)
        self.span = b.hole([body] * first + [body | self.close] * (self.budget - first), self.close)

    def accepts(self, value: Any) -> bool:
        if not isinstance(value, str):
            return False
        return self.min_length <= len(value) and (self.max_length is None or len(value) <= self.max_length)

    def shortest(self) -> str:
        return "a" * self.min_length

    def scan(self, text: str, i: int):
        if i == len(text):
            yield MORE
        elif text[i] == '"':
            j = i + 1
            while j < len(text) and text[j] not in '"\\' and ord(text[j]) >= 0x20:
                j += 1
            n = j - i - 1
            if self.max_length is not None and n > self.max_length:
                return
            if j == len(text):
                yield MORE
            elif text[j] == '"' and n >= self.min_length:
                yield j + 1

    def read(self, r: _Read) -> str:
        text = r.text(self.span, None if self.length is not None else self.close)
        return text if self.max_length is None else text[: self.max_length]


class _Number:
    """A number's sign is a position of its own, a minus or a blank (JSON allows whitespace before a value),
    so that the digits' first position can hold only a digit and a lone minus cannot be written.

    A non-negative integer with both bounds is written one digit per position, so its digit count holds
    by construction: at least as many digits as `minimum` has (the first not 0 when that is more than
    one), at most as many as `maximum` has."""

    def __init__(self, budget: int, signed: bool, integer: bool, digits: tuple[int, int] | None = None):
        self.budget, self.signed, self.integer, self.digits = budget, signed, integer, digits
        self.shape: tuple[bool, list[torch.Tensor]] | None = None  # sized: (negative, a mask per token)

    def size(self, value: Any, c: TokenClasses, syntax: Syntax) -> None:
        """Sized by a drafted number: its sign pinned, then per token of its digits a position for any
        token of as many digits (or the dot), so the digit count is the draft's and the digits are free."""
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return
        if (self.integer and not isinstance(value, int)) or (value < 0 and not self.signed):
            return
        low, high = self.bounds
        if (low is not None and value < low) or (high is not None and value > high):
            return  # out of bounds: the schema's layout (one digit per position keeps a digit count)
        masks = []
        for t in c.tokenizer.encode(json_text(abs(value)), add_special_tokens=False):
            text = c.texts[t] if t < c.vocab_size else ""
            if text.isascii() and text.isdecimal():
                masks.append(c.digits_of(len(text)))
            elif text == "." and not self.integer:
                masks.append(c.dot)
            else:  # an exponent, or a piece that is not digits: not sized
                return
        self.shape = (value < 0, masks)

    def layout(self, b: _Layout) -> None:
        c = b.classes
        if self.shape is not None:
            negative, masks = self.shape
            b.text("-" if negative else "")
            self.sign, self.span = None, b.hole(masks)
            return
        self.sign = b.hole([c.minus | c.blank]) if self.signed and bool(c.blank.any()) else None
        if self.digits is not None:
            fewest, most = self.digits
            first = c.nonzero_digit if fewest > 1 else c.one_digit
            masks = [first if k == 0 else c.one_digit for k in range(most)]
            masks = [m | c.after_value if k >= fewest else m for k, m in enumerate(masks)] + [c.after_value]
            self.span = b.hole(masks, c.after_value)
            return
        rest = c.digits | c.after_value if self.integer else c.digits | c.dot | c.after_value
        first = c.digits | c.minus if self.signed and self.sign is None else c.digits
        self.span = b.hole([first] + [rest] * (self.budget - 1), c.after_value)

    bounds: tuple[float | None, float | None] = (None, None)  # the inclusive range (set by `_number`)

    def accepts(self, value: Any) -> bool:
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or not (isinstance(value, int) or not self.integer):
            return False
        low, high = self.bounds
        return (low is None or value >= low) and (high is None or value <= high)

    def shortest(self) -> int | float:
        """The valid value nearest 0: a bound (inside it when exclusive), a multiple if asked."""
        (low, high), (above, below) = self.bounds, self.exclusive
        value = low if low is not None and low > 0 else (0 if high is None or high >= 0 else high)
        ends = [v for v in (low, above, high, below) if v is not None]
        middle = (min(ends) + max(ends)) / 2 if ends else 0
        nudged = [v + d for v, d in ((above, 1), (below, -1)) if v is not None]
        value = next((v for v in (value, *nudged, middle) if self.accepts_strictly(v)), value)
        return value if self.multiple is None else self._nearest_multiple(value)

    def accepts_strictly(self, value: int | float) -> bool:
        """`accepts`, the exclusive bounds excluded too."""
        above, below = self.exclusive
        return self.accepts(value) and (above is None or value > above) and (below is None or value < below)

    def scan(self, text: str, i: int):
        j = i + (text[i : i + 1] == "-")
        while j < len(text) and text[j] in "0123456789.":
            j += 1
        run = text[i:j]
        if j == len(text) and self._may_become(run):
            yield MORE
        full = r"-?(0|[1-9]\d*)" if self.integer else r"-?(0|[1-9]\d*)(\.\d+)?"
        low, high = self.bounds
        if re.fullmatch(full, run):
            value = int(run) if self.integer else float(run)  # an integer past 2**53 is not a float
            if (low is None or value >= low) and (high is None or value <= high):
                yield j

    def _may_become(self, run: str) -> bool:
        """Whether more characters can make `run` a number within the bounds."""
        part = r"-?(0|[1-9]\d*)?" if self.integer else r"-?((0|[1-9]\d*)(\.\d*)?)?"
        if not re.fullmatch(part, run):
            return False
        low, high = self.bounds
        if run.startswith("-") and low is not None and low >= 0:
            return False
        if not (self.integer and run.isdecimal() and low is not None and high is not None and low >= 0):
            return True
        d, most = int(run), len(str(int(high))) - len(run)
        widths = [0] if run == "0" else range(most + 1)
        return any(d * 10**k <= high and (d + 1) * 10**k - 1 >= low for k in widths)

    def read(self, r: _Read) -> int | float:
        if self.shape is not None:
            text = r.text(self.span, None)
            m = re.fullmatch(r"\d+" if self.integer else r"\d+(\.\d+)?", text)
            if m is None:  # a dot first or last
                raise _Invalid(f"{text!r} is not a number")
            negative = self.shape[0]
        else:
            text = r.text(self.span, r.classes.after_value)
            m = re.match(r"-?\d+" if self.integer else r"-?\d+(\.\d+)?", text)
            if m is None:  # only without a blank token in the vocabulary: a lone minus
                raise _Invalid(f"{text!r} is not a number")
            negative = self.sign is not None and r.classes.texts[r.tokens[self.sign.start]] == "-"
        number = ("-" if negative else "") + m.group(0)
        value = self._within(int(number) if self.integer or m.group(1) is None else float(number))
        return value if self.multiple is None else self._nearest_multiple(value)

    def _within(self, value: int | float) -> int | float:
        """`value` moved to the nearest bound when it lies outside them (the digits' positions are filled
        in parallel, so a digit count can hold by construction but not a range: 8199 for at most 2100),
        or to the shortest value inside when an exclusive bound is all it breaks."""
        low, high = self.bounds
        value = low if low is not None and value < low else value
        value = high if high is not None and value > high else value
        return value if self.accepts_strictly(value) else self.shortest()

    multiple: int | float | None = None  # multipleOf (set by schema._number): read as the nearest
    exclusive: tuple[float | None, float | None] = (None, None)  # a number's exclusive bounds

    def _nearest_multiple(self, value: int | float) -> int | float:
        """The multiple of `multiple` nearest `value` within the bounds. For a number, the nearest whose
        float a validator divides back to a whole number (0.3 / 0.1 is not 3 in floats: 0.2 or 0.4 is
        read instead); none near: the value as it is, for the validator to judge."""
        m, (low, high) = self.multiple, self.bounds
        k = round(value / m)
        k = max(k, math.ceil(low / m)) if low is not None else k
        k = min(k, math.floor(high / m)) if high is not None else k
        if self.integer:
            return k * m
        (above, below), digits = self.exclusive, max(0, -math.floor(math.log10(m))) + 1
        for j in sorted(range(k - 8, k + 9), key=lambda j: (abs(j - k), j)):
            for x in (round(j * m, digits), j * m):
                fits = (low is None or x >= low) and (high is None or x <= high)
                fits = fits and (above is None or x > above) and (below is None or x < below)
                if fits and math.isfinite(x) and (x / m).is_integer():
                    return x
        return value


class _Choice:
    """One of `options`. Unsized, a hole holds any option's written tokens (a shorter one followed by a
    token that ends a value). Sized by a drafted option, a hole of its length holds the options written
    in as many tokens (a string's quotes pinned around it, as the tokenizer splits them in context)."""

    def __init__(self, options: list[Any]):
        self.options = options
        self.drafted: list[Any] = []  # sized: [the drafted option]

    def size(self, value: Any, c: TokenClasses, syntax: Syntax) -> None:
        self.drafted = [o for o in self.options if type(o) is type(value) and o == value][:1]

    def layout(self, b: _Layout) -> None:
        c = b.classes
        if self.drafted:
            self._layout_sized(b)
            return
        self.written = [(o, c.tokenizer.encode(b.syntax.write(o), add_special_tokens=False)) for o in self.options]
        self.span, self.end = b.hole(self._masks(c), c.after_value), c.after_value

    def _masks(self, c: TokenClasses) -> list[torch.Tensor]:
        """Per position of the longest written option: the options' tokens there, and the tokens that end
        a value where an option is already over."""
        masks = []
        for k in range(max(len(ids) for _, ids in self.written)):
            short = any(len(ids) <= k for _, ids in self.written)
            mask = c.after_value.clone() if short else torch.zeros_like(c.after_value)
            mask[[ids[k] for _, ids in self.written if len(ids) > k]] = True
            masks.append(mask)
        return masks

    def _layout_sized(self, b: _Layout) -> None:
        c, quote = b.classes, b.syntax.string_open
        quoted = isinstance(self.drafted[0], str)

        def body(o: Any) -> list[int]:
            text = b.syntax.write(o)
            return c.tokenizer.encode(text[len(quote) : -len(quote)] if quoted else text, add_special_tokens=False)

        n = len(body(self.drafted[0]))
        same = [o for o in self.options if isinstance(o, str) == quoted]
        self.written = [(o, ids) for o in same if len(ids := body(o)) == n]
        b.text(quote if quoted else "")
        self.span, self.end = b.hole(self._masks(c)), None  # all written in n tokens: none is ever over
        b.text(quote if quoted else "")

    def accepts(self, value: Any) -> bool:
        return any(_same(o, value) for o in self.options)

    def shortest(self) -> Any:
        return min(self.options, key=lambda o: len(json_text(o)))

    def scan(self, text: str, i: int):
        for option in self.options:
            yield from _literal(json_text(option), text, i)

    def read(self, r: _Read) -> Any:
        got = r.tokens[self.span]
        for option, ids in self.written:
            if got[: len(ids)] == ids and (len(ids) == len(got) or bool(self.end[got[len(ids)]])):
                return option
        return self.written[r.score(self.span.start, [ids for _, ids in self.written])][0]


class _Union:
    """One of several schemas (anyOf, oneOf, a list of types): laid out and read as the branch a drafted
    value fits (`accepts`); with none, `decided` stays False and the model's scores choose it
    (dgemma.structured.unions), else it is the first that is not null. The answer is validated against
    the whole schema, so a branch chosen so is checked as any other value."""

    def __init__(self, branches: list[Any]):
        self.branches = branches
        self.chosen = next((i for i, b in enumerate(branches) if not _is_null(b)), 0)
        self.decided = False
        number = next((i for i, b in enumerate(branches) if isinstance(b, _Number)), None)
        if number is not None and any(isinstance(b, _String) and not b.min_length for b in branches):
            # a number or any string (Pydantic's Decimal): a number is what the client's type reads, where
            # the shortest string, "", is not
            self.chosen, self.decided = number, True

    def size(self, value: Any, c: TokenClasses, syntax: Syntax) -> None:
        fit = next((i for i, b in enumerate(self.branches) if b.accepts(value)), None)
        if fit is not None:
            self.chosen, self.decided = fit, True
            self.branches[fit].size(value, c, syntax)

    def layout(self, b: _Layout) -> None:
        self.branches[self.chosen].layout(b)

    def accepts(self, value: Any) -> bool:
        return any(b.accepts(value) for b in self.branches)

    def shortest(self) -> Any:
        return min((b.shortest() for b in self.branches), key=lambda v: len(json_text(v)))

    def scan(self, text: str, i: int):
        for branch in self.branches:
            yield from branch.scan(text, i)

    def read(self, r: _Read) -> Any:
        return self.branches[self.chosen].read(r)


MISSING = object()  # a key a drafted object does not hold (not the same as its value being null)


def _is_null(node: Any) -> bool:
    return isinstance(node, _Const) and node.value is None


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


# Every node also says which drafted values have its shape (`accepts`: its JSON type, its constant or one of
# its options, an object's keys among its own with its constants matched; what chooses a union's branch)
# and gives its shortest valid value (`shortest`: what an answer is laid out as when nothing longer fits).


def completed(node: Any, value: Any, budgets: bool = False) -> Any:
    """A drafted `value` made whole: every part it lacks, or holds with another shape, replaced by the
    shortest valid one, so that sizing by it leaves nothing at the schema's (longer) layout. With
    `budgets`, a part it lacks is the shortest only where that is a count (an array's items, a union's
    branch): an object's keys are all there and a scalar is left MISSING, at its schema budget."""
    if isinstance(node, _Union):
        fit = next((b for b in node.branches if b.accepts(value)), None)
        return node.shortest() if fit is None else completed(fit, value, budgets)
    lacking = budgets and value is MISSING
    if isinstance(node, _Object) and (isinstance(value, dict) or lacking):
        got = value if isinstance(value, dict) else {}
        return {k: completed(n, got.get(k, MISSING), budgets) for k, n in node.properties}
    if isinstance(node, _Array) and (isinstance(value, list) or lacking):
        got = value if isinstance(value, list) else []
        count = min(max(len(got), node.min_items), len(node.items))
        return [completed(n, got[i] if i < len(got) else MISSING, budgets) for i, n in enumerate(node.items[:count])]
    return value if node.accepts(value) or lacking else node.shortest()


class _Object:
    def __init__(self, properties: list[tuple[str, Any]]):
        self.properties = properties

    def layout(self, b: _Layout) -> None:
        b.text("{")
        ordered = sorted(self.properties, key=lambda p: p[0]) if b.syntax.sort_keys else self.properties
        for i, (key, node) in enumerate(ordered):
            b.text(("," if i else "") + b.syntax.key(key))
            node.layout(b)
        b.text("}")

    def size(self, value: Any, c: TokenClasses, syntax: Syntax) -> None:
        if isinstance(value, dict):
            for key, node in self.properties:
                node.size(value.get(key, MISSING), c, syntax)

    def accepts(self, value: Any) -> bool:
        if not isinstance(value, dict) or not set(value) <= {k for k, _ in self.properties}:
            return False
        fixed = [(k, n) for k, n in self.properties if k in value and isinstance(n, _Const | _Choice)]
        return all(n.accepts(value[k]) for k, n in fixed)

    def shortest(self) -> dict:
        return {k: n.shortest() for k, n in self.properties}

    def scan(self, text: str, i: int):
        parts = ["{"]
        for k, (key, node) in enumerate(self.properties):
            parts += [("," if k else "") + json_text(key) + ":", node]
        yield from _sequence([*parts, "}"], text, i)

    def read(self, r: _Read) -> dict:
        return {key: node.read(r) for key, node in self.properties}


class _Array:
    def __init__(self, items: list[Any], min_items: int):
        self.items, self.min_items = items, min_items

    def size(self, value: Any, c: TokenClasses, syntax: Syntax) -> None:
        """Sized by a drafted list: its count of items (within the bounds), each sized by its own."""
        if isinstance(value, list):
            count = min(max(len(value), self.min_items), len(self.items))
            self.items, self.min_items = self.items[:count], count
            for node, item in zip(self.items, value, strict=False):
                node.size(item, c, syntax)

    def layout(self, b: _Layout) -> None:
        c = b.classes
        b.text("[")
        self.seps: list[slice | None] = []
        for i, node in enumerate(self.items):
            if i < self.min_items:
                b.text("," if i else "")
                self.seps.append(None)
            else:  # the array may end here: a `]`, or (before the first item, blank; after one, a comma)
                more = c.comma_led if i else c.blank
                self.seps.append(b.hole([more | c.close_led]))
            node.layout(b)
        b.text("]")

    def accepts(self, value: Any) -> bool:
        return isinstance(value, list) and self.min_items <= len(value) <= len(self.items)

    def shortest(self) -> list:
        return [n.shortest() for n in self.items[: self.min_items]]

    def scan(self, text: str, i: int):
        def items(k: int, at: int):
            if k >= self.min_items:
                yield from _literal("]", text, at)
            if k < len(self.items):
                yield from _sequence([("," if k else ""), self.items[k]], text, at, then=lambda j: items(k + 1, j))

        yield from _sequence(["["], text, i, then=lambda j: items(0, j))

    def read(self, r: _Read) -> list:
        out = []
        for sep, node in zip(self.seps, self.items, strict=True):
            if sep is not None and bool(r.classes.close_led[r.tokens[sep.start]]):
                break
            out.append(node.read(r))
        return out


# The grammar of a schema's answers, for decoding left to right: a node's `scan(text, i)` yields every
# index where a value of its own that starts at i can end, and MORE if the text ends inside one (more
# characters could complete it). Only compact JSON, keys in the schema's order, strings without escapes:
# the answers the templates write.
MORE = -1


def _literal(literal: str, text: str, i: int):
    if text.startswith(literal, i):
        yield i + len(literal)
    elif literal.startswith(text[i:]):
        yield MORE


def _sequence(parts: list, text: str, i: int, then: Callable | None = None):
    """The ends of `parts` (literal texts and nodes) written one after the other from i, then `then`."""
    if not parts:
        yield from (then(i) if then is not None else [i])
        return
    head = _literal(parts[0], text, i) if isinstance(parts[0], str) else parts[0].scan(text, i)
    for j in head:
        if j == MORE:
            yield MORE
        else:
            yield from _sequence(parts[1:], text, j, then)


def grammar_state(root: Any, text: str) -> tuple[bool, bool]:
    """(whether `text` can be continued into an answer of `root`'s schema, whether it is one)."""
    ends = set(root.scan(text, 0))
    return MORE in ends, len(text) in ends
