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
