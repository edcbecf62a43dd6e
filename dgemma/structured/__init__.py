"""Structured output: JSON that parses and validates against a schema by construction.

A left-to-right engine constrains its output with a grammar automaton, token by token. A canvas model can
lay the structure out first and denoise only the values, with the whole answer in view. A plan here
(`schema_plan`; run by `dgemma.generate_json`, whose program is in dgemma/programs.py) compiles a
JSON schema into a template (dgemma.fill) and per-position allowed tokens
(dgemma.constraints), sized by a free draft of the answer (`JsonPlan.resize`):

    {"name":"<2 string tokens>","age":<1 token of 2 digits>,"tags":["<1>","<3>"],"ok":<true or false>}

- keys, punctuation and fixed literals (`const`, `null`, a one-value `enum`) are pinned, in compact JSON,
  each run of them from one value to the next (a string's closing quote included) tokenized as one
  text, so the template is split as the tokenizer splits such an answer;
- a value the draft holds with the schema's type and bounds sizes its hole: a string's n tokens are n
  positions of string tokens (no quote, backslash or control character); a number keeps its sign and,
  per token, a position for any token of as many digits (or the dot); an `enum`/`boolean` holds the
  options spelled in as many tokens as the drafted one; an array keeps its count of items;
- any other value keeps the schema's layout, where the model closes the value itself: a string's
  characters or a quote-led token, which closes it; a number's digits (a minus first, a dot inside for
  `number`) or a token that can follow a number (`,` `}` `]` or whitespace); what the hole holds after
  the closing token is dropped. A hole's length is its budget: `maxLength` + 1 for a string (at most
  `MAX_STRING_TOKENS`, `DEFAULT_STRING_TOKENS` without one), the digits `minimum` and `maximum` allow
  for a number; an array has `maxItems` slots (`DEFAULT_MAX_ITEMS` without one), the first `minItems`
  joined by pinned commas, each later one after a one-token hole that is a comma (another item) or a
  `]` (the end); `size="schema"` lays every value out so;
- a fill of an `enum` or `boolean` that spells no option is decided by the encoder's log-probability
  of each option after the JSON before it (as `choices` are scored);
- the template is followed by end-of-text pins to the end of its canvas; a template longer than a
  canvas continues in the next ones.

The values are read back from the filled holes and the JSON is written from them (`json.dumps`), so it
always parses and has the schema's shape; what a shape cannot guarantee (`minLength`, `minimum`,
`maximum`, a lone minus sign) is checked with `jsonschema`, and a failing answer is filled again with the
next seed, up to `retries` times, before `StructuredOutputError`. `generate_json_ar` is the same schema
decoded left to right under its grammar (`grammar_state`), the baseline a grammar engine gives.

Supported keywords: `type` (object, array, string, integer, number, boolean, null), `properties`,
`required`, `additionalProperties` (false or true: only the declared properties are written, all of
them), `items`, `minItems`, `maxItems`, `enum`, `const`, `minLength`, `maxLength`, `minimum`,
`maximum`, `exclusiveMinimum`, `exclusiveMaximum`, and the annotations (`title`, `description`, ...).
Anything else (`pattern`, `format`, `anyOf`, `$ref`, ...) is refused by name, never ignored. String
characters are those of whole tokens: a character the tokenizer only spells in byte pieces cannot be
written.
"""

from __future__ import annotations

from .left_to_right import decode_grammar, generate_json_ar
from .nodes import MORE, grammar_state
from .plans import (
    MAX_VALUES,
    SMALL_RANGE,
    JsonPlan,
    JsonResult,
    compile_schema,
    first_object,
    object_plan,
    schema_plan,
    tool_call_plan,
    unsatisfied,
)
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

__all__ = [
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_RETRIES",
    "DEFAULT_STRING_TOKENS",
    "GEMMA_ARGUMENTS",
    "JSON",
    "MAX_DEPTH",
    "MAX_ITEMS",
    "MAX_STRING_TOKENS",
    "MAX_TEMPLATE_TOKENS",
    "MAX_VALUES",
    "MORE",
    "SMALL_RANGE",
    "JsonPlan",
    "JsonResult",
    "StructuredOutputError",
    "Syntax",
    "TokenClasses",
    "compile_schema",
    "decode_grammar",
    "first_object",
    "generate_json_ar",
    "grammar_state",
    "json_text",
    "object_plan",
    "schema_plan",
    "tool_call_plan",
    "unsatisfied",
]
