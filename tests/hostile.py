"""Requests that once took the server down or made it misbehave (issue 21), and how to replay them.

Each is (name, path, body, the statuses it may get): the body is raw bytes, or a JSON value to send as it
is (surrogates included: json.dumps writes them as `\\ud800` escapes). Shared by the fuzz test (each one,
once) and benchmarks/serve_hostile.py (all of them, from 32 concurrent clients, with streams running).
DIALECTS holds the same for the routes of the other dialects (issue 57), each with the field its error names;
dialect_error reads an error body in the shape of the dialect a route speaks.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import httpx

from dgemma.server.protocol import dialect_of

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_NESTED_ARRAYS: dict = {"type": "string"}
for _ in range(6):  # a small schema that would expand to 32**6 values
    _NESTED_ARRAYS = {"type": "array", "items": _NESTED_ARRAYS, "maxItems": 32}
USER = [{"role": "user", "content": "x"}]


def _nested(depth: int, leaf: object, key: str | None = None) -> object:
    """`leaf` inside `depth` lists (or objects under `key`)."""
    for _ in range(depth):
        leaf = [leaf] if key is None else {key: leaf}
    return leaf


def _tool(function: object) -> dict:
    return {"type": "function", "function": function}


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _replayed(function: object) -> list[dict]:
    """A conversation replaying an assistant's tool call whose `function` is this, and its answer."""
    call = {"id": "c1", "type": "function", "function": function}
    return [*USER, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "1"}]


_F = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
_FORCED = {"tool_choice": {"type": "function", "function": {"name": "f"}}}
_DEEP_PROPERTIES = _nested(120, {"type": "string"}, "properties")
_IN_SYSTEM = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}

# Issue 40: the free-form parts of a request (tools, replayed tool calls, schemas), non-finite numbers
# anywhere in a body, and image parts in roles that hold text only. Each is a 400 naming PARAMS[name].
ISSUE_40: list[tuple[str, str, object, tuple[int, ...]]] = [
    (f"a tool named {name!r}", CHAT, {"messages": USER, "tools": [_tool({"name": name})]}, (400,))
    for name in (5, None, ["f"], {"a": 1}, True)
] + [
    (f"a replayed call named {name!r}", CHAT, {"messages": _replayed({"name": name, "arguments": "{}"})}, (400,))
    for name in (7, None, ["f"], 1.5)
] + [
    ("tools[].function a string, tool_choice named", CHAT, {"messages": USER, "tools": [_tool("f")], **_FORCED}, (400,)),
    ("tools[].function a list, tool_choice named", CHAT, {"messages": USER, "tools": [_tool(["f"])], **_FORCED}, (400,)),
    ("tools[] a string", CHAT, {"messages": USER, "tools": ["f"], "tool_choice": "required"}, (400,)),
    ("a tool description of nested lists", CHAT, {"messages": USER, "tools": [_tool({**_F, "description": _nested(150, "d")})]}, (400,)),
    ("tool parameters nested 120 deep", CHAT, {"messages": USER, "tools": [_tool({"name": "f", "parameters": _DEEP_PROPERTIES})]}, (400,)),
    ("tool parameters nested 40 deep", CHAT, {"messages": USER, "tools": [_tool({"name": "f", "parameters": _nested(40, {}, "properties")})]}, (400,)),
    ("replayed arguments 200 deep", CHAT, {"messages": _replayed({"name": "f", "arguments": _nested(200, 1, "a")})}, (400,)),
    ("replayed arguments text 40 deep", CHAT, {"messages": _replayed({"name": "f", "arguments": json.dumps(_nested(40, 1, "a"))})}, (400,)),
    ("replayed arguments text [ x 1e5", CHAT, {"messages": _replayed({"name": "f", "arguments": "[" * 100_000})}, (400,)),
    ("replayed arguments text of a 5000-digit integer", CHAT, {"messages": _replayed({"name": "f", "arguments": '{"a": ' + "9" * 5000 + "}"})}, (400,)),
    ("replayed arguments text holding NaN", CHAT, {"messages": _replayed({"name": "f", "arguments": '{"a": NaN}'})}, (400,)),
    ("replayed arguments text holding 1e400", CHAT, {"messages": _replayed({"name": "f", "arguments": '{"a": -1e400}'})}, (400,)),
    ("replayed arguments a number", CHAT, {"messages": _replayed({"name": "f", "arguments": 5})}, (400,)),
    ("a schema maximum of 1e400", CHAT, {"messages": USER, "response_format": _schema({"type": "number", "maximum": 1e400})}, (400,)),
    ("a schema minimum of -1e400", CHAT, {"messages": USER, "response_format": _schema({"type": "integer", "minimum": -1e400})}, (400,)),
    ("a schema bound of a 400-digit integer", CHAT, {"messages": USER, "response_format": _schema({"type": "integer", "maximum": 10**400})}, (400,)),
    ("a schema bound of a 5000-digit integer", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "maximum": ' + b"9" * 5000 + b"}}}}", (400,)),
    ("a forced tool's bound of 1e400", CHAT, {"messages": USER, "tools": [_tool({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "number", "maximum": 1e400}}}})], **_FORCED}, (400,)),
    ("a schema const NaN", CHAT, {"messages": USER, "response_format": _schema({"type": "object", "properties": {"a": {"const": float("nan")}}})}, (400,)),
    ("a schema enum holding Infinity", CHAT, {"messages": USER, "response_format": _schema({"type": "object", "properties": {"a": {"enum": [1, float("inf")]}}})}, (400,)),
    ("a schema enum holding -Infinity", CHAT, {"messages": USER, "response_format": _schema({"enum": [float("-inf")]})}, (400,)),
    ("NaN in a completion's seed", COMPLETIONS, b'{"prompt": "a", "seed": NaN}', (400,)),
    ("Infinity deep in a message", CHAT, b'{"messages": [{"role": "user", "content": "x", "name": Infinity}]}', (400,)),
    ("an image part in a system message", CHAT, {"messages": [{"role": "system", "content": [_IN_SYSTEM]}, *USER]}, (400,)),
    ("an image part in a tool message", CHAT, {"messages": [*_replayed({"name": "f", "arguments": "{}"})[:2], {"role": "tool", "tool_call_id": "c1", "content": [_IN_SYSTEM]}]}, (400,)),
    ("an image part in an assistant message", CHAT, {"messages": [*USER, {"role": "assistant", "content": [_IN_SYSTEM]}, *USER]}, (400,)),
    ("a system part that is not text", CHAT, {"messages": [{"role": "system", "content": [{"type": "audio"}]}, *USER]}, (400,)),
    ("a canvas scored after a prompt id out of range", "/v1/canvas/score", {"prompt": [10**6], "canvas": [1]}, (400,)),
]  # fmt: skip

