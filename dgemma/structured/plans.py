"""Compiling a schema (or a tool's parameters) into a JsonPlan: the template, the allowed tokens, the reader."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..tool_calls import CALL_CLOSE, CALL_OPEN, QUOTE, parse_tool_calls
from .nodes import MISSING, _Invalid, _Layout, _Read, completed, json_text
from .schema import MAX_VALUES, Path, apply, build, expanded, parting, ref_depth, written
from .tokens import (
    DEFAULT_MAX_ITEMS,
    GEMMA_ARGUMENTS,
    JSON,
    MAX_VALUE_DEPTH,
    StructuredOutputError,
    Syntax,
    TemplateTooLong,
    TokenClasses,
    compile_deadline,
    first_problem,
)


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
    resize: Callable[..., JsonPlan] | None = None  # (draft text, limit, branches) -> the plan sized by them
    end: int | None = None  # the end-of-text token the template is padded with
    length: int = 0  # the template's tokens before its end-of-text padding
    smallest: int = 0  # the tokens of the shortest valid answer's layout (what a limit must leave room for)
    scored: bool = False  # its reader wants the fill's scores (`read`'s alternatives): a pattern's holes
    open: list = field(default_factory=list)  # (path, union) of the unions no draft chose (dgemma.structured.unions)
    syntax: Syntax = JSON
    wrap: tuple[str, str] = ("", "")

    @property
    def fixed(self) -> bool:
        """Nothing to generate (a tool call without arguments): the answer is the template."""
        return all(t is not None for t in self.template)

    def pins(self, length: int | None = None) -> torch.Tensor:
        """The template as fill's pins [1, length] (-1 at the holes), padded with its end token to
        `length` (default: its own)."""
        pad = [self.end] * ((length or len(self.template)) - len(self.template))
        return torch.tensor([[-1 if t is None else t for t in self.template + pad]], dtype=torch.long)

    def read(
        self,
        tokens: list[int],
        score: Callable[[int, list[list[int]]], int],
        alternatives: list[dict[int, float]] | None = None,
    ) -> tuple[Any, str | None]:
        """The answer a fill of this plan holds and None, or None and why it is not valid. Where a hole
        holds one of several options spelled alike, `score(position, options)` says which (the index of
        the likeliest; `score_request` says what to score; dgemma.generation.programs.read_json asks the model).
        `alternatives`, per position the fill's log-probabilities of the tokens it has scores for, lets
        a pattern's hole that does not match be read as the likeliest match (without: the nearest)."""
        if self.schema is None:
            return first_object(self.classes.tokenizer.decode(tokens))
        scores = (lambda k: alternatives[k] if k < len(alternatives) else None) if alternatives else (lambda k: None)
        try:
            value = self.root.read(_Read(tokens, self.classes, score, scores))
        except _Invalid as e:
            return None, str(e)
        error = next(iter(self.validator.iter_errors(value)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            return None, error.message + (f" (at {where})" if where else "")
        return value, None

    def branch_requests(self) -> list[tuple[Path, list[int], list[list[int]]]]:
        """What to score to choose each open union's branch: (its path, the answer before it written with
        the shortest values, each branch's first tokens up to where it parts from the others)."""
        encode = functools.partial(self.classes.tokenizer.encode, add_special_tokens=False)
        out = []
        for path, union in self.open:
            before = self.wrap[0] + written(self.root, self.syntax, path)[0]
            options = parting([encode(written(b, self.syntax)[0]) for b in union.branches])
            out.append((path, encode(before), options))
        return out

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
    args = (tokenizer, vocab_size, canvas_length, end_id, syntax, wrap)
    shape = _deepest(schema, validator, args)[1]
    drafted = MISSING if draft is None else draft  # no draft (compile_schema's callers never draft a null)
    return _laid_out(schema, validator, shape, *args, drafted)


def _checked(schema: dict):
    """The validator class of a schema that jsonschema accepts, whose numbers are all finite (a NaN
    `const` would make an answer that is not JSON; an infinite bound has no layout) and that expands to a
    bounded layout."""
    import jsonschema

    problem = first_problem(schema, MAX_VALUE_DEPTH)
    if problem is not None:
        raise StructuredOutputError(f"schema{'.' + problem[0] if problem[0] else ''}: {problem[1]}")
    try:
        validator = jsonschema.validators.validator_for(schema)
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise StructuredOutputError(f"not a valid JSON schema: {e.message}") from e
    if expanded(schema, 1) > MAX_VALUES:
        raise StructuredOutputError(f"the schema expands to more than {MAX_VALUES} values (arrays: maxItems each)")
    return validator


def _deepest(schema: dict, validator, args: tuple) -> tuple[JsonPlan, tuple[int, int]]:
    """The schema's layout with its recursive references expanded as deep as the values (`ref_depth`) and
    the template's tokens allow, then its arrays without maxItems as long as they allow, and that shape
    (references' depth, such arrays' items)."""
    depth = ref_depth(schema)
    shapes = [(d, DEFAULT_MAX_ITEMS) for d in range(depth, 1, -1)] + [(1, k) for k in range(DEFAULT_MAX_ITEMS, 1, -1)]
    for shape in shapes:
        with contextlib.suppress(TemplateTooLong):
            return _laid_out(schema, validator, shape, *args), shape
    return _laid_out(schema, validator, (1, 1), *args), (1, 1)  # the last: its TemplateTooLong is the refusal


def _laid_out(
    schema: dict,
    validator,
    shape: tuple[int, int],
    tokenizer,
    vocab_size: int,
    canvas_length: int,
    end_id: int,
    syntax,
    wrap,
    draft: Any = MISSING,
    branches: dict[Path, int] | None = None,
) -> JsonPlan:
    """`compile_schema` after the checks: a new tree of nodes (sizing changes them) of `shape` (`_deepest`),
    sized by `draft` (MISSING: none; None is a drafted null), its open unions set to `branches`, and laid
    out."""
    root = build(schema, *shape)
    b = _Layout(_classes(tokenizer, vocab_size), syntax)
    root.size(draft, b.classes, syntax)
    open_unions = apply(root, branches or {})
    b.text(wrap[0])
    root.layout(b)
    b.text(wrap[1])
    b.flush()
    pad = -len(b.template) % canvas_length
    template, allowed = b.template + [end_id] * pad, b.allowed + [None] * pad
    plan = JsonPlan(schema, template, allowed, root, b.classes, validator(schema), b.holes, end=end_id)
    plan.length = plan.smallest = len(b.template)
    plan.scored, plan.open, plan.syntax, plan.wrap = b.scored, open_unions, syntax, wrap
    return plan


# What a plan needs of a model: its vocabulary, its canvas, the token that ends a text (programs.sizes_of)
Sizes = collections.namedtuple("Sizes", "vocab canvas end")


def schema_plan(
    sizes: Sizes,
    tokenizer,
    schema: dict,
    *,
    syntax: Syntax = JSON,
    wrap: tuple[str, str] = ("", ""),
    read_draft: Callable[[str, dict], Any] | None = None,
) -> JsonPlan:
    """`compile_schema` for a model's `sizes`: its vocabulary, its canvas, its end-of-text token. The plan can be
    sized by a draft (`JsonPlan.resize`), whose value `read_draft(text, schema)` reads (default: the JSON
    object the text holds); the schema is checked once, not again for each draft.

    Plans are cached by the schema's text (and the model's and syntax's terms), its refusals too, and a
    schema being compiled by another thread is waited for, not compiled twice (`_CACHE`); a compile runs
    within MAX_COMPILE_SECONDS."""
    args = (tokenizer, sizes.vocab, sizes.canvas, sizes.end, syntax, wrap)
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError):  # not JSON (a library caller's own objects): not cached
        return _compiled(schema, args, read_draft)
    key = (text, args, syntax.name, read_draft is None)  # compiled from a copy: the caller's dict may change
    return _CACHE.get(key, lambda: _compiled(json.loads(text), args, read_draft))


def _compiled(schema: dict, args: tuple, read_draft: Callable[[str, dict], Any] | None) -> JsonPlan:
    """`schema_plan` without its cache, within the compile deadline."""
    with compile_deadline():
        return _plan(schema, args, read_draft)


def _plan(schema: dict, args: tuple, read_draft: Callable[[str, dict], Any] | None) -> JsonPlan:
    validator = _checked(schema)
    read = read_draft or _drafted_json
    plan, shape = _deepest(schema, validator, args)
    fewest = build(schema, *shape).shortest()
    plan.smallest = _laid_out(schema, validator, shape, *args, fewest).length

    def resize(text: str | None, limit: int | None = None, branches: dict[Path, int] | None = None) -> JsonPlan:
        """Sized by a draft's values (None: the schema's layout), the unions it leaves open set to
        `branches`; past `limit` tokens, by the draft made whole (`completed`): first with the fewest
        items and the shortest branches where it lacks them, its scalars at their budgets, then with the
        shortest values, then as the shortest answer."""
        with compile_deadline():
            return _resized(text, limit, branches)

    def _resized(text: str | None, limit: int | None, branches: dict[Path, int] | None) -> JsonPlan:
        drafted = MISSING if text is None else read(text, schema)
        tree = build(schema, *shape)
        for value in (drafted, completed(tree, drafted, budgets=True), completed(tree, drafted), fewest):
            try:
                sized = _laid_out(schema, validator, shape, *args, value, branches)
            except TemplateTooLong:
                continue  # a draft of more values than a template holds: the next, fewer
            if limit is None or sized.length <= limit:
                return sized
        return sized

    plan.resize = resize
    return plan


class _PlanCache:
    """Compiled plans by key, the least recently used out past `size` plans or `budget` bytes of masks; a
    refusal is kept as its error. One compile per key at a time: a second thread asking waits for it."""

    def __init__(self, size: int, budget: int):
        self.size, self.budget, self.lock = size, budget, threading.Lock()
        self.done: collections.OrderedDict[tuple, tuple[JsonPlan | StructuredOutputError, int]] = (
            collections.OrderedDict()
        )
        self.running: dict[tuple, threading.Event] = {}

    def get(self, key: tuple, compile_: Callable[[], JsonPlan]) -> JsonPlan:
        while True:
            with self.lock:
                if key in self.done:
                    self.done.move_to_end(key)
                    return self._answer(self.done[key][0])
                waiting = self.running.get(key)
                if waiting is None:
                    self.running[key] = threading.Event()
                    break
            waiting.wait()
        out: JsonPlan | StructuredOutputError | None = None
        try:
            out = compile_()
        except StructuredOutputError as e:
            out = e
        finally:
            with self.lock:  # kept before the waiting threads wake, so that they find it
                if out is not None:
                    self._keep(key, out)
                self.running.pop(key).set()
        return self._answer(out)

    def _keep(self, key: tuple, out: JsonPlan | StructuredOutputError) -> None:
        size = _mask_bytes(out) if isinstance(out, JsonPlan) else 0
        if size > self.budget:
            return  # a plan larger than the whole cache is compiled again when asked again
        self.done[key] = (out, size)
        while len(self.done) > self.size or sum(n for _, n in self.done.values()) > self.budget:
            self.done.popitem(last=False)

    @staticmethod
    def _answer(out: JsonPlan | StructuredOutputError) -> JsonPlan:
        if isinstance(out, StructuredOutputError):
            raise StructuredOutputError(str(out))
        return out


def _mask_bytes(plan: JsonPlan) -> int:
    """The bytes of a plan's distinct masks of allowed tokens (a [V] bool each: 256 KB on the 26B)."""
    masks = {id(m): m for m in plan.allowed or () if m is not None}
    return sum(m.numel() * m.element_size() for m in masks.values())


MAX_CACHED_PLANS = 64
MAX_CACHED_BYTES = 256 * 2**20  # what the cached plans' masks may hold in all
_CACHE = _PlanCache(MAX_CACHED_PLANS, MAX_CACHED_BYTES)


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
    """The arguments of a free draft's first call of function `name` (MISSING when it has none)."""

    def read(text: str, schema: dict) -> Any:
        return next((arguments for called, arguments in parse_tool_calls(text)[0] if called == name), MISSING)

    return read


def tool_call_plan(sizes: Sizes, tokenizer, name: str, parameters: dict | None) -> JsonPlan:
    """A Gemma 4 tool call of function `name` whose arguments follow `parameters` (its JSON schema), laid
    out in the call syntax: `<|tool_call>call:NAME{` pinned, the arguments' values as holes, `}<tool_call|>`
    pinned (dgemma.tool_calls). Reading the plan gives the arguments."""
    schema = {"type": "object", "properties": {}} if parameters in (None, {}) else parameters
    kind = schema.get("type", "object" if "properties" in schema else None) if isinstance(schema, dict) else None
    if kind != "object":  # OpenAI's rule: a call's arguments are an object
        raise StructuredOutputError(f"must be a JSON schema of type object (got {kind!r})")
    _check_writable(schema)
    wrap = (f"{CALL_OPEN}call:{name}", CALL_CLOSE)
    return schema_plan(sizes, tokenizer, schema, syntax=GEMMA_ARGUMENTS, wrap=wrap, read_draft=_drafted_call(name))


_MARKERS = (QUOTE, CALL_OPEN, CALL_CLOSE)  # the call syntax's own tokens: no escape writes them in a value


def _check_writable(schema: Any, path: str = "") -> None:
    """A StructuredOutputError naming the first constant, option or property name of a tool's parameters
    that holds one of the call syntax's markers (the call would not read back)."""
    if isinstance(schema, dict):
        named = (
            [(f"{path}.properties.{k}", k) for k in schema.get("properties", {})]
            if isinstance(schema.get("properties"), dict)
            else []
        )
        fixed = [(f"{path}.const", schema["const"])] if "const" in schema else []
        fixed += [(f"{path}.enum", schema["enum"])] if "enum" in schema else []
        for where, value in named + fixed:
            if any(marker in text for text in _strings(value) for marker in _MARKERS):
                raise StructuredOutputError(f"schema{where}: holds one of {list(_MARKERS)}, which a call cannot write")
        items = schema.items()
    elif isinstance(schema, list):
        items = ((str(i), v) for i, v in enumerate(schema))
    else:
        return
    for key, value in items:
        _check_writable(value, f"{path}.{key}")


def _strings(value: Any):
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list):
        for k, v in value.items() if isinstance(value, dict) else enumerate(value):
            yield from _strings(k)
            yield from _strings(v)


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


def unsatisfied(attempts: int, last: str, steps: int = 0) -> StructuredOutputError:
    """The error after the last attempt."""
    error = StructuredOutputError(f"no valid JSON answer in {attempts} attempts (the last: {last})")
    error.steps = steps
    return error
