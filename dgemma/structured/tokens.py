"""Limits, the error, and the token classes a vocabulary splits into for JSON and tool-call syntax."""

from __future__ import annotations

import contextlib
import functools
import json
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
