"""A JSON schema compiled into a tree of nodes (dgemma/structured/nodes.py), every keyword checked: what
is not supported is refused by name and path (docs/structured.md has the table of keywords).

`$ref` to a place in the schema itself (`#`, `#/$defs/Name`, any JSON pointer) is expanded in place; a
recursive reference is expanded at most `REF_DEPTH` times along a path (fewer when the expansion would
pass MAX_VALUES: `ref_depth`), and past that, or past MAX_DEPTH levels of objects and arrays, a branch
of a union or an array's items stops it (the branch is dropped, the array is empty). `anyOf`, `oneOf`
and lists of types are unions whose branch a draft's value chooses (nodes._Union); `{}` (any value) is
a union of an object and the scalar types, and a union's `{}` branch or an array of `{}` items (what a
client writes for a recursive reference it did not expand) stops there too.
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
    MAX_TEMPLATE_TOKENS,
    StructuredOutputError,
    Syntax,
    check_deadline,
)

MAX_VALUES = 2048  # values a schema may expand to (arrays count maxItems times): bounds compile work
SMALL_RANGE = 32  # an integer range with at most this many values is a choice among them
REF_DEPTH = 3  # expansions of one $ref along a path (a recursive model's depth)
MAX_REFS = 64  # references open along one path (a chain of definitions each naming the next)
MAX_BRANCHES = 16  # branches of one anyOf / oneOf
MIN_MULTIPLE = 1e-12  # a number's multipleOf: a value over it stays a finite float within a hole's digits
MAX_MIN_LENGTH = 4 * MAX_TEMPLATE_TOKENS  # minLength: more characters than any template holds
_DEFINITIONS = ("$defs", "definitions")
_UNIONS = ("anyOf", "oneOf")


def _refuse(path: str, message: str) -> StructuredOutputError:
    return StructuredOutputError(f"schema{path}: {message}")


class _TooDeep(StructuredOutputError):
    """A recursive $ref past its depth, or a value past MAX_DEPTH: a union drops the branch, an array of
    such items is empty (elsewhere, the schema is refused)."""


@dataclass
class _Refs:
    """The root schema, the references being expanded along the current path, and how many times one
    reference may be open along it."""

    root: dict
    limit: int = REF_DEPTH
    items: int = DEFAULT_MAX_ITEMS  # the items of an array without maxItems
    open: list[str] = field(default_factory=list)

    def resolve(self, ref: Any, path: str) -> dict:
        """The schema `ref` (a JSON pointer into the root: `#`, `#/$defs/Name`, ...) names."""
        if not isinstance(ref, str):
            raise _refuse(path, "$ref must be a string")
        if ref != "#" and not ref.startswith("#/"):
            raise _refuse(path, f"$ref {ref!r}: only references to the schema's own parts ('#' or '#/...')")
        target: Any = self.root
        for part in ref.split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdecimal() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise _refuse(path, f"$ref {ref!r} names no definition in the schema")
        if not isinstance(target, dict):
            raise _refuse(path, f"$ref {ref!r} names no schema object")
        if len(self.open) >= MAX_REFS:
            raise _refuse(path, f"references chain through more than {MAX_REFS} definitions")
        if self.open.count(ref) >= self.limit:
            raise _TooDeep(f"schema{path}: $ref {ref!r} recurses deeper than {self.limit} levels")
        return target


def ref_depth(schema: dict) -> int:
    """How many times a recursive reference is expanded along a path: REF_DEPTH, or fewer where the
    schema would expand to more than MAX_VALUES values (a recursive model is answered as deep as the
    budget allows)."""
    for limit in range(REF_DEPTH, 1, -1):
        if expanded(schema, limit) <= MAX_VALUES:
            return limit
    return 1


def build(schema: dict, limit: int = REF_DEPTH, items: int = DEFAULT_MAX_ITEMS):
    """The tree of nodes of a whole schema (a fresh one each time: sizing changes it), each recursive
    reference expanded at most `limit` times along a path, an array without maxItems laid out with `items`."""
    return _node(schema, "", 0, _Refs(schema, limit, items))


def expanded(schema: Any, limit: int = REF_DEPTH) -> int:
    """How many values `schema` lays out once references, unions and arrays are expanded (arrays to
    maxItems), computed without building them: a hostile schema would otherwise multiply before any check."""
    return _expanded(schema, 0, _Refs(schema if isinstance(schema, dict) else {}, limit))


def _expanded(schema: Any, depth: int, refs: _Refs) -> int:
    """The count, stopped as soon as it passes MAX_VALUES: each value visited counts at least one, so the
    work is bounded too (distinct definitions that each refer to many others would otherwise multiply).
    It follows what `_node` follows: references, unions, allOf, properties and items."""
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
    wrapped = [b for key in (*_UNIONS, "allOf") for b in (schema.get(key) if isinstance(schema.get(key), list) else [])]
    props = schema.get("properties")
    nested = list(props.values()) if isinstance(props, dict) else []
    total = 1
    for sub, deeper in [(b, 0) for b in wrapped[: MAX_BRANCHES + 1]] + [(p, 1) for p in nested]:
        total += _expanded(sub, depth + deeper, refs)
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
    check_deadline()
    if depth > MAX_DEPTH:  # objects and arrays: a union's branch or an array's items may stop here
        raise _TooDeep(f"schema{path}: nests deeper than {MAX_DEPTH} levels of objects and arrays")
    if "$ref" in schema:
        return _reference(schema, path, depth, refs)
    choice = ("const" in schema or "enum" in schema) and not any(key in schema for key in _UNIONS)
    if not choice and (any(key in schema for key in _UNIONS) or isinstance(schema.get("type"), list)):
        return _union(schema, path, depth, refs)
    if "allOf" in schema:  # one schema wrapped (older Pydantic writes a described $ref so)
        parts = schema["allOf"]
        if not isinstance(parts, list) or len(parts) != 1 or set(schema) - _ANNOTATIONS - {"allOf"}:
            raise _refuse(path, "allOf is supported with one schema and nothing else beside it")
        return _node(parts[0], f"{path}.allOf.0", depth, refs)
    if "const" in schema:
        return _Const(schema["const"])
    if "enum" in schema:
        options = schema["enum"]
        if not isinstance(options, list) or not options or len(options) > 64:
            raise _refuse(path, "enum must be a list of 1 to 64 values")
        return _Const(options[0]) if len(options) == 1 else _Choice(list(options))
    if _any_value(schema):  # `{}`: an object first (LangChain writes a recursive $ref so), or a scalar
        return _union({"type": ["object", "string", "number", "boolean", "null"]}, path, depth, refs)
    kind = schema.get("type", "object" if "properties" in schema else None)
    if not isinstance(kind, str) or kind not in _KEYWORDS:
        raise _refuse(path, f"type must be one of {sorted(_KEYWORDS)} (got {kind!r})")
    unknown = set(schema) - _KEYWORDS[kind] - _ANNOTATIONS - {"type", *_DEFINITIONS}
    if unknown:
        raise _refuse(path, f"{sorted(unknown)} not supported for type {kind!r} (supported: {sorted(_KEYWORDS[kind])})")
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer", path)
    build_ = {"object": _object, "array": _array, "string": _string}.get(kind)
    if build_ is None:
        return _Choice([True, False]) if kind == "boolean" else _Const(None)
    return build_(schema, path, depth, refs)


def _any_value(schema: Any) -> bool:
    """Whether `schema` allows any value (`{}`, or annotations alone)."""
    return isinstance(schema, dict) and not set(schema) - _ANNOTATIONS - set(_DEFINITIONS)


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
    if len(branches) > 1 and not all(_any_value(b) for b in branches):  # `{}` beside others: a stop
        kept = [(b, at) for b, at in zip(branches, where, strict=True) if not _any_value(b)]
        branches, where = [b for b, _ in kept], [at for _, at in kept]
    nodes, deepest = [], None
    for branch, at in zip(branches, where, strict=True):
        try:
            nodes.append(_node(branch, at, depth, refs))
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
    low, high = schema.get("minItems", 0), schema.get("maxItems", max(refs.items, schema.get("minItems", 0)))
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (low, high)) or not 0 <= low <= high:
        raise _refuse(path, "minItems and maxItems must be integers with 0 <= minItems <= maxItems")
    if high > MAX_ITEMS:
        raise _refuse(path, f"maxItems is at most {MAX_ITEMS} here (got {high})")
    if "items" in schema and _any_value(schema["items"]) and not low:
        return _Array([], 0)  # items of any value: what a client writes for a recursive reference, a stop
    try:  # without items, any values (a union of an object and the scalar types, as `{}`)
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
    if low > MAX_MIN_LENGTH:
        raise _refuse(path, f"minLength is at most {MAX_MIN_LENGTH} here (got {low})")
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


def _number(schema: dict, integer: bool, path: str = "") -> _Number | _Choice | _Const:
    """An integer or number hole; a small integer range is a choice of its values, a range of one value
    that value, an empty range refused: every answer within the bounds by construction (what is read
    outside them is read as the nearest value inside, `_Number.read`)."""
    bounds = {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema}
    if any(not isinstance(v, int | float) or isinstance(v, bool) for v in bounds.values()):
        raise _refuse(path, "minimum and maximum must be numbers")
    step = schema.get("multipleOf", 1)
    if not isinstance(step, int | float) or isinstance(step, bool) or not step > 0:
        raise _refuse(path, "multipleOf must be a positive number")
    if integer:
        return _integer(bounds, step, path)
    if step < MIN_MULTIPLE:
        raise _refuse(path, f"multipleOf is at least {MIN_MULTIPLE} here (got {step})")
    low, high = _edge(bounds, "minimum", "exclusiveMinimum", max), _edge(bounds, "maximum", "exclusiveMaximum", min)
    if low is not None and high is not None:
        empty = low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))
        if "multipleOf" in schema:  # the multiples of step within the bounds, by their index
            first = math.floor(low[0] / step) + 1 if low[1] else math.ceil(low[0] / step)
            last = math.ceil(high[0] / step) - 1 if high[1] else math.floor(high[0] / step)
            empty = empty or first > last
        if empty:
            multiple = f" and is a multiple of {step}" if "multipleOf" in schema else ""
            raise _refuse(path, f"no number lies within the bounds{multiple}")
        if low[0] == high[0]:
            return _Const(low[0])
    signed = low is None or low[0] < 0
    digits = max([len(str(int(abs(v)))) for v in bounds.values()], default=8)
    node = _Number(min(digits + 8, 24), signed, False)
    node.bounds = (low and low[0], high and high[0])
    node.multiple = step if "multipleOf" in schema else None
    node.exclusive = (low[0] if low and low[1] else None, high[0] if high and high[1] else None)
    return node


def _edge(bounds: dict, inclusive: str, exclusive: str, pick) -> tuple[float, bool] | None:
    """The tighter of a number's inclusive and exclusive bound on one side: (value, whether exclusive)."""
    sides = [(bounds[inclusive], False)] if inclusive in bounds else []
    sides += [(bounds[exclusive], True)] if exclusive in bounds else []
    if not sides:
        return None
    best = pick(v for v, _ in sides)
    return best, any(exclusive and v == best for v, exclusive in sides)


