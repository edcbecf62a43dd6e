"""Requests that once took the server down or made it misbehave (issue 21), and how to replay them.

Each is (name, path, body, the statuses it may get): the body is raw bytes, or a JSON value to send as it
is (surrogates included: json.dumps writes them as `\\ud800` escapes). Shared by the fuzz test (each one,
once) and benchmarks/serve_hostile.py (all of them, from 32 concurrent clients, with streams running).
"""

from __future__ import annotations

import json

import httpx

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
