"""Structured output: JSON that parses and validates against a schema by construction.

A left-to-right engine constrains its output with a grammar automaton, token by token. A canvas model can
lay the structure out first and denoise only the values, with the whole answer in view. `generate_json`
compiles a JSON schema into a template (dgemma.fill) and per-position allowed tokens
(dgemma.constraints), sized by a free draft of the answer (`draft_plan`):

    {"name":"<2 string tokens>","age":<1 token of 2 digits>,"tags":["<1>","<3>"],"ok":<true or false>}

- keys, punctuation and fixed literals (`const`, `null`, a one-value `enum`) are pinned, in compact JSON,
  each run of them from one value to the next (a string's closing quote included) tokenized as one
  text, so the template is split as the tokenizer splits such an answer;
- a value the draft holds with the schema's type and bounds sizes its hole: a string's n tokens are n
  positions of string tokens (no quote, backslash or control character); a number keeps its sign and,
  per token, a position for any token of as many digits (or the dot); an `enum`/`boolean` holds the
  options spelled in as many tokens as the drafted one; an array keeps its count of items;
- any other value keeps the schema's layout, where the model closes the value itself: a string's
  characters or a quote-led token, which closes it; a number's digits (a minus first, a dot inside for
  `number`) or a token that can follow a number (`,` `}` `]` or whitespace); what the hole holds after
  the closing token is dropped. A hole's length is its budget: `maxLength` + 1 for a string (at most
  `MAX_STRING_TOKENS`, `DEFAULT_STRING_TOKENS` without one), the digits `minimum` and `maximum` allow
  for a number; an array has `maxItems` slots (`DEFAULT_MAX_ITEMS` without one), the first `minItems`
  joined by pinned commas, each later one after a one-token hole that is a comma (another item) or a
  `]` (the end); `size="schema"` lays every value out so;
- a fill of an `enum` or `boolean` that spells no option is decided by the encoder's log-probability
  of each option after the JSON before it (as `choices` are scored);
- the template is followed by end-of-text pins to the end of its canvas; a template longer than a
  canvas continues in the next ones.

The values are read back from the filled holes and the JSON is written from them (`json.dumps`), so it
always parses and has the schema's shape; what a shape cannot guarantee (`minLength`, `minimum`,
`maximum`, a lone minus sign) is checked with `jsonschema`, and a failing answer is filled again with the
next seed, up to `retries` times, before `StructuredOutputError`. `generate_json_ar` is the same schema
decoded left to right under its grammar (`grammar_state`), the baseline a grammar engine gives.

Supported keywords: `type` (object, array, string, integer, number, boolean, null), `properties`,
`required`, `additionalProperties` (false or true: only the declared properties are written, all of
them), `items`, `minItems`, `maxItems`, `enum`, `const`, `minLength`, `maxLength`, `minimum`,
`maximum`, `exclusiveMinimum`, `exclusiveMaximum`, and the annotations (`title`, `description`, ...).
Anything else (`pattern`, `format`, `anyOf`, `$ref`, ...) is refused by name, never ignored. String
characters are those of whole tokens: a character the tokenizer only spells in byte pieces cannot be
written.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .constraints import Allowed
from .editing import continuation_logprobs, end_of_text_ids, fill
from .generate import GenerationResult, GenerationStats, SamplingParams, generate, prompt_rows
from .json_values import MAX_VALUE_DEPTH, first_problem
from .runtime.runner import Runner, as_runner
from .tool_calls import CALL_CLOSE, CALL_OPEN, QUOTE, write_argument, write_key

DEFAULT_STRING_TOKENS = 24
MAX_STRING_TOKENS = 128
DEFAULT_MAX_ITEMS = 4
MAX_ITEMS = 32
MAX_TEMPLATE_TOKENS = 4096  # the longest template a schema may compile to
MAX_DEPTH = 8
DEFAULT_RETRIES = 2
_ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples"}
_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "boolean": set(),
    "null": set(),
}


class StructuredOutputError(ValueError):
    """The model gave no answer that validates within the retries (or the schema cannot be compiled);
    `steps` holds the denoising steps the attempts took (0 when nothing ran)."""

    steps: int = 0


# ------------------------------------------------------------------------------------------------
# Token classes of a vocabulary


class TokenClasses:
    """Bool [V] masks of the tokens that may stand in a JSON value's positions, for one tokenizer and a
    model's vocabulary size (ids the tokenizer lacks, and special tokens, are in none)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.texts = tokenizer.token_texts[:vocab_size]
        special = tokenizer.special_ids
        self._usable = [i not in special and t != "" and "\ufffd" not in t for i, t in enumerate(self.texts)]
        self._argument_strings: tuple[torch.Tensor, torch.Tensor] | None = None
        self._digits_of: dict[int, torch.Tensor] = {}

    def usable(self, token: int) -> bool:
        """Whether `token` may stand in a value (not special, not a byte piece)."""
        return self._usable[token]

    def where(self, test: Callable[[str], bool]) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        ids = [i for i, t in enumerate(self.texts) if self._usable[i] and test(t)]
        mask[torch.tensor(ids, dtype=torch.long)] = True
        return mask

    @functools.cached_property
    def string_body(self) -> torch.Tensor:
        return self.where(lambda t: not any(c in '"\\' or ord(c) < 0x20 for c in t))

    @functools.cached_property
    def quote_led(self) -> torch.Tensor:
        return self.where(lambda t: t[0] == '"')

    def string(self, syntax: Syntax) -> tuple[torch.Tensor, torch.Tensor]:
        """A string's characters and the tokens that close it, in `syntax`: a quote-led token in JSON; in
        tool-call arguments a `<`-led token (the <|"|> quote, or its first piece), so `<` is not a character."""
        if syntax.string_open == '"':
            return self.string_body, self.quote_led
        if self._argument_strings is None:
            close = self.where(lambda t: t[0] == "<")
            quote = self.tokenizer.token_to_id(QUOTE)
            if quote is not None and quote < self.vocab_size:  # one token (special in Gemma 4's vocabulary)
                close[quote] = True
            self._argument_strings = (self.string_body & ~self.where(lambda t: "<" in t), close)
        return self._argument_strings

    @functools.cached_property
    def digits(self) -> torch.Tensor:
        return self.where(str.isdecimal) & self.where(lambda t: t.isascii())

    def digits_of(self, n: int) -> torch.Tensor:
        """The tokens of exactly `n` decimal digits."""
        if n not in self._digits_of:
            self._digits_of[n] = self.digits & self.where(lambda t: len(t) == n)
        return self._digits_of[n]

    @functools.cached_property
    def one_digit(self) -> torch.Tensor:
        return self.where(lambda t: len(t) == 1 and t in "0123456789")

    @functools.cached_property
    def nonzero_digit(self) -> torch.Tensor:
        return self.where(lambda t: len(t) == 1 and t in "123456789")

    @functools.cached_property
    def minus(self) -> torch.Tensor:
        return self.where(lambda t: t == "-")

    @functools.cached_property
    def dot(self) -> torch.Tensor:
        return self.where(lambda t: t == ".")

    @functools.cached_property
    def after_value(self) -> torch.Tensor:
        """Tokens that can follow a number or a literal: they end it."""
        return self.where(lambda t: t[0] in ",}] \n\t")

    @functools.cached_property
    def comma_led(self) -> torch.Tensor:
        return self.where(lambda t: t[0] == ",")

    @functools.cached_property
    def close_led(self) -> torch.Tensor:
        return self.where(lambda t: t[0] == "]")

    @functools.cached_property
    def blank(self) -> torch.Tensor:
        return self.where(str.isspace)