def _integer(bounds: dict, step: int | float, path: str) -> _Number | _Choice | _Const:
    """An integer hole: the bounds moved inward to whole multiples of `step`, in exact integer arithmetic
    (a bound past 2**53 is not a float)."""
    if not isinstance(step, int):
        if not float(step).is_integer():
            raise _refuse(path, "an integer's multipleOf is supported as an integer")
        step = int(step)
    lows = [math.ceil(bounds["minimum"])] if "minimum" in bounds else []
    highs = [math.floor(bounds["maximum"])] if "maximum" in bounds else []
    lows += [math.floor(bounds["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in bounds else []
    highs += [math.ceil(bounds["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in bounds else []
    low = -(-max(lows) // step) * step if lows else None
    high = min(highs) // step * step if highs else None
    if low is not None and high is not None:
        if low > high:
            what = "integer" if step == 1 else f"integer multiple of {step}"
            raise _refuse(path, f"no {what} lies within the bounds")
        if (high - low) // step < SMALL_RANGE:
            values = list(range(low, high + 1, step))
            return _Const(values[0]) if len(values) == 1 else _Choice(values)
        if low >= 0:
            node = _Number(0, False, True, digits=(len(str(low)), len(str(high))))
            node.bounds, node.multiple = (low, high), (step if step > 1 else None)
            return node
    digits = max([len(str(abs(v))) for v in (low, high) if v is not None], default=8)
    node = _Number(min(digits + 2, 24), low is None or low < 0, True)
    node.bounds, node.multiple = (low, high), (step if step > 1 else None)
    return node


# ------------------------------------------------------------------------------------------------
# Unions: Choosing a union's branch by the model's scores where no draft chose it (`size="schema"`, or a draft


Path = tuple[Any, ...]


def apply(node: Any, branches: dict[Path, int], path: Path = ()) -> list[tuple[Path, _Union]]:
    """Set each union at a path in `branches` that its draft left open to that branch; the open unions
    left, outermost first (not those inside another open one)."""
    if isinstance(node, _Union):
        if not node.decided and path in branches:
            node.chosen, node.decided = branches[path], True
        if not node.decided:
            return [(path, node)]
        return apply(node.branches[node.chosen], branches, (*path, node.chosen))
    if isinstance(node, _Object):
        return [u for key, n in node.properties for u in apply(n, branches, (*path, key))]
    if isinstance(node, _Array):
        return [u for i, n in enumerate(node.items) for u in apply(n, branches, (*path, i))]
    return []


def written(node: Any, syntax: Syntax, target: Path | None = None, path: Path = ()) -> tuple[str, bool]:
    """The text of `node`'s shortest value as its template writes it (its chosen branches, keys in the
    syntax's order), up to the value at `target` when that is inside it (then True)."""
    if path == target:
        return "", True
    if isinstance(node, _Union):
        return written(node.branches[node.chosen], syntax, target, (*path, node.chosen))
    if isinstance(node, _Object):
        out = "{"
        ordered = sorted(node.properties, key=lambda p: p[0]) if syntax.sort_keys else node.properties
        for i, (key, n) in enumerate(ordered):
            text, found = written(n, syntax, target, (*path, key))
            out += ("," if i else "") + syntax.key(key) + text
            if found:
                return out, True
        return out + "}", False
    if isinstance(node, _Array):
        out, whole = "[", ""
        for i, n in enumerate(node.items):
            text, found = written(n, syntax, target, (*path, i))
            out += ("," if i else "") + text
            if found:
                return out, True
            whole = out if i + 1 == node.min_items else whole
        return (whole or "[") + "]", False
    return syntax.write(node.shortest()), False


def parting(options: list[list[int]]) -> list[list[int]]:
    """Each option's tokens up to and including its first token that some other option does not have at
    the same place (all of it when another option starts with it)."""

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    cuts = [max((common(a, b) for j, b in enumerate(options) if j != i), default=0) for i, a in enumerate(options)]
    return [a[: min(len(a), cut + 1)] for a, cut in zip(options, cuts, strict=True)]
