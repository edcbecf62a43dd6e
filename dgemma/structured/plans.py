"""Compiling a schema (or a tool's parameters) into a JsonPlan: the template, the allowed tokens, the reader."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..editing import end_of_text_ids
from ..generate import GenerationResult
from ..json_values import MAX_VALUE_DEPTH, first_problem
from ..runtime.runner import Runner, as_runner
from ..tool_calls import CALL_CLOSE, CALL_OPEN, parse_tool_calls
from .nodes import (
    _Array,
    _Choice,
    _Const,
    _Invalid,
    _Layout,
    _Number,
    _Object,
    _Read,
    _String,
    json_text,
)
from .tokens import (
    _ANNOTATIONS,
    _KEYWORDS,
    DEFAULT_MAX_ITEMS,
    DEFAULT_STRING_TOKENS,
    GEMMA_ARGUMENTS,
    JSON,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_STRING_TOKENS,
    StructuredOutputError,
    Syntax,
    TokenClasses,
)

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

    def read(self, tokens: list[int], score: Callable[[int, list[list[int]]], int]) -> tuple[Any, str | None]:
        """The answer a fill of this plan holds and None, or None and why it is not valid. Where a hole
        holds one of several options spelled alike, `score(position, options)` says which (the index of
        the likeliest; `score_request` says what to score; dgemma.programs.read_json asks the model)."""
        if self.schema is None:
            return first_object(self.classes.tokenizer.decode(tokens))
        try:
            value = self.root.read(_Read(tokens, self.classes, score))
        except _Invalid as e:
            return None, str(e)
        error = next(iter(self.validator.iter_errors(value)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            return None, error.message + (f" (at {where})" if where else "")
        return value, None

    def score_request(
        self, prompt: list[int], tokens: list[int], position: int, options: list[list[int]]
    ) -> tuple[list[int], list[list[int]]]:
        """What to score to choose among `options` at `position`: the prompt and the answer before it, then
        each option followed by the pinned run after the hole (up to 8 tokens)."""
        following = self.template[position + max(len(o) for o in options) :][:8]
        after = list(itertools.takewhile(lambda t: t is not None, following))
        return prompt + tokens[:position], [o + after for o in options]


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


@dataclass
class JsonResult:
    value: Any  # the answer, validated against the schema
    text: str  # its text: compact JSON (or, for a tool call, the call)
    attempts: int  # fills run (1 + retries used)
    steps: int  # denoising steps over all attempts (and the sizing draft)
    result: GenerationResult  # the last fill
    errors: list[str] = field(default_factory=list)  # why earlier attempts were drawn again


def unsatisfied(attempts: int, last: str, steps: int = 0) -> StructuredOutputError:
    """The error after the last attempt."""
    error = StructuredOutputError(f"no valid JSON answer in {attempts} attempts (the last: {last})")
    error.steps = steps
    return error