# ------------------------------------------------------------------------------------------------
# Syntaxes: JSON, and the arguments of a Gemma 4 tool call


@dataclass(frozen=True)
class Syntax:
    """How values are written: JSON, or Gemma 4's tool-call arguments (dgemma.tool_calls: bare keys in
    sorted order, strings between <|"|> quotes)."""

    name: str
    write: Callable[[Any], str]  # a literal value
    key: Callable[[str], str]  # an object's key and its colon
    string_open: str
    sort_keys: bool


JSON = Syntax("json", lambda v: json_text(v), lambda k: json_text(k) + ":", '"', False)
GEMMA_ARGUMENTS = Syntax("gemma", write_argument, lambda k: write_key(k) + ":", QUOTE, True)


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
        start = len(self.template)
        self.template += [None] * len(masks)
        self.allowed += masks
        if len(self.template) > MAX_TEMPLATE_TOKENS:
            raise StructuredOutputError(f"the schema needs more than {MAX_TEMPLATE_TOKENS} tokens of template")
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

    def scan(self, text: str, i: int):
        yield from _literal(json_text(self.value), text, i)

    def read(self, r: _Read) -> Any:
        return self.value


class _String:
    def __init__(self, budget: int, min_length: int, max_length: int | None):
        self.budget, self.min_length, self.max_length = budget, min_length, max_length
        self.length: int | None = None  # sized: exactly this many tokens, the closing quote pinned

    def size(self, value: Any, c: TokenClasses, syntax: Syntax) -> None:
        fits = isinstance(value, str) and self.min_length <= len(value)
        if fits and (self.max_length is None or len(value) <= self.max_length):
            ids = c.tokenizer.encode(value, add_special_tokens=False) if value else []
            body = c.string(syntax)[0]
            if len(ids) <= self.budget and all(t < c.vocab_size and bool(body[t]) for t in ids):
                self.length = len(ids)

    def layout(self, b: _Layout) -> None:
        b.text(b.syntax.string_open)
        body, self.close = b.classes.string(b.syntax)
        if self.length is not None:
            self.span = b.hole([body] * self.length)
            b.text(b.syntax.string_open)
            return
        # a token holds at least one character: `minLength` positions that cannot close the string
        # give at least minLength characters
        first = min(self.min_length, self.budget - 1)
        self.span = b.hole([body] * first + [body | self.close] * (self.budget - first), self.close)

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

    def scan(self, text: str, i: int):
        j = i + (text[i : i + 1] == "-")
        while j < len(text) and text[j] in "0123456789.":
            j += 1
        run = text[i:j]
        if j == len(text) and self._may_become(run):
            yield MORE
        full = r"-?(0|[1-9]\d*)" if self.integer else r"-?(0|[1-9]\d*)(\.\d+)?"
        low, high = self.bounds
        if re.fullmatch(full, run) and (low is None or float(run) >= low) and (high is None or float(run) <= high):
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
        return int(number) if self.integer or m.group(1) is None else float(number)


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

    def scan(self, text: str, i: int):
        for option in self.options:
            yield from _literal(json_text(option), text, i)

    def read(self, r: _Read) -> Any:
        got = r.tokens[self.span]
        for option, ids in self.written:
            if got[: len(ids)] == ids and (len(ids) == len(got) or bool(self.end[got[len(ids)]])):
                return option
        return self.written[r.score(self.span.start, [ids for _, ids in self.written])][0]


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
                node.size(value.get(key), c, syntax)

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


