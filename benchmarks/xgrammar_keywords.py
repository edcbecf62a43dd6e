"""Which JSON-schema keywords xgrammar (vLLM's default grammar engine, for autoregressive models) compiles
and enforces: per keyword a schema, then a valid and an invalid instance checked against its grammar (compact
separators). The column "vLLM + xgrammar (AR models)" of docs/structured.md's keyword table comes from this.

    pip install --no-deps xgrammar apache-tvm-ffi && python benchmarks/xgrammar_keywords.py

Not a dependency of dgemma or of its tests: a measurement of another engine. Prints one line per keyword and
ends with one JSON line.
"""

from __future__ import annotations

import json

import xgrammar as xg
from xgrammar.testing import _is_grammar_accept_string as accepts


def field(**schema) -> dict:
    return {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}


def defs(root: dict, **definitions) -> dict:
    return {"$defs": definitions, **root}


NODE = {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/N"}}}, "required": ["c"]}
CASES = {  # keyword: (schema, a valid instance, an invalid one)
    "anyOf": (field(anyOf=[{"type": "string"}, {"type": "null"}]), '{"a":null}', '{"a":1}'),
    "type array": (field(type=["string", "null"]), '{"a":"x"}', '{"a":1}'),
    "oneOf": (field(oneOf=[{"type": "string"}, {"type": "integer"}]), '{"a":1}', '{"a":true}'),
    "$defs + $ref": (defs(field(**{"$ref": "#/$defs/X"}), X={"type": "integer"}), '{"a":1}', '{"a":"x"}'),
    "recursive $ref": (defs({"$ref": "#/$defs/N"}, N=NODE), '{"c":[{"c":[]}]}', '{"c":[{"d":1}]}'),
    "pattern": (field(type="string", pattern="^[a-z]+$"), '{"a":"abc"}', '{"a":"AB1"}'),
    "format date": (field(type="string", format="date"), '{"a":"2024-05-01"}', '{"a":"2024-13-45"}'),
    "format date-time": (field(type="string", format="date-time"), '{"a":"2024-05-01T10:00:00Z"}', '{"a":"x"}'),
    "format time": (field(type="string", format="time"), '{"a":"10:00:00Z"}', '{"a":"25:99"}'),
    "format duration": (field(type="string", format="duration"), '{"a":"P3D"}', '{"a":"3 days"}'),
    "format email": (field(type="string", format="email"), '{"a":"a@b.co"}', '{"a":"not an email"}'),
    "format hostname": (field(type="string", format="hostname"), '{"a":"example.com"}', '{"a":"exa mple"}'),
    "format ipv4": (field(type="string", format="ipv4"), '{"a":"10.0.0.1"}', '{"a":"999.1.1.1"}'),
    "format ipv6": (field(type="string", format="ipv6"), '{"a":"::1"}', '{"a":"1.2.3"}'),
    "format uuid": (field(type="string", format="uuid"), '{"a":"123e4567-e89b-12d3-a456-426614174000"}', '{"a":"x"}'),
    "minLength/maxLength": (field(type="string", minLength=2, maxLength=5), '{"a":"abc"}', '{"a":"abcdefgh"}'),
    "minimum/maximum (integer)": (field(type="integer", minimum=1, maximum=9), '{"a":5}', '{"a":12}'),
    "minimum/maximum (number)": (field(type="number", minimum=0.5, maximum=9.5), '{"a":5.5}', '{"a":12.5}'),
    "exclusiveMinimum/Maximum": (field(type="integer", exclusiveMinimum=0, exclusiveMaximum=9), '{"a":5}', '{"a":9}'),
    "multipleOf": (field(type="integer", multipleOf=3), '{"a":6}', '{"a":7}'),
    "minItems/maxItems": (
        field(type="array", items={"type": "integer"}, minItems=1, maxItems=3),
        '{"a":[1]}',
        '{"a":[]}',
    ),
    "enum": (field(enum=["x", "y"]), '{"a":"x"}', '{"a":"z"}'),
    "allOf": (field(allOf=[{"type": "string"}]), '{"a":"x"}', '{"a":1}'),
}


def main() -> None:
    results = {}
    for name, (schema, good, bad) in CASES.items():
        try:
            grammar = xg.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=True, separators=(",", ":")
            )
        except Exception as e:  # a keyword it refuses is a row of the table
            results[name] = "refused: " + str(e).splitlines()[0][:80]
        else:
            enforced = accepts(grammar, good) and not accepts(grammar, bad)
            results[name] = "enforced" if enforced else "compiles, not enforced"
        print(f"{name}: {results[name]}")
    print(json.dumps({"benchmark": "xgrammar_keywords", "results": results}))


if __name__ == "__main__":
    main()
