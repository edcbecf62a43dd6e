"""A request through the server, the command line and the Python API, with the same settings and seed,
gives the same tokens: the three front ends are one path to the same canvas loop."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import load_quiet

import dgemma
from dgemma.checkpoints.tokenizer import Tokenizer

pytest.importorskip("uvicorn")
from live_server import KEY

PROMPT = "def f(x):"
SETTINGS = {"max_new_tokens": 10, "max_denoising_steps": 3, "seed": 5, "t_max": 0.9, "t_min": 0.3}


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_server_cli_and_api_give_the_same_tokens(server, model_dir, capsys, mode):
    from dgemma.cli import main

    tok = Tokenizer.from_dir(model_dir)
    api = dgemma.generate(load_quiet(model_dir), tok.encode(PROMPT), tokenizer=tok, mode=mode, **SETTINGS)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
    assert main(["generate", "-m", str(model_dir), "-p", PROMPT, "--raw", "--json", "--mode", mode, *flags]) == 0
    cli = json.loads(capsys.readouterr().out)
    body = {"prompt": PROMPT, "mode": mode, **{k: v for k, v in SETTINGS.items() if k != "max_new_tokens"}}
    body["max_tokens"] = SETTINGS["max_new_tokens"]
    served = httpx.post(
        server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ).json()
    assert api.text[0] == cli["text"] == served["choices"][0]["text"]
    assert len(api.tokens[0]) == cli["tokens"] == served["usage"]["completion_tokens"]
    assert api.finish_reasons[0] == cli["finish_reason"] == served["choices"][0]["finish_reason"]


SHAPED = {"max_denoising_steps": 3, "seed": 5, "t_max": 0.9, "t_min": 0.3}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}, "name": {"type": "string", "maxLength": 3}},
    "required": ["ok", "n", "name"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 3}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    },
]


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cli(capsys, *argv) -> dict:
    from dgemma.cli import main

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPED.items()]
    assert main([*argv, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_answers_are_one_program_everywhere(server, model_dir, capsys, tmp_path):
    """response_format json_schema (server), --json-schema (CLI) and dgemma.generate_json (API): the same
    JSON program, the same answer."""
    tok = Tokenizer.from_dir(model_dir)
    api = dgemma.generate_json(load_quiet(model_dir), tok.encode(PROMPT), SCHEMA, tokenizer=tok, **SHAPED)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    cli = _cli(
        capsys, "generate", "-m", str(model_dir), "-p", PROMPT, "--raw", "--json-schema", str(tmp_path / "schema.json")
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    served = _post(server, "/v1/completions", {"prompt": PROMPT, "response_format": fmt, **SHAPED})
    assert api.text == cli["text"] == served["choices"][0]["text"]
    assert api.attempts == cli["attempts"] == served["dgemma"]["choices"][0]["json_attempts"]


def test_required_tool_calls_are_one_program_everywhere(server, model_dir, capsys, tmp_path):
    """tool_choice "required" (server), --tools --tool-choice required (CLI) and dgemma.tool_call (API): the
    function the model scores best, its arguments filled by the same JSON program."""
    from dgemma import chat_prompt

    tok = Tokenizer.from_dir(model_dir)
    model = load_quiet(model_dir)
    ids, _ = chat_prompt(tok, model.config, [{"role": "user", "content": PROMPT}], tools=TOOLS)
    api = dgemma.tool_call(model, ids, TOOLS, tokenizer=tok, **SHAPED)
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    argv = ["generate", "-m", str(model_dir), "-p", PROMPT, "--tools", str(tmp_path / "tools.json")]
    cli = _cli(capsys, *argv, "--tool-choice", "required")
    body = {"messages": [{"role": "user", "content": PROMPT}], "tools": TOOLS, "tool_choice": "required", **SHAPED}
    served = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (api.name, api.arguments) == (cli["tool_call"]["name"], cli["tool_call"]["arguments"])
    assert (api.name, api.arguments) == (served["name"], json.loads(served["arguments"]))
    # tool_choice "auto": the model's scores choose text or a call, the same way everywhere
    api = dgemma.tool_call(model, ids, TOOLS, tokenizer=tok, name="auto", **SHAPED)
    cli = _cli(capsys, *argv, "--tool-choice", "auto")
    body = {"messages": [{"role": "user", "content": PROMPT}], "tools": TOOLS, **SHAPED}
    served = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]
    if isinstance(api, dgemma.generation.choose.ToolCall):
        assert api.name == cli["tool_call"]["name"] == served["tool_calls"][0]["function"]["name"]
    else:
        assert api.text[0] == cli["text"] == served["content"] and cli["tool_call"] is None


def test_infill_is_one_program_everywhere(server, model_dir, capsys):
    """`suffix` (server), `dgemma infill` (CLI) and dgemma.infill (API): the same middle. The server reads its
    prompt as a completion prompt (with BOS), the CLI and a text prefix without: each is compared with the
    API given the same tokens."""
    tok = Tokenizer.from_dir(model_dir)
    model = load_quiet(model_dir)
    suffix = "return y"
    served = _post(server, "/v1/completions", {"prompt": PROMPT, "suffix": suffix, "max_tokens": 3, **SHAPED})
    ids = (tok.encode(PROMPT), tok.encode(suffix, add_special_tokens=False))
    api = dgemma.infill(model, *ids, 3, tokenizer=tok, **SHAPED)
    assert tok.decode(api.middle) == served["choices"][0]["text"]
    cli = _cli(capsys, "infill", "-m", str(model_dir), "--prefix", PROMPT, "--suffix", suffix, "--middle-length", "3")
    api = dgemma.infill(model, PROMPT, suffix, 3, tokenizer=tok, **SHAPED)
    assert api.middle_text == cli["middle"]


def test_choices_are_one_program_everywhere(server, model_dir, capsys):
    """`choices` (server), --choices (CLI) and dgemma.choose (API): the option the encoder scores best."""
    tok = Tokenizer.from_dir(model_dir)
    options = ["yes", "no", "return x"]
    api = dgemma.choose(load_quiet(model_dir), tok.encode(PROMPT), options, tokenizer=tok)
    cli = _cli(capsys, "generate", "-m", str(model_dir), "-p", PROMPT, "--raw", "--choices", *options)
    served = _post(server, "/v1/completions", {"prompt": PROMPT, "choices": options})
    assert api.option == cli["text"] == served["choices"][0]["text"]
    assert [round(s, 4) for s in api.scores] == served["dgemma"]["choices"][0]["choice_scores"]
