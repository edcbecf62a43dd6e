"""The leaf of structured output: JSON values a client wrote, read with bounds (a request body, a schema, a
call's arguments), the limits, the error, and the token classes a vocabulary splits into for JSON and
tool-call syntax."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..tool_calls import QUOTE, write_argument, write_key

DEFAULT_STRING_TOKENS = 24
MAX_STRING_TOKENS = 128
DEFAULT_MAX_ITEMS = 4
MAX_ITEMS = 32
MAX_TEMPLATE_TOKENS = 4096  # the longest template a schema may compile to
MAX_DEPTH = 10  # levels of objects and arrays (OpenAI strict mode allows 10 of nesting)
DEFAULT_RETRIES = 2
_ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples"}
_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength", "format", "pattern"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "boolean": set(),
    "null": set(),
}


def json_text(value: Any) -> str:
    """Compact JSON, as answers and templates write it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class StructuredOutputError(ValueError):
    """The model gave no answer that validates within the retries (or the schema cannot be compiled);
    `steps` holds the denoising steps the attempts took (0 when nothing ran)."""

    steps: int = 0


MAX_COMPILE_SECONDS = 5.0  # one schema's compile (or one draft's layout): past it, a 400
_DEADLINE = threading.local()


@contextlib.contextmanager
def compile_deadline(seconds: float = MAX_COMPILE_SECONDS):
    """Bound the compile work of the current thread (an enclosing deadline stands)."""
    previous = getattr(_DEADLINE, "at", None)
    _DEADLINE.at = time.monotonic() + seconds if previous is None else previous
    try:
        yield
    finally:
        _DEADLINE.at = previous


def check_deadline() -> None:
    """A StructuredOutputError once the current compile has run past its deadline (called per node,
    per hole and per automaton state: what a schema's size multiplies)."""
    at = getattr(_DEADLINE, "at", None)
    if at is not None and time.monotonic() > at:
        raise StructuredOutputError(f"the schema takes more than {MAX_COMPILE_SECONDS:g} s to compile here")


class TemplateTooLong(StructuredOutputError):
    """A layout past MAX_TEMPLATE_TOKENS (a recursive schema is laid out shallower instead)."""


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
        self._at_least: dict[int, torch.Tensor] = {}

    def usable(self, token: int) -> bool:
        """Whether `token` may stand in a value (not special, not a byte piece)."""
        return self._usable[token]

    def where(self, test: Callable[[str], bool]) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        ids = [i for i, t in enumerate(self.texts) if self._usable[i] and test(t)]
        mask[torch.tensor(ids, dtype=torch.long)] = True
        return mask

    @functools.cached_property
    def single_chars(self) -> dict[str, int]:
        """The token of each character that has one of its own (a string's characters: no quote,
        backslash or control character)."""
        found: dict[str, int] = {}
        for i, t in enumerate(self.texts):
            if len(t) == 1 and self._usable[i] and t not in '"\\' and ord(t) >= 0x20:
                found.setdefault(t, i)
        return found

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

    def at_least(self, n: int) -> torch.Tensor:
        """The tokens of at least `n` characters."""
        if n not in self._at_least:
            self._at_least[n] = self.where(lambda t: len(t) >= n)
        return self._at_least[n]

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
# JSON a client wrote, read with bounds (a request body, a call's `arguments`). Python's `json.loads` reads
# NaN, Infinity and 1e400, builds integers of any length and recurses once per level; here every number is
# finite as a double, nesting is bounded, and a break is reported with its path, so a server names the field.

MAX_BODY_DEPTH = 48  # a request body's nesting: a 32-level schema or tool argument sits 4-7 levels down
MAX_VALUE_DEPTH = 32  # nesting of one free-form value (a schema, a tool's parameters, a call's arguments)
_MAX_INT_DIGITS = len(str(int(sys.float_info.max)))  # 309: longer integers are not finite as doubles


class JsonRefused(ValueError):
    """JSON that breaks a bound; `path` is where (dotted keys and indices, "" for the whole value)."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.reason = path, message


class _Unsafe(str):
    """A number literal that is not finite as a double, kept as its text until its path is known."""


def _float(text: str) -> float | _Unsafe:
    value = float(text)
    return value if math.isfinite(value) else _Unsafe(text)


def _int(text: str) -> int | _Unsafe:
    digits = text.lstrip("-")
    if len(digits) > _MAX_INT_DIGITS or (len(digits) == _MAX_INT_DIGITS and abs(int(text)) > sys.float_info.max):
        return _Unsafe(text if len(text) <= 24 else f"{text[:20]}... ({len(digits)} digits)")
    return int(text)


def loads(text: str | bytes, max_depth: int) -> Any:
    """`text` parsed as JSON, every number finite as a double and nesting at most `max_depth` deep.

    json.JSONDecodeError for text that is not JSON; JsonRefused (naming the path) for JSON that breaks a
    bound."""
    try:
        value = json.loads(text, parse_float=_float, parse_int=_int, parse_constant=_Unsafe)
    except RecursionError:
        raise JsonRefused("", f"nests deeper than {max_depth} levels") from None
    problem = first_problem(value, max_depth)
    if problem is not None:
        raise JsonRefused(*problem)
    return value


def first_problem(value: Any, max_depth: int) -> tuple[str, str] | None:
    """(path, what is wrong) of the first value in `value` that nests deeper than `max_depth` or is a
    number that is not finite (a float inf or nan, or a literal `loads` kept as text); None if all is
    well. Iterative, so that a hostile depth cannot recurse."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, _Unsafe) or (isinstance(item, float) and not math.isfinite(item)):
            return _dotted(path), f"{str(item)!r} is not a finite number (JSON numbers here must fit a double)"
        if isinstance(item, dict | list):
            if depth > max_depth:
                return _dotted(path), f"nests deeper than {max_depth} levels"
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((child, (*path, key), depth + 1) for key, child in reversed(list(pairs)))
    return None


def _dotted(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def check_body(body: bytes) -> JsonRefused | None:
    """Why a JSON request body breaks a bound (JsonRefused, with the path), or None. Text that is not
    JSON at all is left to the request parser, which says so."""
    try:
        loads(body, MAX_BODY_DEPTH)
    except JsonRefused as e:
        return e
    except ValueError:  # not JSON (JSONDecodeError is a ValueError)
        return None
    return None
