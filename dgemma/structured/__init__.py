"""Structured output: JSON that parses and validates against a schema by construction (docs/structured.md).

A plan (`schema_plan`) compiles a JSON schema into a template of pinned keys and punctuation with
constrained holes (dgemma.fill, dgemma.generation.loop), sized by a free draft of the answer; the values are
read back and written with `json.dumps`, checked with `jsonschema`, and retried with the next seed. Its
program is `dgemma.generation.programs.json_program`. A leaf below the canvas loop: it takes a tokenizer and
a model's sizes (`Sizes`), never a model. Modules: tokens.py (token classes, limits), nodes.py (the schema's
tree and its grammar), schema.py (a schema checked and built into that tree; its unions), plans.py
(templates, reading); the grammar-constrained autoregressive baseline is
dgemma/ar.py.
"""

from __future__ import annotations

from .nodes import MORE, grammar_state
from .plans import (
    JsonPlan,
    Sizes,
    compile_schema,
    first_object,
    object_plan,
    schema_plan,
    tool_call_plan,
    unsatisfied,
)
from .schema import MAX_VALUES, REF_DEPTH, SMALL_RANGE
from .tokens import (
    DEFAULT_MAX_ITEMS,
    DEFAULT_RETRIES,
    DEFAULT_STRING_TOKENS,
    GEMMA_ARGUMENTS,
    JSON,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_STRING_TOKENS,
    MAX_TEMPLATE_TOKENS,
    StructuredOutputError,
    Syntax,
    TokenClasses,
    json_text,
)
