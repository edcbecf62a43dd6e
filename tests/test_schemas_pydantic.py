"""Schemas as Pydantic writes them (what openai's `parse()` and LangChain send): `$defs` and `$ref`,
Optional fields (`anyOf` with null), enums, literals, lists of models, unions of models and a recursive
model compile, and every answer validates against the schema and against the Pydantic model itself."""

from __future__ import annotations

import datetime
import enum
import json
import uuid
from typing import Literal, Optional, Union

import jsonschema
import pytest
import torch
from pydantic import BaseModel

import dgemma
from dgemma.generation.engine import Scores, WorkCall
from dgemma.generation.programs import choose_branches, context_room, generate_json, sizes_of
from dgemma.structured import StructuredOutputError, compile_schema, schema_plan, tool_call_plan
from dgemma.structured.nodes import MISSING, completed
from dgemma.structured.schema import build
from dgemma.tasks.code import MODEL_DIR

KW = dict(max_denoising_steps=6)


class Color(enum.StrEnum):
    red = "red"
    blue = "blue"


class Address(BaseModel):
    city: str
    zip: Optional[str] = None  # noqa: UP045 (the spelling users write; Pydantic makes it anyOf [str, null])


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Order(BaseModel):
    item: str
    color: Color
    size: Literal["S", "M", "L"]
    address: Address
    lines: list[Address]
    pet: Union[Cat, Dog]  # noqa: UP007
    note: str | None
    count: int | None = None


class Stamped(BaseModel):
    id: uuid.UUID
    day: datetime.date
    at: datetime.datetime
    opens: datetime.time
    lasts: datetime.timedelta


class Node(BaseModel):
    name: str
    children: list[Node] = []


@pytest.fixture(scope="module")
def code():
    return dgemma.load(MODEL_DIR, dtype="fp32"), dgemma.Tokenizer.from_dir(MODEL_DIR)


@pytest.mark.parametrize("model_class", [Order, Node, Address, Stamped])
def test_pydantic_models_give_answers_that_pydantic_reads(code, model_class):
    model, tok = code
    schema = model_class.model_json_schema()
    for seed in range(2):
        out = generate_json(model, "# an answer\nvalue = ", schema, tokenizer=tok, seed=seed, retries=4, **KW)
        jsonschema.validate(out.value, schema)
        assert model_class.model_validate(out.value) is not None
        assert json.loads(out.text) == out.value


def _plan(code, schema, draft=None):
    model, tok = code
    return compile_schema(schema, tok, model.text_config.vocab_size, model.config.canvas_length, 1, draft=draft)


def test_a_union_is_laid_out_as_the_branch_the_draft_wrote(code):
    """The draft chooses the branch: its value's type, and an object's constants (Pydantic's literals)."""
    _, tok = code
    schema = Order.model_json_schema()

    def pinned(plan) -> str:
        return tok.decode([t for t in plan.template if t is not None and t != 1])

    draft = {"pet": {"kind": "dog", "good": True}, "note": None, "count": 3}
    text = pinned(_plan(code, schema, draft))
    assert '"pet":{"kind":"dog","good":' in text and '"note":null' in text and '"count":' in text
    text = pinned(_plan(code, schema, {"pet": {"kind": "cat", "lives": 9}, "note": "hi"}))
    assert '"pet":{"kind":"cat","lives":' in text and '"note":"' in text and '"note":null' not in text
    # no draft: the first branch that is not null (a value, not an absent one)
    assert '"pet":{"kind":"cat"' in pinned(_plan(code, schema))


def _drive(program, choose):
    """Run a program's Score calls by `choose(prompt, continuations)` (the index to favour); its result."""
    reply = None
    while True:
        try:
            call = program.send(reply)
        except StopIteration as stop:
            return stop.value
        if isinstance(call, WorkCall):  # a layout or a read, run in place
            reply = call.fn(*call.args)
            continue
        best = choose(call.prompt, call.continuations)
        reply = Scores([torch.tensor([0.0 if i == best else -9.0]) for i in range(len(call.continuations))])