def json_text(value: Any) -> str:
    """Compact JSON, as answers and templates write it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


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


# ------------------------------------------------------------------------------------------------
# Compiling a schema


def _refuse(path: str, message: str) -> StructuredOutputError:
    return StructuredOutputError(f"schema{path}: {message}")


MAX_VALUES = 2048  # values a schema may expand to (arrays count maxItems times): bounds compile work


def _expanded(schema: Any, depth: int = 0) -> int:
    """How many values `schema` lays out once arrays are expanded to maxItems, computed without building
    them (a hostile schema of nested arrays would otherwise multiply before any check)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return 1
    props = schema.get("properties")
    inner = sum(_expanded(v, depth + 1) for v in props.values()) if isinstance(props, dict) else 0
    items = schema.get("maxItems", max(DEFAULT_MAX_ITEMS, schema.get("minItems", 0) or 0))
    if "items" in schema and isinstance(items, int) and not isinstance(items, bool):
        inner += min(max(items, 0), MAX_ITEMS) * _expanded(schema["items"], depth + 1)
    return 1 + inner


def _node(schema: Any, path: str, depth: int):
    """The node of one (sub)schema; StructuredOutputError names what is not supported, and where."""
    if not isinstance(schema, dict):
        raise _refuse(path, "must be an object")
    if depth > MAX_DEPTH:
        raise _refuse(path, f"nests deeper than {MAX_DEPTH} levels")
    if "const" in schema:
        return _Const(schema["const"])
    if "enum" in schema:
        options = schema["enum"]
        if not isinstance(options, list) or not options or len(options) > 64:
            raise _refuse(path, "enum must be a list of 1 to 64 values")
        return _Const(options[0]) if len(options) == 1 else _Choice(list(options))
    kind = schema.get("type", "object" if "properties" in schema else None)
    if not isinstance(kind, str) or kind not in _KEYWORDS:
        raise _refuse(path, f"type must be one of {sorted(_KEYWORDS)} (got {kind!r}); unions are not supported")
    unknown = set(schema) - _KEYWORDS[kind] - _ANNOTATIONS - {"type"}
    if unknown:
        raise _refuse(path, f"{sorted(unknown)} not supported for type {kind!r} (supported: {sorted(_KEYWORDS[kind])})")
    build = {"object": _object, "array": _array, "string": _string, "boolean": _boolean, "null": _null}
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    return build[kind](schema, path, depth)


