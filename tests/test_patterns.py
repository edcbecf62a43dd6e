"""A string's `pattern` and the formats email, hostname, ipv4 and ipv6: valid by construction, checked by
the libraries that define the formats (email-validator through Pydantic's EmailStr, fqdn, ipaddress), by
fills drawn at random from the holes' allowed tokens, and by the reader's choice under the fill's scores."""

from __future__ import annotations

import ipaddress
import random
import re

import fqdn
import jsonschema
import pytest
from pydantic import BaseModel, EmailStr

import dgemma
from dgemma.generation.programs import generate_json
from dgemma.structured import StructuredOutputError, compile_schema
from dgemma.structured.nodes import _Layout, _Read, grammar_state
from dgemma.structured.plans import _classes
from dgemma.structured.regex import REGEX_FORMATS, Automaton, regex_string
from dgemma.structured.schema import build
from dgemma.tasks.code import MODEL_DIR

KW = dict(max_denoising_steps=6)
PATTERNS = [
    r"^[A-Z]{2}-\d{4}$",  # fixed length
    r"^\d{3}-\d{3}-\d{4}$",
    r"^[a-z]+(-[a-z]+)*$",  # variable repetitions
    r"^(cat|dog)s?$",  # alternation
    r"^[^0-9 ]{2,8}$",  # a negated class
    r"^v\d+\.\d+(\.\d+)?$",
    r"(ab)+",  # unanchored: a whole match matches too; even lengths only
]


@pytest.fixture(scope="module")
def code():
    return dgemma.load(MODEL_DIR, dtype="fp32"), dgemma.Tokenizer.from_dir(MODEL_DIR)


def _one(prop: dict) -> dict:
    return {"type": "object", "properties": {"v": prop}, "required": ["v"], "additionalProperties": False}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_are_valid_by_construction(code, pattern):
    model, tok = code
    for seed in range(2):
        for size in ("draft", "schema"):
            out = generate_json(
                model, "# a record\nrecord = ", _one({"type": "string", "pattern": pattern}),
                tokenizer=tok, seed=seed, retries=0, size=size, **KW,
            )  # fmt: skip
            assert re.search(pattern, out.value["v"]), out.value


class Contact(BaseModel):
    email: EmailStr
    server: ipaddress.IPv4Address
    link: ipaddress.IPv6Address


def test_formats_are_valid_by_the_libraries_that_define_them(code):
    """Pydantic reads EmailStr with email-validator; jsonschema checks ipv4/ipv6 with ipaddress and
    hostname with fqdn."""
    model, tok = code
    checker = jsonschema.FormatChecker()
    for seed in range(3):
        out = generate_json(model, "# contact\n", Contact.model_json_schema(), tokenizer=tok, seed=seed, **KW)
        Contact.model_validate(out.value)
        host = generate_json(model, "# host\n", _one({"type": "string", "format": "hostname"}), tokenizer=tok,
                             seed=seed, retries=0, **KW).value["v"]  # fmt: skip
        assert fqdn.FQDN(host, min_labels=1).is_valid and checker.conforms(host, "hostname"), host


def _layout(code, node, syntax=None):
    model, tok = code
    b = _Layout(_classes(tok, model.text_config.vocab_size), **({} if syntax is None else {"syntax": syntax}))
    node.layout(b)
    b.flush()
    return b


@pytest.mark.parametrize("pattern", [*PATTERNS, *(p for p, _ in REGEX_FORMATS.values())])
def test_any_fill_of_the_holes_is_read_as_a_match(code, pattern):
    """Whatever the sampler puts in the holes (here: tokens drawn at random from each position's allowed
    set), the reader gives a string the pattern matches, within the length bounds."""
    node = regex_string(pattern, 0, 24 if "+" in pattern or "*" in pattern else None)
    b = _layout(code, node)
    rng = random.Random(0)
    for _ in range(150):
        tokens = [t if t is not None else rng.choice(m.nonzero().flatten().tolist()) for t, m in
                  zip(b.template, b.allowed, strict=True)]  # fmt: skip
        value = node.read(_Read(tokens, b.classes, lambda position, options: 0))
        assert re.fullmatch(pattern.strip("^$"), value) and len(value) <= node.max_length, value


def test_a_fill_that_does_not_match_is_read_as_the_likeliest_match(code):
    """`cog` matches neither `cat` nor `dog`: without scores the nearest (one character away) is read;
    with the fill's scores, the likeliest. The reader never asks the model (no Score calls)."""
    node = regex_string(r"^(cat|dog)$", 0, None)
    b = _layout(code, node)
    ids = {ch: b.classes.single_chars[ch] for ch in "cogatd"}
    start = b.template.index(None)
    tokens = list(b.template)
    tokens[start : start + 3] = [ids["c"], ids["o"], ids["g"]]

    def never(position, options):
        raise AssertionError("no model call")

    assert node.read(_Read(tokens, b.classes, never)) == "dog"
    scores = {
        start: {ids["c"]: -0.1, ids["d"]: -5.0},
        start + 1: {ids["o"]: -0.1},
        start + 2: {ids["g"]: -0.1, ids["t"]: -0.2},
    }
    assert node.read(_Read(tokens, b.classes, never, scores.get)) == "cat"


def test_the_left_to_right_grammar_follows_the_pattern():
    root = build(_one({"type": "string", "pattern": r"^[a-z]+(-[a-z]+)*$", "maxLength": 10}))
    assert grammar_state(root, '{"v":"ab-c') == (True, False)
    assert grammar_state(root, '{"v":"ab-c"}') == (False, True)
    assert grammar_state(root, '{"v":"ab--') == (False, False)
    assert grammar_state(root, '{"v":"abcdefghijk') == (False, False)  # past maxLength


def test_automaton_agrees_with_re_on_random_strings():
    rng = random.Random(1)
    for pattern in [*PATTERNS, *(p for p, _ in REGEX_FORMATS.values())]:
        a = Automaton(pattern)
        for _ in range(300):
            text = "".join(rng.choice("abcdogst-.:@0123456789fAZ ") for _ in range(rng.randint(0, 12)))
            assert a.matches(text) == bool(re.fullmatch(pattern.strip("^$"), text)), (pattern, text)


@pytest.mark.parametrize(
    "prop, message",
    [
        ({"pattern": r"^(?=a)\w+$"}, "assert is not supported"),
        ({"pattern": r"^(a)\1$"}, "groupref is not supported"),
        ({"pattern": r"(?i)^abc$"}, "inline flags are not supported"),
        ({"pattern": r'^"\d$'}, "needs a character a string escapes"),
        ({"pattern": r"\d{1000000}"}, "writes out to more than"),  # refused as it is written out
        ({"pattern": r"(a?){2000}"}, "has more than 65536 transitions"),  # each copy may follow every other
        ({"pattern": r"^\d{200}$"}, "has no match of 0 to"),
        ({"pattern": "[a-z]", "maxLength": 2, "minLength": 3}, "maxLength is below minLength"),
        ({"pattern": "[a-z]+", "format": "email"}, "pattern and format do not go together"),
        ({"format": "ipvanyaddress"}, "format 'ipvanyaddress' is not supported"),
        ({"pattern": "["}, "is not a 'regex'"),  # jsonschema's own check of the schema, first
    ],
)
def test_patterns_outside_the_subset_are_refused_by_name(code, prop, message):
    model, tok = code
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        compile_schema(_one({"type": "string", **prop}), tok, model.text_config.vocab_size, 256, 1)