def test_a_union_no_draft_chose_takes_the_branch_the_model_scores_best(code):
    """Without a draft (size="schema"), each open union is a Score call of its branches' first tokens
    where they part, after the answer before it; a nested union is asked once its enclosing branch is
    known, in the syntax the answer is written in (tool calls: bare keys, sorted)."""
    model, tok = code
    schema, asked = Order.model_json_schema(), []
    plan = schema_plan(sizes_of(model), tok, schema)
    assert {path for path, _ in plan.open} >= {("pet",), ("note",), ("count",), ("address", "zip")}

    def last_branch(prompt, options):
        asked.append((tok.decode(prompt[3:]), [tok.decode(o) for o in options]))
        return len(options) - 1

    chosen = _drive(choose_branches(plan, plan, [1, 2, 3], None, None), last_branch)
    text = tok.decode([t for t in chosen.template if t is not None and t != chosen.end])
    assert '"pet":{"kind":"dog","good":' in text and '"note":null' in text and '"count":null' in text
    assert '"zip":null' in text and not chosen.open
    pet = next(options for before, options in asked if before.endswith('"pet":'))
    assert [o.removeprefix('{"kind":"') for o in pet] in (["c", "d"], ["cat", "dog"])  # cut where they part
    # the context is the answer before the union, with the shortest values written in
    assert any(before.startswith('{"item":"","color":"red"') for before, _ in asked)

    nested = {
        "anyOf": [{"type": "null"}, {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}]
    }
    plan, asked = schema_plan(sizes_of(model), tok, nested), []
    chosen = _drive(choose_branches(plan, plan, [1], None, None), last_branch)
    assert len(asked) > 1 and not chosen.open  # the outer array, then its items (asked together)
    for size in ("draft", "schema"):  # a union at the top whose shortest answer is null is not a fixed answer
        out = generate_json(model, "x = ", {"anyOf": [{"type": "string"}, {"type": "null"}]}, tokenizer=tok, size=size)
        assert out.value is None or isinstance(out.value, str)
    call = tool_call_plan(
        sizes_of(model), tok, "f", {"type": "object", "properties": {"b": {"type": ["string", "null"]}}}
    )
    (path, before, options) = call.branch_requests()[0]
    assert path == ("b",) and tok.decode(before).endswith("call:f{b:") and len(options) == 2


def test_a_recursive_model_stops_at_the_reference_depth(code):
    from dgemma.structured import REF_DEPTH

    plan = _plan(code, Node.model_json_schema())
    text = code[1].decode([t for t in plan.template if t is not None and t != 1])
    level = '{"name":","children":['  # a node's pinned runs, its name's hole between them
    assert level * REF_DEPTH + "]" in text  # REF_DEPTH levels, the last one's list empty (`[]` pinned)
    assert level * (REF_DEPTH + 1) not in text


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, "recurses deeper than"),
        (
            {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}}}, "$ref": "#/$defs/N"},
            "recurses deeper than",  # nothing can stop it: no union, no array
        ),
        (
            {"type": "string", "format": "uri"},
            r"format 'uri' is not supported \(supported: \['date', 'date-time', 'duration'",
        ),
        ({"type": "string", "format": "date", "maxLength": 4}, "do not go with a format"),
        ({"anyOf": []}, "not a valid JSON schema"),
    ],
)
def test_references_that_cannot_end_are_refused(code, schema, message):
    with pytest.raises(StructuredOutputError, match=message):
        _plan(code, schema)


class Small(BaseModel):
    customer: str
    city: str
    quantity: int


def test_max_new_tokens_is_an_upper_bound(code):
    """As for text: the answer's values are sized within it (the draft is drawn within it too), and only a
    bound below the shortest valid answer is refused, saying how many tokens that answer takes."""
    model, tok = code
    schema = Small.model_json_schema()
    for limit in (24, 40):
        out = generate_json(model, "# an order\norder = ", schema, tokenizer=tok, seed=0, max_new_tokens=limit, **KW)
        Small.model_validate(out.value)
        assert len(tok.encode(out.text, add_special_tokens=False)) <= limit
    with pytest.raises(ValueError, match=r"max_new_tokens is 3, but the shortest valid answer takes \d+ tokens"):
        generate_json(model, "x", schema, tokenizer=tok, max_new_tokens=3, **KW)


def test_without_max_new_tokens_the_bound_is_what_the_context_leaves(code):
    """A recursive model's layout (lists of lists, 4 x 4 x 4) is longer than the context: the answer is
    sized within what the context leaves after the prompt, its lists shortest and its strings at their
    budgets (not the shortest answer, whose name is empty and which leaves nothing to generate)."""
    model, tok = code
    schema = Node.model_json_schema()
    prompt = tok.encode("# a tree of names\n" * 60 + "tree = ")
    room = context_room(model.text_config.max_position_embeddings, model.config.canvas_length, len(prompt))
    assert len(_plan(code, schema).template) > room
    for size in ("schema", "draft"):
        out = generate_json(model, prompt, schema, tokenizer=tok, seed=0, size=size, **KW)
        assert Node.model_validate(out.value) and out.steps > 0
    tree = build(schema)
    assert completed(tree, MISSING) == {"name": "", "children": []}
    assert completed(tree, MISSING, budgets=True) == {"name": MISSING, "children": []}
    assert completed(tree, {"children": [{"name": "a"}]}, budgets=True) == {
        "name": MISSING,
        "children": [{"name": "a", "children": []}],
    }
    with pytest.raises(
        ValueError, match=r"the shortest valid answer takes \d+ tokens, but with a prompt of \d+ tokens at most 0 fit"
    ):
        generate_json(model, prompt * 3, {"type": "object", "properties": {"a": {"type": "string"}}}, tokenizer=tok)


