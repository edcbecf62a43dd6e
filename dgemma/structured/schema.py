"""A JSON schema compiled into a tree of nodes (dgemma/structured/nodes.py), every keyword checked: what
is not supported is refused by name and path (docs/structured.md has the table of keywords).

`$ref` to the schema's own `$defs` / `definitions` is expanded in place; a recursive reference is
expanded at most `REF_DEPTH` times along a path, where a branch of a union or an array's items can stop
it (past that the branch is dropped, the array is empty). `anyOf`, `oneOf` and lists of types are unions
whose branch a draft's value chooses (nodes._Union); `{}` (any value) is a union of the scalar types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .formats import FORMATS, _Format
from .nodes import _Array, _Choice, _Const, _Number, _Object, _String, _Union
from .regex import REGEX_FORMATS, _Regex, regex_string
from .tokens import (
    _ANNOTATIONS,
    _KEYWORDS,
    DEFAULT_MAX_ITEMS,
    DEFAULT_STRING_TOKENS,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_STRING_TOKENS,
    StructuredOutputError,
)

MAX_VALUES = 2048  # values a schema may expand to (arrays count maxItems times): bounds compile work
SMALL_RANGE = 32  # an integer range with at most this many values is a choice among them
REF_DEPTH = 3  # expansions of one $ref along a path (a recursive model's depth)
MAX_BRANCHES = 16  # branches of one anyOf / oneOf
_DEFINITIONS = ("$defs", "definitions")
_UNIONS = ("anyOf", "oneOf")


def _refuse(path: str, message: str) -> StructuredOutputError:
    return StructuredOutputError(f"schema{path}: {message}")


class _TooDeep(StructuredOutputError):
    """A recursive $ref past REF_DEPTH: a union drops the branch, an array of such items is empty."""


@dataclass
class _Refs:
    """The root schema's definitions, and the references being expanded along the current path."""

    root: dict
    open: list[str] = field(default_factory=list)

    def resolve(self, ref: Any, path: str) -> dict:
        if not isinstance(ref, str):
            raise _refuse(path, "$ref must be a string")
        parts = ref.split("/")
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in _DEFINITIONS:
            raise _refuse(path, f"$ref {ref!r}: only references to the schema's own $defs or definitions")
        defs = self.root.get(parts[1])
        name = parts[2].replace("~1", "/").replace("~0", "~")
        if not isinstance(defs, dict) or not isinstance(defs.get(name), dict):
            raise _refuse(path, f"$ref {ref!r} names no definition")
        if self.open.count(ref) >= REF_DEPTH:
            raise _TooDeep(f"schema{path}: $ref {ref!r} recurses deeper than {REF_DEPTH} levels")
        return defs[name]


def build(schema: dict):
    """The tree of nodes of a whole schema (a fresh one each time: sizing changes it)."""
    return _node(schema, "", 0, _Refs(schema))


def expanded(schema: Any) -> int:
    """How many values `schema` lays out once references, unions and arrays are expanded (arrays to
    maxItems), computed without building them: a hostile schema would otherwise multiply before any check."""
    return _expanded(schema, 0, _Refs(schema if isinstance(schema, dict) else {}))