_CHAIN: dict = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(700)} | {"d700": {"type": "string"}}}
_CHAIN |= {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "required": ["a"]}


def _one(schema: dict) -> dict:
    """`schema` as the one required property of an object."""
    return {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}


def _params(parameters: object) -> dict:
    """A forced call of one function with these parameters."""
    return {"messages": USER, "tools": [_tool({"name": "f", "parameters": parameters})], **_FORCED}


# Issue 55: schemas and tools that ask for unbounded work or have no answer, and fields of the wrong JSON
# type. Each is a 400 before any model pass, naming PARAMS[name].
_SCHEMAS_55 = {
    "a schema minLength of 1e8": _one({"type": "string", "minLength": 10**8}),
    "a schema minLength of 2**40": _one({"type": "string", "minLength": 2**40}),
    "a schema $ref chain 700 long": _CHAIN,
    "a schema multipleOf of 5e-324": _one({"type": "number", "multipleOf": 5e-324}),
    "a schema multipleOf of 1e-308": _one({"type": "number", "multipleOf": 1e-308}),
    "a schema allOf around 32**4 arrays": {"allOf": [_NESTED_ARRAYS]},
    "a schema number minimum above maximum": _one({"type": "number", "minimum": 2, "maximum": 1}),
    "a schema number of equal exclusive bounds": _one(
        {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 0.5}
    ),
    "a schema integer range without an integer": _one({"type": "integer", "minimum": 0.2, "maximum": 0.8}),
    "a schema pattern with $ inside": _one({"type": "string", "pattern": "ab$cd"}),
    "a schema pattern with \\b inside": _one({"type": "string", "pattern": r"a\bb"}),
}
ISSUE_55: list[tuple[str, str, object, tuple[int, ...]]] = [
    (name, CHAT, {"messages": USER, "response_format": _schema(schema)}, (400,)) for name, schema in _SCHEMAS_55.items()
] + [
    (f"tool parameters of type {kind}", CHAT, _params({"type": kind}), (400,)) for kind in ("string", "integer", "array")
] + [
    ("tool parameters a string", CHAT, _params("a string"), (400,)),
    ("a tool enum option holding the call quote", CHAT, _params(_one({"enum": ['a<|"|>b', "c"]})), (400,)),
    ("a tool const holding a call's end", CHAT, _params(_one({"const": "x<tool_call|>"})), (400,)),
    ("a tool property named with the call quote", CHAT, _params({"type": "object", "properties": {'k<|"|>': {"type": "string"}}}), (400,)),
    ("strict 'yes'", CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": _one({"type": "string"})}}}, (400,)),
    ("retries true", CHAT, {"messages": USER, "response_format": _schema(_one({"type": "string"})), "retries": True}, (400,)),
    ("include_usage 'yes'", CHAT, {"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}}, (400,)),
    ("parallel_tool_calls 'yes'", CHAT, {"messages": USER, "tools": [_tool(_F)], "parallel_tool_calls": "yes"}, (400,)),
    ("a canvas of booleans", "/v1/canvas/score", {"prompt": [2], "canvas": [True, False]}, (400,)),
    ("n of 2.0", CHAT, {"messages": USER, "n": 2.0}, (400,)),
]  # fmt: skip

# Issue 56: errors knowable before the first model pass, each a 400 naming its field, streamed or not
_JSON_OBJECT: dict = {"type": "json_object"}
_ISSUE_56 = {
    "mode exact with a schema": (CHAT, {"messages": USER, "mode": "exact", "response_format": _schema(_one({"type": "string"}))}, "mode"),
    "mode exact with a suffix": (COMPLETIONS, {"prompt": "a", "suffix": "b", "mode": "exact"}, "mode"),
    "tool_choice auto with max_tokens 1": (CHAT, {"messages": USER, "tools": [_tool(_F)], "tool_choice": "auto", "max_tokens": 1}, "max_tokens"),
    "a JSON object with max_tokens 1": (CHAT, {"messages": USER, "response_format": _JSON_OBJECT, "max_tokens": 1}, "max_tokens"),
}  # fmt: skip
ISSUE_56: list[tuple[str, str, object, tuple[int, ...]]] = [
    (f"{name}{how}", path, {**body, **streamed}, (400,))
    for name, (path, body, _) in _ISSUE_56.items()
    for how, streamed in (("", {}), (", streamed", {"stream": True}))
]

# the field each of those names (the error's `param` starts with it: a bound deep in a value names the path)
PARAMS = {
    **{name: "response_format.json_schema.schema" for name in _SCHEMAS_55},
    **{f"tool parameters of type {kind}": "tools.0.function.parameters" for kind in ("string", "integer", "array")},
    "tool parameters a string": "tools.0.function.parameters",
    "a tool enum option holding the call quote": "tools.0.function.parameters",
    "a tool const holding a call's end": "tools.0.function.parameters",
    "a tool property named with the call quote": "tools.0.function.parameters",
    "strict 'yes'": "response_format.json_schema.strict",
    "retries true": "retries",
    "include_usage 'yes'": "stream_options.include_usage",
    "parallel_tool_calls 'yes'": "parallel_tool_calls",
    "a canvas of booleans": "canvas",
    "n of 2.0": "n",
    **{f"a tool named {n!r}": "tools.0.function.name" for n in (5, None, ["f"], {"a": 1}, True)},
    **{f"a replayed call named {n!r}": "messages.1.tool_calls.0.function.name" for n in (7, None, ["f"], 1.5)},
    "tools[].function a string, tool_choice named": "tools.0.function",
    "a tool description of nested lists": "tools.0.function.description",
    "tool parameters nested 120 deep": "tools.0.function.parameters",
    "replayed arguments 200 deep": "messages.1.tool_calls.0.function.arguments",
    "tool parameters nested 40 deep": "tools.0.function.parameters",
    "replayed arguments text 40 deep": "messages.1.tool_calls.0.function.arguments",
    "replayed arguments text [ x 1e5": "messages.1.tool_calls.0.function.arguments",
    "replayed arguments text of a 5000-digit integer": "messages.1.tool_calls.0.function.arguments",
    "replayed arguments text holding NaN": "messages.1.tool_calls.0.function.arguments",
    "a schema maximum of 1e400": "response_format.json_schema.schema.maximum",
    "a schema bound of a 5000-digit integer": "response_format.json_schema.schema.maximum",
    "a schema const NaN": "response_format.json_schema.schema.properties.a.const",
    "a schema enum holding Infinity": "response_format.json_schema.schema.properties.a.enum.1",
    "NaN in a completion's seed": "seed",
    "Infinity deep in a message": "messages.0.name",
    "an image part in a system message": "messages.0.content",
    "a canvas scored after a prompt id out of range": "prompt",
    **{f"{name}{how}": param for name, (_, _, param) in _ISSUE_56.items() for how in ("", ", streamed")},
}

HOSTILE: list[tuple[str, str, object, tuple[int, ...]]] = [
    ("100 MB body", CHAT, b'{"messages": [{"role": "user", "content": "' + b"a" * 100_000_000 + b'"}]}', (413,)),
    ("a million messages", CHAT, {"messages": [{"role": "user", "content": ""}] * 1_000_000}, (400, 413)),
    ("3000 messages", CHAT, {"messages": USER * 3000}, (400,)),
    ("a prompt longer than any context", CHAT, {"messages": [{"role": "user", "content": "w " * 1_000_000}]}, (400,)),
    ("stability_threshold 2e6", CHAT, {"messages": USER, "stability_threshold": 2_000_000}, (400,)),
    ("stability_threshold 1e9", CHAT, {"messages": USER, "stability_threshold": 1e9}, (400,)),
    ("t_max Infinity", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "t_max": Infinity}', (400,)),
    ("confidence_threshold 1e308", CHAT, {"messages": USER, "confidence_threshold": 1e308}, (400,)),
    ("max_denoising_steps 1e6", CHAT, {"messages": USER, "max_denoising_steps": 10**6}, (400,)),
    ("max_tokens 1e7", CHAT, {"messages": USER, "max_tokens": 10**7}, (400,)),
    ("lone surrogate in a message", CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, (400,)),
    ("lone surrogate in a prompt", COMPLETIONS, {"prompt": "\ud800"}, (400,)),
    ("lone surrogate in a suffix", COMPLETIONS, {"prompt": "a", "suffix": "\udfff"}, (400,)),
    ("lone surrogate in a tool", CHAT, {"messages": USER, "tools": [{"name": "\ud800"}]}, (400,)),
    ("invalid UTF-8", CHAT, b'{"messages": "\xff\xfe\xfd"}', (400,)),
    ("nested 100000 deep", CHAT, b"[" * 100_000 + b"]" * 100_000, (400,)),
    ("not an object", CHAT, b"[1, 2, 3]", (400,)),
    ("t_min above t_max, streaming", CHAT, {"messages": USER, "t_min": 0.9, "t_max": 0.5, "stream": True}, (400,)),
    ("n above the capacity", COMPLETIONS, {"prompt": ["a"] * 64, "n": 8, "max_tokens": 1}, (400,)),
    ("response_format yaml", CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, (400,)),
    (
        "a json schema of 32**6 values",
        CHAT,
        {
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _NESTED_ARRAYS}},
        },
        (400,),
    ),
    (
        "a json schema 100 deep",
        CHAT,
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "a": [
                            [
                                [
                                    [
                                        [
                                            [
                                                [
                                                    [
                                                        [
                                                            [
                                                                [
                                                                    [
                                                                        [
                                                                            [
                                                                                [
                                                                                    [
                                                                                        [
                                                                                            [
                                                                                                [
                                                                                                    [
                                                                                                        [
                                                                                                            [
                                                                                                                [
                                                                                                                    [
                                                                                                                        [
                                                                                                                            [
                                                                                                                                [
                                                                                                                                    [
                                                                                                                                        [
                                                                                                                                            [
                                                                                                                                                [
                                                                                                                                                    [
                                                                                                                                                        [
                                                                                                                                                            [
                                                                                                                                                                [
                                                                                                                                                                    [
                                                                                                                                                                        [
                                                                                                                                                                            [
                                                                                                                                                                                [
                                                                                                                                                                                    [
                                                                                                                                                                                        [
                                                                                                                                                                                            [
                                                                                                                                                                                                [
                                                                                                                                                                                                    [
                                                                                                                                                                                                        [
                                                                                                                                                                                                            [
                                                                                                                                                                                                                [
                                                                                                                                                                                                                    [
                                                                                                                                                                                                                        [
                                                                                                                                                                                                                            []
                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                ]
                                                                                                                                                                                                            ]
                                                                                                                                                                                                        ]
                                                                                                                                                                                                    ]
                                                                                                                                                                                                ]
                                                                                                                                                                                            ]
                                                                                                                                                                                        ]
                                                                                                                                                                                    ]
                                                                                                                                                                                ]
                                                                                                                                                                            ]
                                                                                                                                                                        ]
                                                                                                                                                                    ]
                                                                                                                                                                ]
                                                                                                                                                            ]
                                                                                                                                                        ]
                                                                                                                                                    ]
                                                                                                                                                ]
                                                                                                                                            ]
                                                                                                                                        ]
                                                                                                                                    ]
                                                                                                                                ]
                                                                                                                            ]
                                                                                                                        ]
                                                                                                                    ]
                                                                                                                ]
                                                                                                            ]
                                                                                                        ]
                                                                                                    ]
                                                                                                ]
                                                                                            ]
                                                                                        ]
                                                                                    ]
                                                                                ]
                                                                            ]
                                                                        ]
                                                                    ]
                                                                ]
                                                            ]
                                                        ]
                                                    ]
                                                ]
                                            ]
                                        ]
                                    ]
                                ]
                            ]
                        ]
                    },
                },
            },
        },
        (400,),
    ),
    ("top_logprobs 1e9", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 10**9}, (400,)),
    ("logprobs 1e9", COMPLETIONS, {"prompt": "a", "logprobs": 10**9}, (400,)),
    ("a canvas to score of 1e5 tokens", "/v1/canvas/score", {"prompt": [2], "canvas": [1] * 100_000}, (400,)),
    ("logit_bias", CHAT, {"messages": USER, "logit_bias": {"5": 100}}, (400,)),
    ("top_p", CHAT, {"messages": USER, "top_p": 0.1}, (400,)),
    ("an unknown field", CHAT, {"messages": USER, "frobnicate": True}, (400,)),
    ("a tool message without tool support", CHAT, {"messages": [*USER, {"role": "tool", "content": "1"}]}, (400,)),
    ("seed below zero", CHAT, {"messages": USER, "seed": -1}, (400,)),
    ("an image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, (400,)),
    *ISSUE_40,
    *ISSUE_55,
    *ISSUE_56,
]

