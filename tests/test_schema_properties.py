"""Property tests of the schema compiler on schemas it did not write: Hypothesis draws schemas of OpenAI's
strict subset (nested objects, arrays, unions, type lists, enums, consts, `$defs`/`$ref`, bounds,
`multipleOf`, formats, patterns), and hypothesis-jsonschema draws instances of each. For every schema:

- whatever the sampler puts in the holes (tokens drawn at random from each position's allowed set, the
  Score choices at random too), the answer read back is valid JSON for the schema, in JSON and in the
  tool-call syntax; only the bounds that a
  shape cannot hold (`minimum`, `maximum`, the exclusive ones: drawn again by the retries) may fail;
- laid out by a valid instance as its draft, the same holds;
- the shortest answer (what a tight `max_tokens` falls back to) is valid;
- an instance made whole (`completed`, where sizing past a bound starts) is still valid.
"""

from __future__ import annotations

import copy
import json
import os
import random

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

hypothesis_jsonschema = pytest.importorskip("hypothesis_jsonschema")

import dgemma  # noqa: E402
from dgemma.structured import GEMMA_ARGUMENTS, JSON, compile_schema  # noqa: E402
from dgemma.structured.nodes import _Read, completed  # noqa: E402
from dgemma.structured.schema import build  # noqa: E402
from dgemma.tasks.code import MODEL_DIR  # noqa: E402

RETRIED = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}  # checked after the fill, then retried
PATTERNS = [r"^[A-Z]{2}-\d{2}$", r"^[a-z]+(-[a-z]+)?$", r"^(yes|no)$", r"^v\d\.\d$"]
FORMATS = ["date", "time", "date-time", "uuid", "duration", "email", "hostname", "ipv4", "ipv6"]
NAMES = st.sampled_from(["a", "b", "name", "when", "items", "kind"])


def _string() -> st.SearchStrategy[dict]:
    lengths = st.tuples(st.integers(0, 3), st.integers(0, 8)).map(lambda t: {"minLength": t[0], "maxLength": sum(t)})
    return st.one_of(
        st.just({"type": "string"}),
        lengths.map(lambda k: {"type": "string", **k}),
        st.sampled_from(FORMATS).map(lambda f: {"type": "string", "format": f}),
        st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
        st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
            lambda o: {"enum": o}
        ),
    )


@st.composite
def _number(draw) -> dict:
    kind = draw(st.sampled_from(["integer", "number"]))
    schema: dict = {"type": kind}
    low = draw(st.none() | st.integers(-50, 50))
    if low is not None:
        schema["minimum"] = low
        high = draw(st.none() | st.integers(low + 1, low + 500))
        if high is not None:
            schema["maximum"] = high
    if "minimum" in schema and draw(st.booleans()):  # as Pydantic writes gt=
        schema["exclusiveMinimum"] = schema.pop("minimum")
    if draw(st.booleans()):
        schema["multipleOf"] = draw(st.sampled_from([2, 5] if kind == "integer" else [0.5, 0.25, 2]))
        if "maximum" in schema and schema["maximum"] - low < 10:
            del schema["multipleOf"]  # a range that may hold no multiple is not a schema a client sends
    return schema


LEAVES = st.one_of(
    _string(),
    _number(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.sampled_from([{"const": "fixed"}, {"const": 3}, {"enum": [1, "one", None]}]),
)


def _composite(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=3).map(
        lambda p: {"type": "object", "properties": p, "required": list(p), "additionalProperties": False}
    )
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    unions = st.lists(children, min_size=2, max_size=3).map(lambda b: {"anyOf": b})
    optional = children.map(lambda c: {"anyOf": [c, {"type": "null"}]})
    return st.one_of(objects, arrays, unions, optional)


@st.composite
def schemas(draw) -> dict:
    """A root object of the strict subset, its first property sometimes behind a `$ref`."""
    tree = st.recursive(LEAVES, _composite, max_leaves=6)
    props = draw(st.dictionaries(NAMES, tree, min_size=1, max_size=3))
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    if draw(st.booleans()):
        key = next(iter(props))
        schema["$defs"] = {"Part": props[key]}
        props[key] = {"$ref": "#/$defs/Part"}
    return schema


@pytest.fixture(scope="module")
def code():
    return dgemma.load(MODEL_DIR, dtype="fp32"), dgemma.Tokenizer.from_dir(MODEL_DIR)


def _plan(code, schema, draft=None, syntax=JSON):
    model, tok = code
    vocab, canvas = model.text_config.vocab_size, model.config.canvas_length
    return compile_schema(schema, tok, vocab, canvas, 1, draft=draft, syntax=syntax)


def _random_answers(plan, rng: random.Random, n: int):
    """The values `n` random fills of `plan` hold (allowed tokens and Score choices at random), as read
    before validation."""
    for _ in range(n):
        tokens = [t if t is not None else rng.choice(m.nonzero().flatten().tolist()) for t, m in
                  zip(plan.template, plan.allowed, strict=True)]  # fmt: skip
        yield plan.root.read(_Read(tokens, plan.classes, lambda position, options: rng.randrange(len(options))))


def _a_bound(e: jsonschema.ValidationError) -> bool:
    """Whether a validation error is a bound the shape cannot hold (in a union: in some branch alone)."""
    if e.validator in RETRIED:
        return True
    if e.validator in ("anyOf", "oneOf"):
        branches: dict = {}
        for sub in e.context:
            branches.setdefault(sub.relative_schema_path[0], []).append(sub)
        return any(all(_a_bound(sub) for sub in subs) for subs in branches.values())
    return False


def _check(schema: dict, value) -> None:
    """`value` is JSON valid for `schema` but for bounds a shape cannot hold (the reader's validation
    refuses those, and the fill is drawn again)."""
    assert json.loads(json.dumps(value)) == value
    errors = list(jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).iter_errors(value))
    assert all(_a_bound(e) for e in errors), [e.message for e in errors]


PROPERTY = settings(
    max_examples=int(os.environ.get("DGEMMA_EXAMPLES", 40)),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=not os.environ.get("DGEMMA_EXAMPLES"),
)


@PROPERTY
@given(schema=schemas(), seed=st.integers(0, 2**16))
def test_any_fill_of_a_drawn_schema_is_read_as_a_valid_answer(code, schema, seed):
    jsonschema.Draft202012Validator.check_schema(schema)
    rng = random.Random(seed)
    for syntax in (JSON, GEMMA_ARGUMENTS):  # a response_format's JSON, a tool call's arguments
        for value in _random_answers(_plan(code, schema, syntax=syntax), rng, 3):
            _check(schema, value)
    shortest = build(schema).shortest()
    jsonschema.validate(shortest, schema, format_checker=jsonschema.FormatChecker())


@PROPERTY
@given(data=st.data())
def test_a_valid_instance_sizes_a_template_whose_fills_are_valid(code, data):
    schema = data.draw(schemas())
    instance = data.draw(hypothesis_jsonschema.from_schema(copy.deepcopy(schema)))  # it rewrites what it reads
    checked = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    assume(checked.is_valid(instance))  # the two libraries differ on some formats ('00:00:00Z' as a time)
    made_whole = completed(build(schema), instance)  # what sizing past a bound starts from
    checked.validate(made_whole)
    plan, rng = _plan(code, schema, draft=instance), random.Random(0)
    for value in _random_answers(plan, rng, 2):
        _check(schema, value)
