"""Structured output: answers parse and validate against their schema (checked with jsonschema), keys are
pinned, values keep to their types' tokens, unsupported schemas are refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest

import dgemma
from dgemma.generation.loop import end_of_text_ids
from dgemma.generation.programs import generate_json, read_answer, sizes_of
from dgemma.structured import StructuredOutputError, compile_schema
from dgemma.structured.nodes import _Choice, _Layout, _Read
from dgemma.tasks.code import MODEL_DIR

KW = dict(max_denoising_steps=6)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "height": {"type": "number"},
        "member": {"type": "boolean"},
        "pet": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer", "minimum": 0}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"const": "person"},
        "note": {"type": "null"},
    },
    "required": ["name", "age", "height", "member", "pet", "tags", "address", "kind", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def code():
    """The shipped code model: a real trained tokenizer (byte-level BPE) and a model that writes text."""
    return dgemma.load(MODEL_DIR, dtype="fp32"), dgemma.Tokenizer.from_dir(MODEL_DIR)


def _plan(code, schema):
    model, tok = code
    return compile_schema(schema, tok, model.text_config.vocab_size, model.config.canvas_length, 1)


def test_answers_validate_and_keep_the_schema_shape(code):
    model, tok = code
    plan = _plan(code, PERSON)
    assert len(plan.template) > model.config.canvas_length  # this schema spans two canvases
    for seed in range(3):
        out = generate_json(model, "# a person\nperson = ", PERSON, tokenizer=tok, seed=seed, retries=4, **KW)
        jsonschema.validate(out.value, PERSON)
        assert json.loads(out.text) == out.value
        assert list(out.value) == list(PERSON["properties"])  # every key, in the schema's order
        assert out.value["kind"] == "person" and out.value["note"] is None
        assert 2 <= len(out.value["name"]) <= 12
        assert out.steps >= out.attempts


def test_the_template_pins_keys_and_each_hole_keeps_to_its_type(code):
    model, tok = code
    plan = _plan(code, PERSON)
    pinned = tok.decode([t for t in plan.template if t is not None])
    for key in ('{"name":"', '"age":', '"address":{"city":"', '"kind":"person"', '"note":null}'):
        assert key in pinned
    out = generate_json(model, "x = ", PERSON, tokenizer=tok, seed=5, retries=4, **KW)
    tokens = out.result.tokens[0]
    for i, (t, mask) in enumerate(zip(tokens, plan.allowed, strict=True)):
        if plan.template[i] is not None:
            assert t == plan.template[i]
        elif mask is not None:
            assert bool(mask[t]), f"position {i} holds {tok.token_texts[t]!r}, outside its set"


def test_a_string_closes_at_its_quote_and_what_follows_is_dropped(code):
    tok = code[1]
    plan = _plan(code, {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10}}})
    string = plan.root.properties[0][1]
    tokens = list(plan.template)
    ids = tok.encode('Ann Lee","x', add_special_tokens=False)
    body = [t if t is not None else ids[0] for t in tokens]
    body[string.span] = (ids + ids)[: string.span.stop - string.span.start]
    assert string.read(_Read(body, plan.classes, None)) == "Ann Lee"


def test_choices_that_spell_no_option_are_scored_by_the_encoder(code):
    tok = code[1]
    node = _Choice(["alpha", "beta", "gamma"])
    b = _Layout(_plan(code, {"type": "boolean"}).classes)
    b.text('{"x":')
    node.layout(b)
    b.text("}")
    b.flush()
    digit, close = (tok.encode(x, add_special_tokens=False)[0] for x in ("1", "}"))
    tokens = [t if t is not None else digit for t in b.template]
    asked = []
    got = node.read(_Read(tokens, b.classes, lambda pos, opts: asked.append(pos) or 2))
    assert got == "gamma" and asked == [node.span.start]  # no option spelled: the scorer decides
    ids = node.written[1][1]
    hole = node.span.stop - node.span.start
    spelled = tokens[: node.span.start] + (ids + [close] * hole)[:hole] + tokens[node.span.stop :]
    assert node.read(_Read(spelled, b.classes, None)) == "beta"  # spelled, then a token that ends a value


def test_the_encoder_scores_pick_the_likeliest_option(code):
    model, tok = code
    schema = {"type": "object", "properties": {"v": {"enum": ["True", "None", "self"]}}}
    plan = _plan(code, schema)
    prompt = tok.encode("def f(x):\n    return ", add_special_tokens=False)
    choice = plan.root.properties[0][1]
    filler = tok.encode("1", add_special_tokens=False)[0]
    tokens = [t if t is not None else filler for t in plan.template]
    value, error = read_answer(model, plan, prompt, tokens)
    assert error is None
    from dgemma.generation.engine import score

    context = prompt + tokens[: choice.span.start]
    after = [t for t in plan.template[choice.span.stop :] if t is not None][:1]
    options = [ids + after for _, ids in choice.written]
    scores = [float(lp.sum()) for lp in score(model, context, options).logprobs]
    assert value["v"] == choice.options[max(range(3), key=scores.__getitem__)]


def test_a_schema_that_fixes_the_whole_answer_is_answered_without_a_fill(code):
    """A const, an enum of one (a Pydantic model of one Literal field): the answer is the template itself,
    read back without generating (0 steps), not refused."""
    model, tok = code
    for schema in ({"const": 3}, {"type": "object", "properties": {"kind": {"enum": ["cat"]}}, "required": ["kind"]}):
        out = generate_json(model, "x = ", schema, tokenizer=tok)
        assert out.steps == 0 and out.result is None and jsonschema.Draft202012Validator(schema).is_valid(out.value)


def test_a_schema_no_answer_can_meet_fails_clearly_after_its_retries(code):
    model, tok = code
    both = {"oneOf": [{"type": "integer"}, {"type": "integer"}]}  # every integer fits both: none fits one
    impossible = {"type": "object", "properties": {"n": both}, "required": ["n"]}
    with pytest.raises(StructuredOutputError, match="in 2 attempts"):
        generate_json(model, "x = ", impossible, tokenizer=tok, seed=0, retries=1, **KW)
    bounds = {"type": "object", "properties": {"n": {"type": "string", "minLength": 5, "maxLength": 2}}}
    with pytest.raises(StructuredOutputError, match="maxLength is below minLength"):  # before any pass
        generate_json(model, "x = ", bounds, tokenizer=tok, seed=0, retries=1, **KW)
    empty = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 4}}}
    with pytest.raises(StructuredOutputError, match="no integer lies within the bounds"):  # before any pass
        generate_json(model, "x = ", empty, tokenizer=tok, seed=0, retries=1, **KW)


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "string", "pattern": r"(a)\1"}, "groupref is not supported"),
        ({"anyOf": [{"type": "string"}], "type": "string"}, "anyOf is supported alone"),
        ({"anyOf": [{"type": "string", "pattern": "(?=a)a*"}]}, r"schema.anyOf.0: pattern '\(\?=a\)a\*'"),
        ({"type": ["string", "null"], "multipleOf": 2}, r"\['multipleOf'\] not supported for types"),
        ({"$ref": "#/$defs/x", "type": "object", "$defs": {"x": {}}}, r"\['type'\] beside \$ref"),
        ({"$ref": "https://example.com/s.json"}, "only references to the schema's own"),
        ({"$ref": "#/$defs/missing"}, "names no definition"),
        ({"type": "object", "properties": {"a": {"type": "string", "format": "uri"}}}, r"schema.properties.a"),
        ({"type": "array", "items": {"type": "string"}, "maxItems": 1000}, "maxItems is at most"),
        ({"type": "object", "additionalProperties": {"type": "string"}}, "additionalProperties"),
        ({"type": "integer", "minimum": "3"}, "not a valid JSON schema"),
        ({"type": "object", "properties": {"a": {"const": float("nan")}}}, r"schema.properties.a.const: 'nan'"),
        ({"type": "object", "properties": {"a": {"enum": [1, float("inf")]}}}, r"schema.properties.a.enum.1"),
        ({"type": "number", "maximum": float("inf")}, "schema.maximum: 'inf' is not a finite number"),
    ],
)
def test_unsupported_or_invalid_schemas_are_refused_by_name(code, schema, message):
    with pytest.raises(StructuredOutputError, match=message):
        _plan(code, schema)


def test_cli_json_schema(code, tmp_path, capsys):
    from dgemma.cli import main

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(PERSON))
    rc = main(["generate", "-m", str(MODEL_DIR), "--raw", "-p", "p = ", "--json-schema", str(path), "--seed", "1"])
    assert rc == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), PERSON)
    assert main(["generate", "-m", str(MODEL_DIR), "--raw", "-p", "p", "--json-schema", str(path), "--ar"]) != 0
    assert "leave out --ar" in capsys.readouterr().err


def test_choose_scores_each_option_as_the_whole_answer(code):
    model, tok = code
    from dgemma.generation.engine import score

    prompt = tok.encode("def add(a, b):\n    return a", add_special_tokens=False)
    options = [" + b", " - b", " banana"]
    chosen = dgemma.choose(model, prompt, options, tokenizer=tok)
    end = end_of_text_ids(model)[:1]
    for option, given in zip(options, chosen.scores, strict=True):
        ids = tok.encode(option, add_special_tokens=False) + end
        alone = float(score(model, prompt, [ids]).logprobs[0].sum())
        assert given == pytest.approx(alone, abs=1e-4)  # one row vs a padded batch: fp32 rounding of BLAS paths
    assert chosen.option == options[chosen.index] and chosen.index == max(range(3), key=chosen.scores.__getitem__)
    with pytest.raises(ValueError, match="options"):
        dgemma.choose(model, prompt, [], tokenizer=tok)
    with pytest.raises(ValueError, match="option 1"):
        dgemma.choose(model, prompt, [[5], []])


def test_the_same_schema_decoded_left_to_right_validates_too(code):
    model, tok = code
    from dgemma.ar import decode_grammar, generate_json_ar

    prompt = "# a person\nperson = "
    out = generate_json_ar(model, prompt, PERSON, tokenizer=tok)
    jsonschema.validate(out.value, PERSON)
    plan = _plan(code, PERSON)
    tokens, forwards, error = decode_grammar(model, plan, tok.encode(prompt))
    assert error is None and forwards == out.steps == len(tokens) + 1  # one pass per token and the end
    assert json.loads(tok.decode(tokens)) == out.value


def test_the_grammar_takes_every_prefix_of_an_answer_and_refuses_the_rest(code):
    from dgemma.structured import grammar_state

    root = _plan(code, PERSON).root
    answer = json.dumps(
        {"name": "Ada", "age": 36, "height": 1.7, "member": True, "pet": "dog", "tags": ["a", "b"],
         "address": {"city": "Oslo", "zip": 150}, "kind": "person", "note": None},
        separators=(",", ":"),
    )  # fmt: skip
    assert all(grammar_state(root, answer[:k]) == (True, False) for k in range(len(answer)))
    assert grammar_state(root, answer) == (False, True)
    ada = '{"name":"Ada","age":'
    for wrong in ('{"age"', '{"name":"A","', ada + "131", ada + "01", ada + "-"):
        assert not any(grammar_state(root, wrong)), wrong  # key order, minLength, bounds, a leading 0, a sign
    assert grammar_state(root, '{"name":"Ada","age":13')[0]  # 13 may still become 130
    too_many = answer.replace('["a","b"]', '["a","b","c","d"]')
    assert not any(grammar_state(root, too_many[: too_many.index('"d"')]))  # maxItems 3


def test_bounded_integers_hold_their_bounds_by_construction(code):
    model, tok = code
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1000, "maximum": 9999},  # digits one per position: exactly 4
            "n": {"type": "integer", "minimum": 1, "exclusiveMaximum": 13},  # 12 values: a choice of them
            "big": {"type": "integer", "minimum": 0, "maximum": 999},  # 1 to 3 digits, each of them valid
        },
    }
    plan = _plan(code, schema)
    assert isinstance(plan.root.properties[1][1], _Choice) and plan.root.properties[1][1].options[-1] == 12
    for seed in range(4):  # no retry: a bound that fails here would fail the answer
        out = generate_json(model, "x = ", schema, tokenizer=tok, seed=seed, retries=0, **KW)
        jsonschema.validate(out.value, schema)
        assert out.attempts == 1


def test_a_schema_that_expands_too_far_is_refused_before_it_is_built(code):
    nested: dict = {"type": "string"}
    for _ in range(6):  # 32 ** 6 values: building them first would not end
        nested = {"type": "array", "items": nested, "maxItems": 32}
    with pytest.raises(StructuredOutputError, match="expands to more than"):
        _plan(code, {"type": "object", "properties": {"a": nested}})


def _aligned(plan, tokens: list[int]) -> bool:
    """Whether `tokens` are the plan's template with its holes filled by allowed tokens (end padding aside)."""
    head = plan.template[: len(tokens)]
    pinned = all(t == p for t, p in zip(tokens, head, strict=True) if p is not None)
    allowed = all(bool(plan.allowed[k][t]) for k, t in enumerate(tokens) if head[k] is None)
    return len(head) == len(tokens) and pinned and allowed and all(p is not None for p in plan.template[len(tokens) :])