# -- issue 57: the dialect routes (Responses, Messages, Ollama, llama.cpp) ------------------------------------------
# The same classes of hostile bodies for each: nulls, wrong types, huge and nested values, unknown fields and
# missing required ones. Each is (name, path, body, the statuses it may get, the field its error names or None),
# a 4xx in the dialect's error shape (see dialect_error) that never reaches the engine.

RESPONSES, MESSAGES, COUNT_TOKENS = "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"
OLLAMA_CHAT, OLLAMA_GENERATE, OLLAMA_SHOW = "/api/chat", "/api/generate", "/api/show"
INFILL, LLAMA_COMPLETION = "/infill", "/completion"
# the routes that take a `stream` field (Ollama's streams unless it says false)
STREAMED = (RESPONSES, MESSAGES, OLLAMA_CHAT, OLLAMA_GENERATE, INFILL, LLAMA_COMPLETION)
_ARRAYS_200: dict = {"type": "string"}
_OBJECTS_200: dict = {"type": "string"}
for _ in range(200):
    _ARRAYS_200 = {"type": "array", "items": _ARRAYS_200}
    _OBJECTS_200 = {"type": "object", "properties": {"a": _OBJECTS_200}}
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAFElEQVR4nGM8wcXFgA0wYRUdtBIAse4A7AgtPbsAAAAASUVORK5CYII="  # 8x8, red

