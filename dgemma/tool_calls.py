"""Gemma 4's tool-call protocol, as its published chat template writes it: reading calls out of an
answer, and the arguments' syntax.

A call is `<|tool_call>call:NAME{key:value,...}<tool_call|>`. Keys are bare (or between `<|"|>`
quotes), strings sit between `<|"|>` quotes, numbers, `true`/`false`/`null`, `[lists]` and `{objects}`
are written as they are; plain JSON is read too. `parse_tool_calls` reads every call of an answer, or
none: when one call does not parse, the answer is text (a caller never sees half a call).
dgemma/templates/gemma4_chat.jinja writes the same syntax (declarations, calls, responses), and
dgemma/structured/ lays out arguments in it when a call is made by construction.
"""

from __future__ import annotations

import json
import re
from typing import Any

QUOTE = '<|"|>'
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
FUNCTION_NAME = r"[A-Za-z_][A-Za-z0-9_.\-]*"  # a function's name, and a key written bare
_NAME = re.compile(rf"\s*call:({FUNCTION_NAME})")
_KEY = re.compile(FUNCTION_NAME)
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None}
MAX_NESTING = 64


class Unparsed(ValueError):
    """Text that is not a value of the tool-call syntax."""


class _Reader:
    """A recursive-descent reader of one value of the arguments' syntax."""

    def __init__(self, text: str, at: int):
        self.text, self.at = text, at

    def skip(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def expect(self, token: str) -> None:
        self.skip()
        if not self.text.startswith(token, self.at):
            raise Unparsed(f"expected {token!r} at character {self.at}")
        self.at += len(token)

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_NESTING:
            raise Unparsed("nested too deeply")
        self.skip()
        rest = self.text[self.at :]
        if rest.startswith(QUOTE):
            end = self.text.find(QUOTE, self.at + len(QUOTE))
            if end < 0:
                raise Unparsed("a string does not close")
            value, self.at = self.text[self.at + len(QUOTE) : end], end + len(QUOTE)
            return value
        if rest.startswith('"'):
            try:
                value, self.at = json.JSONDecoder().raw_decode(self.text, self.at)
            except json.JSONDecodeError as e:
                raise Unparsed(str(e)) from None
            return value
        if rest.startswith("{"):
            return self.mapping(depth)
        if rest.startswith("["):
            return self._list(depth)
        for word, value in _LITERALS.items():
            if rest.startswith(word):
                self.at += len(word)
                return value
        m = _NUMBER.match(rest)
        if m is None:
            raise Unparsed(f"no value at character {self.at}")
        self.at += m.end()
        return json.loads(m.group(0))

    def _key(self) -> str:
        self.skip()
        if self.text.startswith((QUOTE, '"'), self.at):
            key = self.value()
            if not isinstance(key, str):
                raise Unparsed("a key must be a string")
            return key
        m = _KEY.match(self.text, self.at)
        if m is None:
            raise Unparsed(f"no key at character {self.at}")
        self.at = m.end()
        return m.group(0)

    def mapping(self, depth: int) -> dict:
        self.expect("{")
        out: dict = {}
        self.skip()
        if self.text.startswith("}", self.at):
            self.at += 1
            return out
        while True:
            key = self._key()
            self.expect(":")
            out[key] = self.value(depth + 1)
            self.skip()
            if self.text.startswith("}", self.at):
                self.at += 1
                return out
            self.expect(",")

    def _list(self, depth: int) -> list:
        self.expect("[")
        out: list = []
        self.skip()
        if self.text.startswith("]", self.at):
            self.at += 1
            return out
        while True:
            out.append(self.value(depth + 1))
            self.skip()
            if self.text.startswith("]", self.at):
                self.at += 1
                return out
            self.expect(",")


def parse_arguments(text: str) -> dict:
    """The arguments object `text` holds, all of it; Unparsed if it is not one."""
    reader = _Reader(text, 0)
    value = reader.mapping(0) if text.lstrip().startswith("{") else None
    reader.skip()
    if not isinstance(value, dict) or reader.at != len(text):
        raise Unparsed("the arguments are not one {...} object")
    return value


def parse_tool_calls(text: str) -> tuple[list[tuple[str, dict]], str]:
    """Every call in `text` as (name, arguments) and the text around them (stripped); ([], text) when
    there is none, or when any call does not parse (then the whole answer is text)."""
    calls, kept, at = [], [], 0
    while (start := text.find(CALL_OPEN, at)) >= 0:
        kept.append(text[at:start])
        name = _NAME.match(text, start + len(CALL_OPEN))
        if name is None:
            return [], text
        reader = _Reader(text, name.end())
        try:
            arguments = reader.mapping(0)
            reader.expect(CALL_CLOSE)
        except Unparsed:
            return [], text
        calls.append((name.group(1), arguments))
        at = reader.at
    if not calls:
        return [], text
    kept.append(text[at:])
    return calls, "".join(kept).strip()


def write_argument(value: Any) -> str:
    """A value in the arguments' syntax (what the chat template's `argument` macro writes): objects with
    their keys in sorted order, bare where the reader takes them bare (`write_key`)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{write_key(k)}:{write_argument(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(write_argument(v) for v in value) + "]"
    return json.dumps(value)


def write_key(key: str) -> str:
    """An object's key: bare when the reader takes it bare, else between <|"|> quotes."""
    return key if _KEY.fullmatch(key) else QUOTE + key + QUOTE


def call_text(name: str, arguments: dict) -> str:
    """One call as a model turn writes it: `<|tool_call>call:NAME{...}<tool_call|>`."""
    return f"{CALL_OPEN}call:{name}{write_argument(arguments)}{CALL_CLOSE}"