def _object(schema: dict, path: str, depth: int) -> _Object:
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise _refuse(path, "properties must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or any(k not in props for k in required):
        raise _refuse(path, "required must list keys of properties")
    if schema.get("additionalProperties", False) not in (False, True):
        raise _refuse(path, "additionalProperties must be false or true (a schema for extra keys is not supported)")
    return _Object([(k, _node(v, f"{path}.properties.{k}", depth + 1)) for k, v in props.items()])


def _array(schema: dict, path: str, depth: int) -> _Array:
    low, high = schema.get("minItems", 0), schema.get("maxItems", max(DEFAULT_MAX_ITEMS, schema.get("minItems", 0)))
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (low, high)) or not 0 <= low <= high:
        raise _refuse(path, "minItems and maxItems must be integers with 0 <= minItems <= maxItems")
    if high > MAX_ITEMS:
        raise _refuse(path, f"maxItems is at most {MAX_ITEMS} here (got {high})")
    if "items" not in schema:
        raise _refuse(path, "an array needs items (the schema of its elements)")
    items = [_node(schema["items"], f"{path}.items", depth + 1) for _ in range(high)]
    return _Array(items, low)


def _string(schema: dict, path: str, depth: int) -> _String:
    high = schema.get("maxLength")
    low = schema.get("minLength", 0)
    for name, value in (("maxLength", high), ("minLength", low)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise _refuse(path, f"{name} must be a non-negative integer")
    budget = DEFAULT_STRING_TOKENS if high is None else min(high + 1, MAX_STRING_TOKENS)
    return _String(max(budget, low + 1, 1), low, high)


SMALL_RANGE = 32  # an integer range with at most this many values is a choice among them


def _number(schema: dict, integer: bool) -> _Number | _Choice:
    """An integer or number hole; a small integer range is a choice of its values (valid by construction)."""
    bounds = [schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema]
    if any(not isinstance(v, int | float) or isinstance(v, bool) for v in bounds):
        raise StructuredOutputError("schema: minimum and maximum must be numbers")
    lows = [schema["minimum"]] if "minimum" in schema else []
    highs = [schema["maximum"]] if "maximum" in schema else []
    if "exclusiveMinimum" in schema:
        lows.append(math.floor(schema["exclusiveMinimum"]) + 1 if integer else schema["exclusiveMinimum"])
    if "exclusiveMaximum" in schema:
        highs.append(math.ceil(schema["exclusiveMaximum"]) - 1 if integer else schema["exclusiveMaximum"])
    low, high = (max(lows) if lows else None), (min(highs) if highs else None)
    if integer and low is not None and high is not None:
        low, high = math.ceil(low), math.floor(high)
        if 0 <= high - low < SMALL_RANGE:
            return _Choice(list(range(low, high + 1)))
        if 0 <= low <= high:
            node = _Number(0, False, True, digits=(len(str(low)), len(str(high))))
            node.bounds = (low, high)
            return node
    signed = low is None or low < 0
    digits = max([len(str(int(abs(v)))) for v in bounds], default=8)
    node = _Number(min(digits + 2 + (0 if integer else 6), 24), signed, integer)
    node.bounds = (low, high)
    return node


def _boolean(schema: dict, path: str, depth: int) -> _Choice:
    return _Choice([True, False])


def _null(schema: dict, path: str, depth: int) -> _Const:
    return _Const(None)


@dataclass
class JsonPlan:
    """What to fill for one JSON answer and how to read it back: a schema's template with its allowed
    tokens and the tree of its values, or (no schema: any JSON object) a `{` and holes of free text."""

    schema: dict | None
    template: list[int | None]
    allowed: list[torch.Tensor | None] | None
    root: Any
    classes: TokenClasses
    validator: Any = None
    holes: list[tuple[slice, torch.Tensor | None]] = field(default_factory=list)  # each hole and what ends it
    resize: Callable[[str], JsonPlan] | None = None  # the plan sized by a free draft's text (schemas only)
    end: int | None = None  # the end-of-text token the template is padded with

    @property
    def fixed(self) -> bool:
        """Nothing to generate (a tool call without arguments): the answer is the template."""
        return all(t is not None for t in self.template)

    def pins(self, length: int | None = None) -> torch.Tensor:
        """The template as fill's pins [1, length] (-1 at the holes), padded with its end token to
        `length` (default: its own)."""
        pad = [self.end] * ((length or len(self.template)) - len(self.template))
        return torch.tensor([[-1 if t is None else t for t in self.template + pad]], dtype=torch.long)

    def constraints(self, length: int | None = None) -> Allowed | None:
        """The allowed tokens as generate's `allowed` (None for a free object), `length` long."""
        if self.allowed is None:
            return None
        pad = [None] * ((length or len(self.template)) - len(self.template))
        return Allowed.from_sets([self.allowed + pad], self.classes.vocab_size)

    def read(self, model: Runner | Any, prompt: list[int], tokens: list[int]) -> tuple[Any, str | None]:
        """The answer a fill of this plan holds and None, or None and why it is not valid (model passes,
        to score a choice: run it where the model runs)."""
        if self.schema is None:
            return first_object(self.classes.tokenizer.decode(tokens))
        runner = as_runner(model)

        def score(position: int, options: list[list[int]]) -> int:
            following = self.template[position + max(len(o) for o in options) :][:8]
            after = list(itertools.takewhile(lambda t: t is not None, following))  # the pinned run after the hole
            lp = continuation_logprobs(runner, prompt + tokens[:position], [o + after for o in options])
            return max(range(len(options)), key=lambda i: float(lp[i].sum()))

        try:
            value = self.root.read(_Read(tokens, self.classes, score))
        except _Invalid as e:
            return None, str(e)
        error = next(iter(self.validator.iter_errors(value)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            return None, error.message + (f" (at {where})" if where else "")
        return value, None


def first_object(text: str) -> tuple[Any, str | None]:
    """The JSON object `text` starts with (what follows it is dropped), or why there is none."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as e:
        return None, f"the answer is not a JSON object ({e.msg} at character {e.pos})"
    return (value, None) if isinstance(value, dict) else (None, "the answer is JSON but not an object")


def compile_schema(
    schema: dict,
    tokenizer,
    vocab_size: int,
    canvas_length: int,
    end_id: int,
    *,
    syntax: Syntax = JSON,
    wrap: tuple[str, str] = ("", ""),
    draft: Any = None,
) -> JsonPlan:
    """Check `schema` (jsonschema's own check first) and lay it out as a template (see the module
    docstring) in `syntax`, between the pinned texts `wrap`, padded with `end_id` to the end of its
    last canvas. `draft`, a value the model wrote freely, sizes each value it holds with the right type
    (`draft_plan`); the others keep their schema budgets."""
    validator = _checked(schema)
    return _laid_out(schema, validator, tokenizer, vocab_size, canvas_length, end_id, syntax, wrap, draft)


def _checked(schema: dict):
    """The validator class of a schema that jsonschema accepts, whose numbers are all finite (a NaN
    `const` would make an answer that is not JSON; an infinite bound has no layout) and that expands to a
    bounded layout."""
    import jsonschema

    problem = first_problem(schema, MAX_VALUE_DEPTH)
    if problem is not None:
        raise _refuse("." + problem[0] if problem[0] else "", problem[1])
    try:
        validator = jsonschema.validators.validator_for(schema)
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise StructuredOutputError(f"not a valid JSON schema: {e.message}") from e
    if _expanded(schema) > MAX_VALUES:
        raise StructuredOutputError(f"the schema expands to more than {MAX_VALUES} values (arrays: maxItems each)")
    return validator


def _laid_out(
    schema: dict, validator, tokenizer, vocab_size: int, canvas_length: int, end_id: int, syntax, wrap, draft
) -> JsonPlan:
    """`compile_schema` after the checks: a new tree of nodes (sizing changes them), sized and laid out."""
    root = _node(schema, "", 0)
    b = _Layout(_classes(tokenizer, vocab_size), syntax)
    root.size(draft, b.classes, syntax)
    b.text(wrap[0])
    root.layout(b)
    b.text(wrap[1])
    b.flush()
    if not any(x is None for x in b.template) and wrap == ("", ""):
        raise StructuredOutputError("the schema fixes the whole answer: there is nothing to generate")
    pad = -len(b.template) % canvas_length
    template, allowed = b.template + [end_id] * pad, b.allowed + [None] * pad
    return JsonPlan(schema, template, allowed, root, b.classes, validator(schema), b.holes, end=end_id)


def schema_plan(
    model: Runner | Any,
    tokenizer,
    schema: dict,
    *,
    syntax: Syntax = JSON,
    wrap: tuple[str, str] = ("", ""),
    read_draft: Callable[[str, dict], Any] | None = None,
) -> JsonPlan:
    """`compile_schema` for a model: its vocabulary, its canvas, its end-of-text token. The plan can be
    sized by a draft (`JsonPlan.resize`), whose value `read_draft(text, schema)` reads (default: the JSON
    object the text holds); the schema is checked once, not again for each draft."""
    m = as_runner(model).model
    args = (tokenizer, m.text_config.vocab_size, m.config.canvas_length, end_of_text_ids(m)[0], syntax, wrap)
    validator = _checked(schema)
    read = read_draft or _drafted_json
    plan = _laid_out(schema, validator, *args, None)
    plan.resize = lambda text: _laid_out(schema, validator, *args, read(text, schema))
    return plan


def _drafted_json(text: str, schema: dict) -> Any:
    """The value a free draft holds: the JSON object from its first `{`, or, when that does not parse,
    each top-level property whose `"key":` the text holds followed by a JSON value."""
    start = text.find("{")
    value, error = first_object(text[start:]) if start >= 0 else (None, "no object")
    if error is None:
        return value
    found, decoder = {}, json.JSONDecoder()
    for key in schema.get("properties", {}) if isinstance(schema.get("properties"), dict) else ():
        at = text.find(json_text(key) + ":")
        if at >= 0:
            start = at + len(json_text(key)) + 1
            start += len(text[start:]) - len(text[start:].lstrip())
            with contextlib.suppress(json.JSONDecodeError):
                found[key] = decoder.raw_decode(text, start)[0]
    return found


def _drafted_call(name: str) -> Callable[[str, dict], Any]:
    """The arguments of a free draft's first call of function `name` (None when it has none)."""
    from .tool_calls import parse_tool_calls

    def read(text: str, schema: dict) -> Any:
        return next((arguments for called, arguments in parse_tool_calls(text)[0] if called == name), None)

    return read


def tool_call_plan(model: Runner | Any, tokenizer, name: str, parameters: dict | None) -> JsonPlan:
    """A Gemma 4 tool call of function `name` whose arguments follow `parameters` (its JSON schema), laid
    out in the call syntax: `<|tool_call>call:NAME{` pinned, the arguments' values as holes, `}<tool_call|>`
    pinned (dgemma.tool_calls). Reading the plan gives the arguments."""
    schema = parameters or {"type": "object", "properties": {}}
    wrap = (f"{CALL_OPEN}call:{name}", CALL_CLOSE)
    return schema_plan(model, tokenizer, schema, syntax=GEMMA_ARGUMENTS, wrap=wrap, read_draft=_drafted_call(name))


def object_plan(tokenizer, vocab_size: int, length: int) -> JsonPlan:
    """Any JSON object (response_format json_object): a pinned `{` and `length` - 1 free positions; the
    answer is the object the text starts with."""
    opening = tokenizer.encode("{", add_special_tokens=False)
    if not 0 < len(opening) < length:
        raise StructuredOutputError(f"a JSON object needs more than {len(opening)} tokens (got {length})")
    return JsonPlan(None, opening + [None] * (length - len(opening)), None, None, _classes(tokenizer, vocab_size))


@functools.lru_cache(maxsize=8)
def _classes(tokenizer, vocab_size: int) -> TokenClasses:
    return TokenClasses(tokenizer, vocab_size)


# ------------------------------------------------------------------------------------------------
# Generating


@dataclass
class JsonResult:
    value: Any  # the answer, validated against the schema
    text: str  # its JSON text (compact)
    attempts: int  # fills run (1 + retries used)
    steps: int  # denoising steps over all attempts
    result: GenerationResult  # the last fill
    errors: list[str] = field(default_factory=list)  # why earlier attempts were drawn again


def generate_json(
    model: Runner | Any,
    prompt,
    schema: dict | None,
    params: SamplingParams | None = None,
    *,
    tokenizer,
    retries: int = DEFAULT_RETRIES,
    max_new_tokens: int | None = None,
    size: str = "draft",
    **overrides,
) -> JsonResult:
    """An answer to `prompt` (text or token ids, one row) that is JSON valid against `schema`.

    The schema is compiled into a template with constrained holes and filled (see the module docstring);
    `schema=None` asks for any JSON object, in at most `max_new_tokens` (default: the checkpoint's), as
    free text after a pinned `{`. `size="draft"` (the default) sizes the values by a free draft first
    (`draft_plan`, once), `"schema"` by the schema's bounds alone. An answer that fails is filled again
    with the next seed, up to `retries` times, then StructuredOutputError. `overrides` set
    SamplingParams fields (seed, steps, sampler, ...).
    """
    runner = as_runner(model)
    m = runner.model
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= 8:
        raise ValueError("retries must be an integer in [0, 8]")
    if size not in ("draft", "schema"):
        raise ValueError(f"size must be 'draft' or 'schema' (got {size!r})")
    rows = prompt_rows(prompt, tokenizer)
    if len(rows) != 1:
        raise ValueError("generate_json takes one prompt")
    if schema is None:
        plan = object_plan(tokenizer, m.text_config.vocab_size, max_new_tokens or m.generation_config.max_new_tokens)
    elif max_new_tokens is not None:
        raise ValueError("max_new_tokens does not apply with a schema: the schema sizes the answer")
    else:
        plan = schema_plan(runner, tokenizer, schema)
    seed = overrides.pop("seed", None if params is None else params.seed)
    errors, steps = [], 0
    if size == "draft" and plan.resize is not None:
        plan, steps = draft_plan(runner, plan, rows[0], params, tokenizer=tokenizer, seed=seed, **overrides)
    for attempt in range(retries + 1):
        s = None if seed is None else seed + attempt
        result = fill(runner, plan.template, rows[0], params, allowed=plan.allowed, seed=s, **overrides)
        steps += sum(result.stats.steps_per_canvas[0])
        value, error = plan.read(runner, rows[0], result.tokens[0])
        if error is None:
            return JsonResult(value, json_text(value), attempt + 1, steps, result, errors)
        errors.append(error)
    raise unsatisfied(retries + 1, errors[-1], steps)


def draft_plan(
    model: Runner | Any, plan: JsonPlan, prompt: list[int], params: SamplingParams | None, *, tokenizer, **overrides
) -> tuple[JsonPlan, int]:
    """`plan` sized by the model: a free answer to `prompt` (as long as the plan's template, the same
    sampling), whose values size the holes (`JsonPlan.resize`: a string of n tokens is a hole of n string
    tokens with its closing quote pinned; a number keeps its sign and digit counts; an enum holds the
    options spelled in as many tokens; an array keeps its count), so the template is tokenized as the
    model writes such an answer. Returns it and the draft's denoising steps."""
    if plan.resize is None:
        raise ValueError("only a schema's plan can be sized by a draft")
    r = generate(model, [prompt], params, max_new_tokens=len(plan.template), **overrides)
    return plan.resize(tokenizer.decode(r.tokens[0])), sum(r.stats.steps_per_canvas[0])


def unsatisfied(attempts: int, last: str, steps: int = 0) -> StructuredOutputError:
    """The error after the last attempt."""
    error = StructuredOutputError(f"no valid JSON answer in {attempts} attempts (the last: {last})")
    error.steps = steps
    return error


# ------------------------------------------------------------------------------------------------
# Choices: the answer is one of given options


MAX_OPTIONS = 64


@dataclass
class Chosen:
    index: int  # of the option chosen
    option: str | list[int]
    scores: list[float]  # per option: the encoder's log-probability of it and the end of text after it


def choose(model: Runner | Any, prompt, options: list, *, tokenizer=None, whole: bool = True) -> Chosen:
    """The option (text, with `tokenizer`, or token ids) the model most likely answers `prompt` (one row)
    with: each is scored by the encoder's summed next-token log-probability of its tokens and of the
    end-of-text token after them (so that an option is scored as the whole answer, not as the start of a
    longer one; `whole=False`: as the start of the answer, without it), all options in one batch."""
    runner = as_runner(model)
    rows = prompt_rows(prompt, tokenizer)
    if len(rows) != 1:
        raise ValueError("choose takes one prompt")
    if not isinstance(options, list) or not 0 < len(options) <= MAX_OPTIONS:
        raise ValueError(f"options must be a list of 1 to {MAX_OPTIONS} options")
    ids = [_option_ids(o, tokenizer, runner.model.text_config.vocab_size, i) for i, o in enumerate(options)]
    end = end_of_text_ids(runner.model)[:1] if whole else []
    scores = [float(lp.sum()) for lp in continuation_logprobs(runner, rows[0], [o + end for o in ids])]
    best = max(range(len(options)), key=scores.__getitem__)
    return Chosen(best, options[best], scores)


def _option_ids(option, tokenizer, vocab: int, i: int) -> list[int]:
    if isinstance(option, str):
        if tokenizer is None:
            raise ValueError("text options need a tokenizer")
        ids = tokenizer.encode(option, add_special_tokens=False)
    else:
        ids = list(option)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise ValueError(f"option {i} must be a non-empty text or a list of token ids in [0, {vocab})")
    return ids


# ------------------------------------------------------------------------------------------------
# The same schema decoded left to right (the autoregressive twin of a fill)


@torch.no_grad()
def decode_grammar(model: Runner | Any, plan: JsonPlan, prompt: list[int]) -> tuple[list[int], int, str | None]:
    """A schema's answer decoded token by token by the causal encoder, as a grammar engine does: greedy,
    each step takes the likeliest token whose text keeps the answer a prefix of a valid one
    (`grammar_state`), and the end of text once the answer is whole. The tokens are the model's own
    (a `","` that closes a string and opens the next key is one token, as in training). At most as many
    tokens as the plan's template. Returns the tokens, the forward passes, and why it failed (None)."""
    runner = as_runner(model)
    m, c = runner.model, plan.classes
    ends = set(end_of_text_ids(m))
    cache = m.new_cache(1, len(prompt) + len(plan.template) + 1)

    def feed(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], device=m.device)
        return runner.encode(ids, cache, return_logits=True).logits[0, -1].float()

    logits, out, text = feed(prompt), [], ""
    while len(out) < len(plan.template):
        for t in _likeliest_first(logits):
            if t in ends:
                if grammar_state(plan.root, text)[1]:
                    return out, len(out) + 1, None
            elif t < c.vocab_size and c.usable(t) and any(grammar_state(plan.root, text + c.texts[t])):
                break
        else:
            return out, len(out) + 1, f"no token continues {text!r} within the schema"
        out.append(t)
        text += c.texts[t]
        logits = feed([t])
    return out, len(out) + 1, f"the answer is longer than {len(plan.template)} tokens"


def _likeliest_first(logits: torch.Tensor, first: int = 64) -> Iterator[int]:
    """Token ids in order of decreasing logit: the top `first` at once (almost always enough), the whole
    vocabulary sorted only when none of them is taken."""
    top = logits.topk(min(first, logits.numel())).indices.tolist()
    yield from top
    if len(top) < logits.numel():
        seen = set(top)
        yield from (t for t in torch.argsort(logits, descending=True).tolist() if t not in seen)


def generate_json_ar(model: Runner | Any, prompt, schema: dict, *, tokenizer) -> JsonResult:
    """`generate_json`'s answer decoded left to right under the same schema (`decode_grammar`): the
    autoregressive baseline, on the same weights. Greedy, so there is nothing to retry:
    StructuredOutputError if the decoding fails or the answer does not validate. `steps` counts forward
    passes."""
    runner = as_runner(model)
    rows = prompt_rows(prompt, tokenizer)
    if len(rows) != 1:
        raise ValueError("generate_json_ar takes one prompt")
    plan = schema_plan(runner, tokenizer, schema)
    t0 = time.perf_counter()
    tokens, forwards, error = decode_grammar(runner, plan, rows[0])
    if error is None:
        value = json.loads(tokenizer.decode(tokens))
        error = next((e.message for e in plan.validator.iter_errors(value)), None)
    if error is not None:
        raise unsatisfied(1, error, forwards)
    elapsed = time.perf_counter() - t0
    stats = GenerationStats(
        canvases=1,
        steps_per_canvas=[[]],
        converged_per_canvas=[[True]],
        decoder_forward_passes=[forwards],
        tokens_per_forward=[len(tokens) / forwards],
        time_to_first_token=None,
        elapsed=elapsed,
        tokens_per_second=len(tokens) / elapsed if elapsed > 0 else 0.0,
        prompt_tokens=[len(rows[0])],
    )
    result = GenerationResult([tokens], ["stop"], torch.tensor([tokens]), stats)
    return JsonResult(value, json_text(value), 1, forwards, result)