_R_CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
_R_IMAGE = "data:image/png;base64,AA"
_R_TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


def _input(**fields) -> dict:
    """A Responses body of input "x" and `fields`."""
    return {"input": "x", **fields}


def _items(*items: object) -> dict:
    return {"input": list(items)}


def _parts(*parts: dict, role: str = "user") -> dict:
    """A Responses body of one message of these content parts."""
    return _items({"role": role, "content": list(parts)})


_RESPONSES_HOSTILE: list[tuple[str, str, object, tuple[int, ...], str | None]] = [
    ("responses: no input", RESPONSES, {"model": "tiny"}, (400,), "input"),
    ("responses: input null", RESPONSES, {"input": None}, (400,), "input"),
    ("responses: input a number", RESPONSES, {"input": 5}, (400,), "input"),
    ("responses: input an object", RESPONSES, {"input": {"role": "user"}}, (400,), "input"),
    ("responses: empty input", RESPONSES, {"input": []}, (400,), "input"),
    ("responses: 3000 items", RESPONSES, {"input": USER * 3000}, (400,), "input"),
    ("responses: an item not an object", RESPONSES, _items("hi"), (400,), "input.0"),
    ("responses: an unknown item type", RESPONSES, _items({"type": "reasoning", "summary": []}), (400,), "input.0.type"),
    ("responses: an item reference", RESPONSES, _items({"type": "item_reference", "id": "x"}), (400,), "input.0.type"),
    ("responses: a message without a role", RESPONSES, _items({"content": "x"}), (400,), "input.0.role"),
    ("responses: a tool role", RESPONSES, _items({"role": "tool", "content": "x"}), (400,), "input.0.role"),
    ("responses: content a number", RESPONSES, _items({"role": "user", "content": 3}), (400,), "input.0.content"),
    ("responses: an unknown item field", RESPONSES, _items({**USER[0], "x": 1}), (400,), "input.0.x"),
    ("responses: a lone surrogate", RESPONSES, {"input": "\ud800"}, (400,), "input"),
    ("responses: a lone surrogate in a part", RESPONSES, _parts({"type": "input_text", "text": "\udfff"}), (400,), "input.0.content.0.text"),
    ("responses: a file part", RESPONSES, _parts({"type": "input_file", "file_id": "f"}), (400,), "input.0.content.0.type"),
    ("responses: an image by file id", RESPONSES, _parts({"type": "input_image", "file_id": "f", "image_url": _R_IMAGE}), (400,), "input.0.content.0.file_id"),
    ("responses: a remote image", RESPONSES, _parts({"type": "input_image", "image_url": "https://x/y.png"}), (400,), "input.0.content"),
    ("responses: an assistant's image", RESPONSES, _parts({"type": "input_image", "image_url": _R_IMAGE}, role="assistant"), (400,), "input.0.content"),
    ("responses: annotations", RESPONSES, _parts({"type": "output_text", "text": "x", "annotations": [{}]}, role="assistant"), (400,), "input.0.content.0.annotations"),
    ("responses: a call without call_id", RESPONSES, _items(*USER, {"type": "function_call", "name": "f"}), (400,), "input.1.call_id"),
    ("responses: a call with a bad name", RESPONSES, _items(*USER, {**_R_CALL, "name": "bad name"}), (400,), "input.1.name"),
    ("responses: call arguments 200 deep", RESPONSES, _items(*USER, {**_R_CALL, "arguments": json.dumps(_nested(200, 1, "a"))}), (400,), "input.1.arguments"),
    ("responses: an output without its call", RESPONSES, _items(*USER, {"type": "function_call_output", "call_id": "c9", "output": "x"}), (400,), "input"),
    ("responses: an output null", RESPONSES, _items(*USER, _R_CALL, {"type": "function_call_output", "call_id": "c1", "output": None}), (400,), "input.2.output"),
    ("responses: instructions a list", RESPONSES, _input(instructions=["a"]), (400,), "instructions"),
    ("responses: a hosted tool", RESPONSES, _input(tools=[{"type": "file_search", "vector_store_ids": []}]), (400,), "tools.0.type"),
    ("responses: a chat-shaped tool", RESPONSES, _input(tools=[_tool({"name": "f"})]), (400,), "tools.0.name"),
    ("responses: 200 tools", RESPONSES, _input(tools=[_R_TIME] * 200), (400,), "tools"),
    ("responses: tool parameters 100 deep", RESPONSES, _input(tools=[{**_R_TIME, "parameters": _nested(100, 1, "a")}]), (400,), "tools.0.parameters"),
    ("responses: a hosted tool choice", RESPONSES, _input(tool_choice={"type": "web_search_preview"}), (400,), "tool_choice"),
    ("responses: tool_choice a number", RESPONSES, _input(tool_choice=1), (400,), "tool_choice"),
    ("responses: text.format yaml", RESPONSES, _input(text={"format": {"type": "yaml"}}), (400,), "text.format.type"),
    ("responses: a schema without a name", RESPONSES, _input(text={"format": {"type": "json_schema", "schema": {}}}), (400,), "text.format.name"),
    ("responses: a schema with type text", RESPONSES, _input(text={"format": {"type": "text", "schema": {}}}), (400,), "text.format"),
    ("responses: verbosity high", RESPONSES, _input(text={"verbosity": "high"}), (400,), "text.verbosity"),
    ("responses: max_output_tokens 1e7", RESPONSES, _input(max_output_tokens=10**7), (400,), "max_output_tokens"),
    ("responses: max_output_tokens a string", RESPONSES, _input(max_output_tokens="8"), (400,), "max_output_tokens"),
    ("responses: temperature 9", RESPONSES, _input(temperature=9), (400,), "temperature"),
    ("responses: stream a string", RESPONSES, _input(stream="yes"), (400,), "stream"),
    ("responses: metadata", RESPONSES, _input(metadata={"a": "b"}), (400,), "metadata"),
    ("responses: include logprobs", RESPONSES, _input(include=["message.output_text.logprobs"]), (400,), "include"),
    ("responses: truncation auto", RESPONSES, _input(truncation="auto"), (400,), "truncation"),
    ("responses: background", RESPONSES, _input(background=True), (400,), "background"),
    ("responses: reasoning", RESPONSES, _input(reasoning={"effort": "high"}), (400,), "reasoning"),
    ("responses: conversation", RESPONSES, _input(conversation="conv_1"), (400,), "conversation"),
    ("responses: an unknown field", RESPONSES, _input(frobnicate=1), (400,), "frobnicate"),
    ("responses: an unknown dgemma setting", RESPONSES, _input(dgemma={"n": 2}), (400,), "dgemma.n"),
    ("responses: a dgemma setting out of range", RESPONSES, _input(dgemma={"max_denoising_steps": 10**6}), (400,), "dgemma.max_denoising_steps"),
    ("responses: dgemma a list", RESPONSES, _input(dgemma=[1]), (400,), "dgemma"),
    ("responses: a model that is not served", RESPONSES, _input(model="gpt-5"), (404,), "model"),
    ("responses: not an object", RESPONSES, b"[1, 2]", (400,), None),
    ("responses: nested 100000 deep", RESPONSES, b"[" * 100_000 + b"]" * 100_000, (400,), None),
    ("responses: a prompt longer than any context", RESPONSES, {"input": "w " * 1_000_000}, (400,), "input"),
]  # fmt: skip