def test_a_draft_sizes_the_template_as_the_tokenizer_splits_the_answer():
    from dgemma.structured import schema_plan
    from dgemma.tasks import extract

    if not (extract.MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the extraction model is not shipped")
    model, tok = dgemma.load(extract.MODEL_DIR, dtype="fp32"), dgemma.Tokenizer.from_dir(extract.MODEL_DIR)
    base = schema_plan(sizes_of(model), tok, extract.SCHEMA)
    for seed in range(20):
        answer = extract.answer(extract.example(seed)[1])
        plan = base.resize(f"some text {answer} and more")  # the draft's first object sizes the holes
        tokens = tok.encode(answer, add_special_tokens=False)
        assert _aligned(plan, tokens), answer  # "," closing a string and opening a key is one pinned token
        assert read_answer(model, plan, [], tokens + plan.template[len(tokens) :]) == (json.loads(answer), None)
        assert not _aligned(base, tokens)  # the schema's budgets alone do not split the answer so


def test_draft_values_of_the_wrong_type_or_out_of_bounds_keep_the_schema_layout(code):
    model, tok = code
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1000, "maximum": 9999},
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
    }
    plan = compile_schema(schema, tok, model.text_config.vocab_size, model.config.canvas_length, 1)
    sized = compile_schema(
        schema, tok, model.text_config.vocab_size, model.config.canvas_length, 1,
        draft={"id": 99999, "name": 7, "tags": ["a", "b", "c", "d", "e"]},
    )  # fmt: skip
    ids, names, tags = (n for _, n in sized.root.properties)
    assert ids.shape is None and names.length is None  # an id of 5 digits, a name that is no string
    assert len(tags.items) == 3 and all(t.length == 1 for t in tags.items)  # the count capped at maxItems
    assert [h[0] for h in sized.holes[:2]] == [h[0] for h in plan.holes[:2]]  # the same holes


def test_a_broken_draft_still_sizes_the_values_it_holds(code):
    from dgemma.structured import schema_plan

    model, tok = code
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    plan = schema_plan(sizes_of(model), tok, schema).resize(
        '{"a":"xyz", "b": 42 oops'
    )  # not an object: read key by key
    a, b = (n for _, n in plan.root.properties)
    assert a.length == len(tok.encode("xyz", add_special_tokens=False)) and b.shape is not None
    with pytest.raises(ValueError, match="size"):
        generate_json(model, "x = ", schema, tokenizer=tok, size="guess")
    out = generate_json(model, "x = ", schema, tokenizer=tok, seed=0, size="schema", **KW)
    jsonschema.validate(out.value, schema)