def _expanded(schema: Any, depth: int, refs: _Refs) -> int:
    """The count, stopped as soon as it passes MAX_VALUES: each value visited counts at least one, so the
    work is bounded too (distinct definitions that each refer to many others would otherwise multiply)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return 1
    if "$ref" in schema:
        try:
            target = refs.resolve(schema["$ref"], "")
        except StructuredOutputError:
            return 1
        refs.open.append(schema["$ref"])
        try:
            return _expanded(target, depth, refs)
        finally:
            refs.open.pop()
    props = schema.get("properties")
    inner = [b for key in _UNIONS for b in (schema.get(key) if isinstance(schema.get(key), list) else [])]
    inner = inner[: MAX_BRANCHES + 1] + (list(props.values()) if isinstance(props, dict) else [])
    total = 1
    for sub in inner:
        total += _expanded(sub, depth + 1, refs)
        if total > MAX_VALUES:
            return total
    items = schema.get("maxItems", max(DEFAULT_MAX_ITEMS, schema.get("minItems", 0) or 0))
    if "items" in schema and isinstance(items, int) and not isinstance(items, bool):
        total += min(max(items, 0), MAX_ITEMS) * _expanded(schema["items"], depth + 1, refs)
    return total


def _node(schema: Any, path: str, depth: int, refs: _Refs):
    """The node of one (sub)schema; StructuredOutputError names what is not supported, and where."""
    if not isinstance(schema, dict):
        raise _refuse(path, "must be an object")
    if depth > MAX_DEPTH:
        raise _refuse(path, f"nests deeper than {MAX_DEPTH} levels")
    if "$ref" in schema:
        return _reference(schema, path, depth, refs)
    choice = ("const" in schema or "enum" in schema) and not any(key in schema for key in _UNIONS)
    if not choice and (any(key in schema for key in _UNIONS) or isinstance(schema.get("type"), list)):
        return _union(schema, path, depth, refs)
    if "allOf" in schema:  # one schema wrapped (older Pydantic writes a described $ref so)
        parts = schema["allOf"]
        if not isinstance(parts, list) or len(parts) != 1 or set(schema) - _ANNOTATIONS - {"allOf"}:
            raise _refuse(path, "allOf is supported with one schema and nothing else beside it")
        return _node(parts[0], f"{path}.allOf.0", depth + 1, refs)
    if "const" in schema:
        return _Const(schema["const"])
    if "enum" in schema:
        options = schema["enum"]
        if not isinstance(options, list) or not options or len(options) > 64:
            raise _refuse(path, "enum must be a list of 1 to 64 values")
        return _Const(options[0]) if len(options) == 1 else _Choice(list(options))
    if not set(schema) - _ANNOTATIONS - set(_DEFINITIONS):  # `{}`: any value (LangChain writes a recursive $ref so)
        return _union({"type": ["string", "number", "boolean", "null"]}, path, depth, refs)
    kind = schema.get("type", "object" if "properties" in schema else None)
    if not isinstance(kind, str) or kind not in _KEYWORDS:
        raise _refuse(path, f"type must be one of {sorted(_KEYWORDS)} (got {kind!r})")
    unknown = set(schema) - _KEYWORDS[kind] - _ANNOTATIONS - {"type", *_DEFINITIONS}
    if unknown:
        raise _refuse(path, f"{sorted(unknown)} not supported for type {kind!r} (supported: {sorted(_KEYWORDS[kind])})")
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    build_ = {"object": _object, "array": _array, "string": _string}.get(kind)
    if build_ is None:
        return _Choice([True, False]) if kind == "boolean" else _Const(None)
    return build_(schema, path, depth, refs)


def _reference(schema: dict, path: str, depth: int, refs: _Refs):
    beside = set(schema) - _ANNOTATIONS - {"$ref", *_DEFINITIONS}
    if beside:
        raise _refuse(path, f"{sorted(beside)} beside $ref are not supported")
    target = refs.resolve(schema["$ref"], path)
    refs.open.append(schema["$ref"])
    try:
        return _node(target, f"{path}.$ref({schema['$ref']})", depth, refs)  # a reference nests nothing
    finally:
        refs.open.pop()


def _union(schema: dict, path: str, depth: int, refs: _Refs) -> Any:
    """anyOf / oneOf, or a list of types (each type with its own keywords): a _Union of the branches that
    can be built (a recursive branch past REF_DEPTH is dropped)."""
    keys = [key for key in _UNIONS if key in schema]
    if isinstance(schema.get("type"), list):
        types = schema["type"]
        if keys or not types or not all(isinstance(t, str) and t in _KEYWORDS for t in types):
            raise _refuse(path, f"type must be one of {sorted(_KEYWORDS)} or a list of them (got {types!r})")
        own = set().union(*(_KEYWORDS[t] for t in types))
        unknown = set(schema) - own - _ANNOTATIONS - {"type", *_DEFINITIONS}
        if unknown:
            raise _refuse(path, f"{sorted(unknown)} not supported for types {types}")
        branches = [{k: v for k, v in schema.items() if k in _KEYWORDS[t]} | {"type": t} for t in types]
        where = [f"{path}.type.{i}" for i in range(len(types))]
    else:
        if len(keys) != 1 or set(schema) - _ANNOTATIONS - {keys[0], *_DEFINITIONS}:
            raise _refuse(path, f"{keys[0]} is supported alone (with annotations beside it)")
        branches = schema[keys[0]]
        if not isinstance(branches, list) or not 0 < len(branches) <= MAX_BRANCHES:
            raise _refuse(path, f"{keys[0]} must be a list of 1 to {MAX_BRANCHES} schemas")
        where = [f"{path}.{keys[0]}.{i}" for i in range(len(branches))]
    nodes, deepest = [], None
    for branch, at in zip(branches, where, strict=True):
        try:
            nodes.append(_node(branch, at, depth + 1, refs))
        except _TooDeep as e:
            deepest = e
    if not nodes:
        raise deepest
    return nodes[0] if len(nodes) == 1 else _Union(nodes)


def _object(schema: dict, path: str, depth: int, refs: _Refs) -> _Object:
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise _refuse(path, "properties must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or any(k not in props for k in required):
        raise _refuse(path, "required must list keys of properties")
    if schema.get("additionalProperties", False) not in (False, True):
        raise _refuse(path, "additionalProperties must be false or true (a schema for extra keys is not supported)")
    return _Object([(k, _node(v, f"{path}.properties.{k}", depth + 1, refs)) for k, v in props.items()])


def _array(schema: dict, path: str, depth: int, refs: _Refs) -> _Array:
    low, high = schema.get("minItems", 0), schema.get("maxItems", max(DEFAULT_MAX_ITEMS, schema.get("minItems", 0)))
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (low, high)) or not 0 <= low <= high:
        raise _refuse(path, "minItems and maxItems must be integers with 0 <= minItems <= maxItems")
    if high > MAX_ITEMS:
        raise _refuse(path, f"maxItems is at most {MAX_ITEMS} here (got {high})")
    try:  # without items, any values (a union of the scalar types, as `{}`)
        items = [_node(schema.get("items", {}), f"{path}.items", depth + 1, refs) for _ in range(high)]
    except _TooDeep:
        if low:
            raise
        return _Array([], 0)  # a recursive model's last level: its lists are empty
    return _Array(items, low)


def _string(schema: dict, path: str, depth: int, refs: _Refs) -> _String | _Format | _Regex:
    high = schema.get("maxLength")
    low = schema.get("minLength", 0)
    for name, value in (("maxLength", high), ("minLength", low)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise _refuse(path, f"{name} must be a non-negative integer")
    if high is not None and high < low:
        raise _refuse(path, "maxLength is below minLength: no string has both")
    if "pattern" in schema or schema.get("format") in REGEX_FORMATS:
        if "pattern" in schema and "format" in schema:
            raise _refuse(path, "pattern and format do not go together here (one expression per string)")
        pattern = schema["pattern"] if "pattern" in schema else REGEX_FORMATS[schema["format"]][0]
        if not isinstance(pattern, str):
            raise _refuse(path, "pattern must be a string")
        if high is None and "format" in schema:
            high = REGEX_FORMATS[schema["format"]][1]
        try:
            return regex_string(pattern, low, high)
        except StructuredOutputError as e:
            raise _refuse(path, str(e)) from None
    if "format" in schema:
        name = schema["format"]
        if name not in FORMATS:
            supported = sorted([*FORMATS, *REGEX_FORMATS])
            raise _refuse(path, f"format {name!r} is not supported (supported: {supported})")
        if "minLength" in schema or "maxLength" in schema:
            raise _refuse(path, "minLength and maxLength do not go with a format (its shape fixes the length)")
        return _Format(name)
    budget = DEFAULT_STRING_TOKENS if high is None else min(high + 1, MAX_STRING_TOKENS)
    return _String(max(budget, low + 1, 1), low, high)


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
    step = schema.get("multipleOf", 1)
    if not isinstance(step, int | float) or isinstance(step, bool) or not step > 0:
        raise StructuredOutputError("schema: multipleOf must be a positive number")
    if integer and not isinstance(step, int):
        if not float(step).is_integer():
            raise StructuredOutputError("schema: an integer's multipleOf is supported as an integer")
        step = int(step)
    if integer:  # the bounds moved to multiples: every value read back is rounded to the nearest one
        low = None if low is None else math.ceil(low / step) * step
        high = None if high is None else math.floor(high / step) * step
    if integer and low is not None and high is not None:
        if low > high:
            what = "integer" if step == 1 else f"integer multiple of {step}"
            raise StructuredOutputError(f"schema: no {what} lies within the bounds")
        if (high - low) // step < SMALL_RANGE:
            return _Choice(list(range(low, high + 1, step)))
        if low >= 0:
            node = _Number(0, False, True, digits=(len(str(low)), len(str(high))))
            node.bounds, node.multiple = (low, high), (step if step > 1 else None)
            return node
    signed = low is None or low < 0
    digits = max([len(str(int(abs(v)))) for v in bounds], default=8)
    node = _Number(min(digits + 2 + (0 if integer else 6), 24), signed, integer)
    node.bounds, node.multiple = (low, high), (step if step != 1 or not integer else None)
    node.exclusive = (schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum"))
    return node