def _blocks(*blocks: dict) -> list[dict]:
    """Anthropic messages: one user message of these content blocks."""
    return [{"role": "user", "content": list(blocks)}]


# Anthropic Messages: (name, the fields over a valid body, the field named), sent to /v1/messages and, unless
# they set a field of generation only, to /v1/messages/count_tokens
_GENERATION_ONLY = {"max_tokens", "stop_sequences", "dgemma", "top_k", "top_p"}
_ANTHROPIC_TOOL = {"name": "f", "input_schema": _F["parameters"]}
_MESSAGES: list[tuple[str, dict, str]] = [
    ("null messages", {"messages": None}, "messages"),
    ("max_tokens null", {"max_tokens": None}, "max_tokens"),
    ("max_tokens a string", {"max_tokens": "8"}, "max_tokens"),
    ("max_tokens 1e7", {"max_tokens": 10**7}, "max_tokens"),
    ("an unknown field", {"frob": 1}, "frob"),
    ("top_k", {"top_k": 5}, "top_k"),
    ("top_p 0.5", {"top_p": 0.5}, "top_p"),
    ("a role system", {"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ("a document block", {"messages": _blocks({"type": "document"})}, "messages.0.content"),
    ("an image URL", {"messages": _blocks({"type": "image", "source": {"type": "url", "url": "http://x"}})}, "messages.0.content"),
    ("a server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ("tool input_schema 200 deep", {"tools": [{"name": "f", "input_schema": _OBJECTS_200}]}, "tools.0.input_schema"),
    ("tool_choice any without tools", {"tool_choice": {"type": "any"}}, "tool_choice"),
    ("a text longer than the context", {"messages": [{"role": "user", "content": "x" * 1_000_000}]}, "messages"),
    ("stop_sequences of 100", {"stop_sequences": ["a"] * 100}, "stop_sequences"),
    ("a dgemma setting out of range", {"dgemma": {"max_denoising_steps": 10**6}}, "dgemma.max_denoising_steps"),
    ("an unknown dgemma setting", {"dgemma": {"messages": []}}, "dgemma.messages"),
    ("a lone surrogate", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("thinking with a required call", {"tools": [_ANTHROPIC_TOOL], "tool_choice": {"type": "any"}, "thinking": {"type": "enabled"}}, "thinking"),
]  # fmt: skip
_MESSAGES_HOSTILE: list[tuple[str, str, object, tuple[int, ...], str | None]] = (
    [
        (f"messages: {name}", MESSAGES, {"model": "tiny", "max_tokens": 8, "messages": USER, **fields}, (400,), param)
        for name, fields, param in _MESSAGES
    ]
    + [
        (f"count_tokens: {name}", COUNT_TOKENS, {"model": "tiny", "messages": USER, **fields}, (400,), param)
        for name, fields, param in _MESSAGES
        if not _GENERATION_ONLY & set(fields)
    ]
    + [
        ("messages: max_tokens missing", MESSAGES, {"model": "tiny", "messages": USER}, (400,), "max_tokens"),
    ]
)

_OPTIONS = {"num_predict": 8, "max_denoising_steps": 3}


def _chat(**fields) -> dict:
    """An Ollama chat body with these fields."""
    return {"model": "tiny", "messages": USER, "options": _OPTIONS, **fields}


def _generate(**fields) -> dict:
    return {"model": "tiny", "prompt": "x", "options": _OPTIONS, **fields}


def _say(*before: dict, **message) -> dict:
    """An Ollama chat body whose last message is `message` (a user's unless it says)."""
    return _chat(messages=[*before, {"role": "user", **message}])


def _options(**options) -> dict:
    return _chat(options=options)


_O_CALL = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
_O_NAMELESS = {"role": "assistant", "tool_calls": [{"function": {}}]}
_O_ARGUMENTS = "messages.1.tool_calls.0.function.arguments"
_OLLAMA_HOSTILE: list[tuple[str, str, object, tuple[int, ...], str | None]] = [
    ("ollama chat: model missing", OLLAMA_CHAT, {"messages": USER}, (400,), "model"),
    ("ollama chat: model null", OLLAMA_CHAT, _chat(model=None), (400,), "model"),
    ("ollama chat: another model", OLLAMA_CHAT, _chat(model="llama3"), (404,), "model"),
    ("ollama chat: messages a string", OLLAMA_CHAT, _chat(messages="hi"), (400,), "messages"),
    ("ollama chat: messages 3000", OLLAMA_CHAT, _chat(messages=USER * 3000), (400,), "messages"),
    ("ollama chat: a role robot", OLLAMA_CHAT, _say(role="robot", content="x"), (400,), "messages.0.role"),
    ("ollama chat: content a number", OLLAMA_CHAT, _say(content=5), (400,), "messages.0.content"),
    ("ollama chat: a lone surrogate", OLLAMA_CHAT, _say(content="\ud800"), (400,), "messages.0.content"),
    ("ollama chat: an image not base64", OLLAMA_CHAT, _say(content="x", images=["!!"]), (400,), "messages.0.images.0"),
    ("ollama chat: an image not an image", OLLAMA_CHAT, _say(images=["AAAAAAAA"]), (400,), "messages.0.images.0"),
    ("ollama chat: an image in a system message", OLLAMA_CHAT, _say(role="system", images=[PNG]), (400,), "messages.0.images"),
    ("ollama chat: images a string", OLLAMA_CHAT, _say(images=PNG), (400,), "messages.0.images"),
    ("ollama chat: call arguments a string", OLLAMA_CHAT, _say(USER[0], **_O_CALL), (400,), _O_ARGUMENTS),
    ("ollama chat: a call without a name", OLLAMA_CHAT, _say(USER[0], **_O_NAMELESS), (400,), "messages.1.tool_calls.0.function.name"),
    ("ollama chat: tools a string", OLLAMA_CHAT, _chat(tools=["f"]), (400,), "tools.0"),
    ("ollama chat: tool parameters 200 deep", OLLAMA_CHAT, _chat(tools=[_tool({"name": "f", "parameters": _ARRAYS_200})]), (400,), "tools.0.function.parameters"),
    ("ollama chat: format xml", OLLAMA_CHAT, _chat(format="xml"), (400,), "format"),
    ("ollama chat: format 200 deep", OLLAMA_CHAT, _chat(format=_ARRAYS_200), (400,), "format"),
    ("ollama chat: format json with tools", OLLAMA_CHAT, _chat(format="json", tools=[_tool(_F)]), (400,), "tools"),
    ("ollama chat: format json with think", OLLAMA_CHAT, _chat(format="json", think=True), (400,), "think"),
    ("ollama chat: think high", OLLAMA_CHAT, _chat(think="high"), (400,), "think"),
    ("ollama chat: stream yes", OLLAMA_CHAT, _chat(stream="yes"), (400,), "stream"),
    ("ollama chat: keep_alive forever", OLLAMA_CHAT, _chat(keep_alive="forever"), (400,), "keep_alive"),
    ("ollama chat: tool_choice", OLLAMA_CHAT, _chat(tool_choice="auto"), (400,), "tool_choice"),
    ("ollama chat: logprobs", OLLAMA_CHAT, _chat(logprobs=True), (400,), "logprobs"),
    ("ollama chat: options a list", OLLAMA_CHAT, _chat(options=[1]), (400,), "options"),
    ("ollama chat: options.top_k 40", OLLAMA_CHAT, _options(top_k=40), (400,), "options.top_k"),
    ("ollama chat: options.top_p 0.9", OLLAMA_CHAT, _options(top_p=0.9), (400,), "options.top_p"),
    ("ollama chat: options.repeat_penalty 1.1", OLLAMA_CHAT, _options(repeat_penalty=1.1), (400,), "options.repeat_penalty"),
    ("ollama chat: options.num_ctx -1", OLLAMA_CHAT, _options(num_ctx=-1), (400,), "options.num_ctx"),
    ("ollama chat: options.num_gpu a string", OLLAMA_CHAT, _options(num_gpu="all"), (400,), "options.num_gpu"),
    ("ollama chat: options.temperature hot", OLLAMA_CHAT, _options(temperature="hot"), (400,), "options.temperature"),
    ("ollama chat: options.num_predict 1e9", OLLAMA_CHAT, _options(num_predict=10**9), (400,), "options.num_predict"),
    ("ollama chat: options.stop of 100", OLLAMA_CHAT, _options(stop=["a"] * 100), (400,), "options.stop"),
    ("ollama chat: options.frobnicate", OLLAMA_CHAT, _options(frobnicate=1), (400,), "options.frobnicate"),
    ("ollama chat: options.max_denoising_steps 1e6", OLLAMA_CHAT, _options(max_denoising_steps=10**6), (400,), "options.max_denoising_steps"),
    ("ollama chat: dgemma out of range", OLLAMA_CHAT, _chat(dgemma={"max_denoising_steps": 10**6}), (400,), "dgemma.max_denoising_steps"),
    ("ollama chat: dgemma unknown", OLLAMA_CHAT, _chat(dgemma={"messages": []}), (400,), "dgemma.messages"),
    ("ollama chat: a body that is a list", OLLAMA_CHAT, [1, 2], (400,), None),
    ("ollama chat: a text longer than the context", OLLAMA_CHAT, _say(content="x " * 400_000), (400, 413), None),
    ("ollama generate: template", OLLAMA_GENERATE, _generate(template="{{ .Prompt }}"), (400,), "template"),
    ("ollama generate: context", OLLAMA_GENERATE, _generate(context=[1, 2, 3]), (400,), "context"),
    ("ollama generate: system with raw", OLLAMA_GENERATE, _generate(raw=True, system="s"), (400,), "system"),
    ("ollama generate: images with a suffix", OLLAMA_GENERATE, _generate(suffix="y", images=[PNG]), (400,), "images"),
    ("ollama generate: think with a suffix", OLLAMA_GENERATE, _generate(suffix="y", think=True), (400,), "think"),
    ("ollama generate: a suffix with format json", OLLAMA_GENERATE, _generate(suffix="y", format="json"), (400,), "suffix"),
    ("ollama generate: prompt a number", OLLAMA_GENERATE, _generate(prompt=5), (400,), "prompt"),
    ("ollama generate: raw a string", OLLAMA_GENERATE, _generate(raw="true"), (400,), "raw"),
    ("ollama generate: an image not an image", OLLAMA_GENERATE, _generate(images=["AAAAAAAA"]), (400,), "images.0"),
    ("ollama generate: options.num_predict 0", OLLAMA_GENERATE, _generate(options={"num_predict": 0}), (400,), "options.num_predict"),
    ("ollama generate: options.seed a string", OLLAMA_GENERATE, _generate(suffix="y", options={"seed": "1"}), (400,), "options.seed"),
    ("ollama generate: an unknown field", OLLAMA_GENERATE, _generate(n=2), (400,), "n"),
    ("ollama show: no model", OLLAMA_SHOW, {}, (400,), "model"),
    ("ollama show: another model", OLLAMA_SHOW, {"model": "llama3"}, (404,), "model"),
]  # fmt: skip

_P = {"prompt": "x"}
_LLAMACPP_HOSTILE: list[tuple[str, str, object, tuple[int, ...], str | None]] = [
    ("infill body a list", INFILL, [1, 2], (400, 422), None),
    ("infill input_prefix a number", INFILL, {"input_prefix": 5}, (400,), "input_prefix"),
    ("infill input_suffix null-free list", INFILL, {"input_suffix": ["a"]}, (400,), "input_suffix"),
    ("infill input_prefix a lone surrogate", INFILL, {"input_prefix": "\ud800"}, (400,), "input_prefix"),
    ("infill prompt a list of ids", INFILL, {"prompt": [1, 2]}, (400,), "prompt"),
    ("infill input_extra a string", INFILL, {"input_extra": "x"}, (400,), "input_extra"),
    ("infill chunk without text", INFILL, {"input_extra": [{"filename": "a"}]}, (400,), "input_extra.0.text"),
    ("infill chunk unknown field", INFILL, {"input_extra": [{"text": "a", "x": 1}]}, (400,), "input_extra.0.x"),
    ("infill chunk time", INFILL, {"input_extra": [{"text": "a", "time": "now"}]}, (400,), "input_extra.0.time"),
    ("infill input_extra 1000 chunks", INFILL, {"input_extra": [{"text": "a"}] * 1000}, (400,), "input_extra"),
    ("infill input_extra nested lists", INFILL, {"input_extra": [[[[[[{"text": "a"}]]]]]]}, (400,), "input_extra.0"),
    ("infill n_predict a string", INFILL, {"n_predict": "16"}, (400,), "n_predict"),
    ("infill n_predict true", INFILL, {"n_predict": True}, (400,), "n_predict"),
    ("infill n_predict -2", INFILL, {"n_predict": -2}, (400,), "n_predict"),
    ("infill n_predict 2**40", INFILL, {"n_predict": 2**40}, (400,), "n_predict"),
    ("infill temperature 99", INFILL, {"temperature": 99}, (400,), "temperature"),
    ("infill temperature a string", INFILL, {"temperature": "hot"}, (400,), "temperature"),
    ("infill seed -5", INFILL, {"seed": -5}, (400,), "seed"),
    ("infill stop a number list", INFILL, {"stop": [1]}, (400,), "stop"),
    ("infill stop 10 strings", INFILL, {"stop": ["a"] * 10}, (400,), "stop"),
    ("infill lora an adapter", INFILL, {"lora": [{"id": 0, "scale": 0.5}]}, (400,), "lora"),
    ("infill grammar", INFILL, {"grammar": "root ::= \"a\""}, (400,), "grammar"),
    ("infill json_schema", INFILL, {"json_schema": {}}, (400,), "json_schema"),
    ("infill n_probs", INFILL, {"n_probs": 5}, (400,), "n_probs"),
    ("infill logit_bias", INFILL, {"logit_bias": [[15043, 1.0]]}, (400,), "logit_bias"),
    ("infill min_p (unknown)", INFILL, {"min_p": 0.05}, (400,), "min_p"),
    ("infill top_p 2", INFILL, {"top_p": 2}, (400,), "top_p"),
    ("infill top_k a float", INFILL, {"top_k": 40.5}, (400,), "top_k"),
    ("infill samplers numbers", INFILL, {"samplers": [1]}, (400,), "samplers.0"),
    ("infill samplers an object", INFILL, {"samplers": {"a": 1}}, (400,), "samplers"),
    ("infill samplers 100", INFILL, {"samplers": ["top_k"] * 100}, (400,), "samplers"),
    ("infill cache_prompt a string", INFILL, {"cache_prompt": "yes"}, (400,), "cache_prompt"),
    ("infill t_max_predict_ms huge", INFILL, {"t_max_predict_ms": 2**40}, (400,), "t_max_predict_ms"),
    ("infill stream a string", INFILL, {"stream": "true"}, (400,), "stream"),
    ("infill dgemma a string", INFILL, {"dgemma": "x"}, (400,), "dgemma"),
    ("infill dgemma unknown setting", INFILL, {"dgemma": {"bogus": 1}}, (400,), "dgemma.bogus"),
    ("infill dgemma steps 0", INFILL, {"dgemma": {"max_denoising_steps": 0}}, (400,), "dgemma.max_denoising_steps"),
    ("infill another model", INFILL, {"model": "other"}, (404,), "model"),
    ("infill warming with a bad temperature", INFILL, {"n_predict": 0, "temperature": -1}, (400,), "temperature"),
    ("infill warming with another model", INFILL, {"n_predict": 0, "model": "other"}, (404,), "model"),
    ("infill prefix of 2M characters", INFILL, {"input_prefix": "x" * 2_000_000}, (400, 413), "input_prefix"),
    ("completion body a string", LLAMA_COMPLETION, "x", (400, 422), None),
    ("completion without prompt", LLAMA_COMPLETION, {"n_predict": 4}, (400,), "prompt"),
    ("completion prompt null", LLAMA_COMPLETION, {"prompt": None}, (400,), "prompt"),
    ("completion prompt empty ids", LLAMA_COMPLETION, {"prompt": []}, (400,), "prompt"),
    ("completion two prompts", LLAMA_COMPLETION, {"prompt": ["a", "b"]}, (400,), "prompt"),
    ("completion ids and text mixed", LLAMA_COMPLETION, {"prompt": [1, "a"]}, (400,), "prompt"),
    ("completion prompt an object", LLAMA_COMPLETION, {"prompt": {"prompt_string": "x"}}, (400,), "prompt"),
    ("completion id -1", LLAMA_COMPLETION, {"prompt": [-1]}, (400,), "prompt"),
    ("completion id past the vocabulary", LLAMA_COMPLETION, {"prompt": [10**9]}, (400,), "prompt"),
    ("completion warming, id past the vocabulary", LLAMA_COMPLETION, {"prompt": [10**9], "n_predict": 0}, (400,), "prompt"),
    ("completion prompt a lone surrogate", LLAMA_COMPLETION, {"prompt": "a\ud800"}, (400,), "prompt"),
    ("completion n_predict 2**40", LLAMA_COMPLETION, {**_P, "n_predict": 2**40}, (400,), "n_predict"),
    ("completion n_probs", LLAMA_COMPLETION, {**_P, "n_probs": 3}, (400,), "n_probs"),
    ("completion n_cmpl (unknown)", LLAMA_COMPLETION, {**_P, "n_cmpl": 2}, (400,), "n_cmpl"),
    ("completion seed a float", LLAMA_COMPLETION, {**_P, "seed": 1.5}, (400,), "seed"),
    ("completion dgemma.ignore_eos", LLAMA_COMPLETION, {**_P, "dgemma": {"ignore_eos": "y"}}, (400,), "dgemma.ignore_eos"),
]  # fmt: skip

DIALECTS: list[tuple[str, str, object, tuple[int, ...], str | None]] = [
    *_RESPONSES_HOSTILE,
    *_MESSAGES_HOSTILE,
    *_OLLAMA_HOSTILE,
    *_LLAMACPP_HOSTILE,
]

CRAFTED_PATH = '/v1/x"} 1\n# not a metric'  # sent URL-encoded: it must not become a label value


def body_bytes(body: object) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


async def replay(client: httpx.AsyncClient, path: str, body: object, key: str | None) -> httpx.Response:
    """Send one hostile request (POST, JSON content type, with the key if given)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return await client.post(path, content=body_bytes(body), headers=headers)


def is_openai_error(response: httpx.Response) -> bool:
    """A 4xx body in the OpenAI shape, with no traceback."""
    try:
        err = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        bool(err.get("message"))
        and "Traceback" not in response.text
        and set(err) == {"message", "type", "param", "code"}
    )


# Anthropic's error type by status (docs.anthropic.com/en/api/errors); any other 4xx is an invalid request
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_ANTHROPIC_TYPES |= {413: "request_too_large", 429: "rate_limit_error"}


def dialect_error(response) -> tuple[str, str | None] | None:
    """(message, the field it names) when `response` is a 4xx error body, with no traceback, in the shape of
    the dialect its request's path speaks (dgemma.server.protocol.dialect_of); else None. OpenAI's names its
    field in `param`; Anthropic's, Ollama's and llama.cpp's at the start of the message ("field: ...")."""
    status = response.status_code
    if not 400 <= status < 500 or "Traceback" in response.text:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    dialect = dialect_of(urlsplit(str(response.request.url)).path)
    if dialect == "openai":
        error = body.get("error") if isinstance(body, dict) else None
        if not (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}):
            return None
        message, param = error["message"], error["param"]
        return (message, param) if isinstance(message, str) and message and isinstance(param, str | None) else None
    if dialect == "anthropic":
        error = body.get("error") if isinstance(body, dict) and set(body) == {"type", "error"} else None
        ok = isinstance(error, dict) and body["type"] == "error" and set(error) == {"type", "message"}
        if not ok or error["type"] != _ANTHROPIC_TYPES.get(status, "invalid_request_error"):
            return None
        message = error["message"]
    elif dialect == "ollama":
        message = body["error"] if isinstance(body, dict) and set(body) == {"error"} else None
    else:  # llama.cpp's server
        error = body.get("error") if isinstance(body, dict) and set(body) == {"error"} else None
        if not (isinstance(error, dict) and set(error) == {"code", "message", "type"} and error["code"] == status):
            return None
        message = error["message"]
    if not isinstance(message, str) or not message:
        return None
    head = message.split(": ", 1)[0]
    return message, head if " " not in head else message.split(" ", 1)[0]