def test_formats_are_read_back_as_values_of_their_shape(code):
    """Pinned separators, a position per character; a field the fill spells no value of (month 13) is read
    as the value the model scores best, and a day past its month's end moves to that end."""
    from dgemma.structured.formats import _Format
    from dgemma.structured.nodes import _Layout, _Read
    from dgemma.structured.plans import _classes

    model, tok = code
    classes = _classes(tok, model.text_config.vocab_size)
    node = _Format("date")
    b = _Layout(classes)
    node.layout(b)
    b.flush()
    assert tok.decode([t for t in b.template if t is not None]) == '"--"'  # the quotes and separators pinned
    ids = {ch: tok.encode(ch, add_special_tokens=False)[0] for ch in "0123456789"}

    def filled(text: str) -> list[int]:
        chars = iter(text.replace("-", ""))
        return [ids[next(chars)] if t is None else t for t in b.template]

    asked = []

    def score(position, options):
        asked.append(len(options))
        return 1  # the second value: month "02"

    assert node.read(_Read(filled("2025-02-30"), classes, score)) == "2025-02-28" and not asked
    assert node.read(_Read(filled("2025-13-31"), classes, score)) == "2025-02-28" and asked == [12]
    root = _Format("date-time")
    assert list(root.scan('"2025-01-31T23:59:00Z"', 0)) == [22]
    assert list(root.scan('"2025-01-3', 0)) == [-1] and list(root.scan('"2025-13-01T00:00:00Z"', 0)) == []


@pytest.mark.parametrize(
    "schema, values",
    [
        ({"type": "integer", "multipleOf": 5, "minimum": 3, "maximum": 40}, {5, 10, 15, 20, 25, 30, 35, 40}),
        ({"type": "integer", "multipleOf": 25, "minimum": 0, "maximum": 5000}, None),  # digit by digit, rounded
        ({"type": "integer", "multipleOf": 7}, None),  # unbounded, rounded
        ({"type": "number", "multipleOf": 0.1}, None),  # 0.3 / 0.1 is not whole in floats: never 0.3
        ({"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 100}, None),
        ({"type": "number", "multipleOf": 0.25, "exclusiveMinimum": 0}, None),
    ],
)
def test_multiples_are_valid_by_construction(code, schema, values):
    """An integer or a number read back as the nearest multiple within the bounds, which jsonschema's
    float division accepts; Pydantic's `multiple_of` reads it too."""
    from pydantic import Field, create_model

    model, tok = code
    wrapped = {"type": "object", "properties": {"n": schema}, "required": ["n"], "additionalProperties": False}
    kind = int if schema["type"] == "integer" else float
    limits = {"gt": "exclusiveMinimum", "ge": "minimum", "le": "maximum", "multiple_of": "multipleOf"}
    pydantic_model = create_model("M", n=(kind, Field(**{k: schema[v] for k, v in limits.items() if v in schema})))
    for seed in range(3):
        out = generate_json(model, "# a count\nconfig = ", wrapped, tokenizer=tok, seed=seed, retries=0, **KW)
        jsonschema.validate(out.value, wrapped)
        pydantic_model.model_validate(out.value)
        assert values is None or out.value["n"] in values
    with pytest.raises(StructuredOutputError, match="an integer's multipleOf is supported as an integer"):
        _plan(code, {"type": "integer", "multipleOf": 0.5})


def test_hostile_schemas_are_refused_before_the_work_they_ask_for(code):
    """Definitions that each refer to many others (30^8 values if expanded), a repetition of a million, a
    reference cycle with no value in it: each is refused at once."""

    defs = {f"D{i}": {"type": "object", "properties": {f"p{k}": {"$ref": f"#/$defs/D{i + 1}"} for k in range(30)}}
            for i in range(8)}  # fmt: skip
    defs["D8"] = {"type": "integer"}
    cases = [
        ({"$defs": defs, "$ref": "#/$defs/D0"}, "expands to more than"),
        ({"type": "string", "pattern": r"\d{1000000}"}, "writes out to more than"),
        ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, "recurses deeper"),
    ]
    for schema, message in cases:
        with pytest.raises(StructuredOutputError, match=message):
            _plan(code, schema)
