"""JSON that a client wrote, read with bounds: the request body, and JSON text inside it (a replayed tool
call's `arguments`).

Python's `json.loads` reads `NaN`, `Infinity` and `1e400` (as inf), builds integers of any length (and
raises ValueError past 4300 digits), and recurses once per level of nesting. Each of those once reached
code that could not take it (a schema bound of inf, an answer "valid by construction" holding NaN, a chat
template's recursive macros). Here every number must be finite as a double, nesting is bounded, and what
breaks a rule is reported with the path of the value that breaks it (`tools.0.function.parameters...`),
so that the server answers a 400 naming the field.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

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


def depth(value: Any) -> int:
    """How deeply lists and dicts nest in `value` (iteratively; a scalar is 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (item.values() if isinstance(item, dict) else item))
    return deepest


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
