"""response_format on a live server, through the openai client: JSON answers that validate against their
schema (jsonschema), streamed whole, retried and then a 422 when no answer can validate, refusals by name."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from live_server import KEY

FAST = {"max_denoising_steps": 3}
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "count": {"type": "integer"},
        "price": {"type": "number"},
        "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
        "where": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "count", "price", "ok", "size", "tags", "where"],
    "additionalProperties": False,
}


def _format(schema: dict, name: str = "item") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_chat_answers_validate_against_the_schema(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "an item"}],
            response_format=_format(ITEM),
            seed=seed,
            extra_body=FAST,
        )
        value = json.loads(r.choices[0].message.content)
        jsonschema.validate(value, ITEM)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens > 0


def test_completions_answer_every_prompt_and_choice(client):
    r = client.completions.create(  # the openai client has no response_format for completions: extra_body (as vLLM)
        model="tiny", prompt=["a", "b c"], n=2, seed=1, extra_body={"response_format": _format(ITEM), **FAST}
    )
    assert len(r.choices) == 4
    texts = [c.text for c in r.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), ITEM)
    assert len(set(texts)) > 1  # other seeds, other prompts: other answers


def test_a_streamed_json_answer_arrives_whole(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            response_format=_format(ITEM),
            stream=True,
            seed=3,
            extra_body=FAST,
        )
    )
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 1  # written from the values read back, so sent when the choice ends
    jsonschema.validate(json.loads(content[0]), ITEM)


def test_no_valid_answer_is_a_422_after_the_retries(server):
    both = {"oneOf": [{"type": "integer"}, {"type": "integer"}]}  # every integer fits both: none fits one
    impossible = {"type": "object", "properties": {"n": both}, "required": ["n"]}
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": _format(impossible), **FAST}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "json_unsatisfied"
    assert "in 3 attempts" in error["message"]
    # `retries` (the library's name) sets them; it is refused where nothing is validated
    r = _post(server, "/v1/chat/completions", {**body, "retries": 0})
    assert r.status_code == 422 and "in 1 attempts" in r.json()["error"]["message"], r.text
    r = _post(server, "/v1/completions", {"prompt": "x", "retries": 1, **FAST})
    assert r.status_code == 400 and r.json()["error"]["param"] == "retries", r.text
    empty = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 4}}}
    r = _post(server, "/v1/chat/completions", {**body, "response_format": _format(empty)})  # refused up front
    assert r.status_code == 400 and "no integer lies within the bounds" in r.json()["error"]["message"], r.text
    r = _post(server, "/v1/completions", {"prompt": "x", "response_format": _format(impossible), "retries": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "retries", r.text


def test_json_object_gives_an_object_or_a_422_never_a_5xx(server):
    body = {"prompt": "{", "response_format": {"type": "json_object"}, "max_tokens": 16, "seed": 0, **FAST}
    r = _post(server, "/v1/completions", body)
    assert r.status_code in (200, 422), r.text
    if r.status_code == 200:
        assert isinstance(json.loads(r.json()["choices"][0]["text"]), dict)
    else:
        assert r.json()["error"]["code"] == "json_unsatisfied"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": _format(ITEM), "stop": ["}"]}, "stop"),
        ({"response_format": _format({"type": "string", "pattern": "(?=x)x"})}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object", "json_schema": {"name": "a", "schema": {}}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": _format(ITEM, name="bad name")}, "response_format.json_schema.name"),
        (
            {
                "response_format": _format(
                    {"a": {"a": {}}} | {"x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}
                )
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": _format(ITEM), "max_tokens": 4}, "max_tokens"),
        ({"response_format": _format(ITEM), "reasoning": True}, "reasoning"),
    ],
)
def test_bad_json_requests_are_400s_naming_the_field(server, extra, param):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **extra, **FAST})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_schema_too_long_is_refused_before_it_is_compiled(server):
    wide = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(3000)}}
    r = _post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": _format(wide)},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"


# -- choices: the answer is one of the options, the best scored ---------------------------------------------


def test_chat_choices_answer_the_best_scored_option(client):
    options = ["yes", "no", "maybe later"]
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "ok?"}], extra_body={"choices": options}
    )
    content = r.choices[0].message.content
    details = r.model_extra["dgemma"]["choices"][0]
    scores = details["choice_scores"]
    assert content == options[details["choice_index"]] == options[max(range(3), key=scores.__getitem__)]
    assert r.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "ok?"}], stream=True, extra_body={"choices": options}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


def test_completion_choices_match_the_python_api(server, client, model_dir):
    from helpers import load_quiet

    import dgemma

    options = ["a b", "c", "d e f"]
    r = client.completions.create(model="tiny", prompt=["x y", "z"], echo=True, extra_body={"choices": options})
    model, tok = load_quiet(model_dir), dgemma.Tokenizer.from_dir(model_dir)
    for choice, prompt in zip(r.choices, ["x y", "z"], strict=True):
        want = dgemma.choose(model, tok.encode(prompt), options, tokenizer=tok)
        assert choice.text == tok.decode(tok.encode(prompt)) + want.option
        got = r.model_extra["dgemma"]["choices"][choice.index]["choice_scores"]
        # the server scores on its own engine: the same passes, so the same numbers to fp32 rounding
        assert got == pytest.approx(want.scores, abs=1e-3)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"choices": ["a"], "n": 2}, "n"),
        ({"choices": ["a"], "temperature": 0.5}, "temperature"),
        ({"choices": ["a"], "max_denoising_steps": 4}, "max_denoising_steps"),
        ({"choices": ["a"], "seed": 1}, "seed"),
        ({"choices": []}, "choices"),
        ({"choices": [""]}, "choices.0"),
        ({"choices": ["a"] * 65}, "choices"),
        ({"choices": ["a" * 2000]}, "choices.0"),
        ({"choices": ["a b c d e f g h"], "max_tokens": 1}, "max_tokens"),
    ],
)
def test_bad_choices_requests_are_400s_naming_the_field(server, extra, param):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
