"""A request through the server, the command line and the Python API, with the same settings and seed,
gives the same tokens: the three front ends are one path to the same canvas loop. On the server, the same
task reached through each client dialect (Chat Completions, Responses, Messages, Ollama, llama.cpp's
/infill) gives the same tokens too: each dialect only maps its body onto the chat or completions body."""

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


# -- issue 57: the same task reached through every client dialect ----------------------------------------------

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


def _dialects(server, chat: dict, responses: dict, messages: dict, ollama: dict | None) -> list[dict]:
    """The answers of one request in Chat Completions, Responses, Messages and Ollama (each with SHAPED in its
    own place: chat's top level, the others' `dgemma` key), none streamed (a stream commits early)."""
    out = [
        _post(server, "/v1/chat/completions", {"messages": USER, **chat, **SHAPED}),
        _post(server, "/v1/responses", {"instructions": "Be brief.", "input": PROMPT, **responses, "dgemma": SHAPED}),
        _post(server, "/v1/messages", {"system": "Be brief.", "messages": USER[1:], **messages, "dgemma": SHAPED}),
    ]
    if ollama is not None:
        body = {"model": "tiny", "messages": USER, "stream": False, **ollama, "dgemma": SHAPED}
        out.append(_post(server, "/api/chat", body))
    return out


def test_a_chat_answer_is_the_same_tokens_in_every_dialect(server):
    chat, responses, messages, ollama = _dialects(
        server, {"max_tokens": 10}, {"max_output_tokens": 10}, {"max_tokens": 10}, {"options": {"num_predict": 10}}
    )
    text = chat["choices"][0]["message"]["content"]
    assert text == responses["output"][0]["content"][0]["text"] == messages["content"][0]["text"]
    assert text == ollama["message"]["content"]
    tokens = chat["usage"]["completion_tokens"]
    assert tokens == responses["usage"]["output_tokens"] == messages["usage"]["output_tokens"] == ollama["eval_count"]
    prompt = chat["usage"]["prompt_tokens"]  # Messages and Ollama count apart what the prefix cache gave
    assert prompt == responses["usage"]["input_tokens"]
    assert prompt == messages["usage"]["input_tokens"] + messages["usage"]["cache_read_input_tokens"]
    assert 0 < ollama["prompt_eval_count"] <= prompt


def test_a_required_call_is_the_same_in_every_dialect(server):
    """tool_choice required (chat, Responses) and any (Messages): the same call of the same program; Ollama has
    no way to require a call."""
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    anthropic = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    chat, responses, messages = _dialects(
        server,
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": flat, "tool_choice": "required"},
        {"tools": anthropic, "tool_choice": {"type": "any"}, "max_tokens": 200},
        None,
    )
    call = chat["choices"][0]["message"]["tool_calls"][0]["function"]
    item = next(o for o in responses["output"] if o["type"] == "function_call")
    block = next(b for b in messages["content"] if b["type"] == "tool_use")
    assert call["name"] == item["name"] == block["name"]
    assert json.loads(call["arguments"]) == json.loads(item["arguments"]) == block["input"]


def test_a_json_answer_is_the_same_in_every_dialect(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    chat, responses, messages, ollama = _dialects(
        server,
        {"response_format": fmt},
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}},
        {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}, "max_tokens": 200},
        {"format": SCHEMA},
    )
    text = chat["choices"][0]["message"]["content"]
    assert text == responses["output"][0]["content"][0]["text"] == messages["content"][0]["text"]
    assert text == ollama["message"]["content"]


def test_an_infill_is_the_same_middle_in_every_dialect(server):
    """/v1/completions with a suffix, Ollama's generate with a suffix and llama.cpp's /infill: one Infill task
    (the middle's length given, and chosen by score)."""
    for length in (3, None):
        given = {} if length is None else {"max_tokens": length}
        completions = _post(server, "/v1/completions", {"prompt": PROMPT, "suffix": "return y", **given, **SHAPED})
        options = {} if length is None else {"num_predict": length}
        body = {"model": "tiny", "prompt": PROMPT, "suffix": "return y", "stream": False, "options": options}
        ollama = _post(server, "/api/generate", {**body, "dgemma": SHAPED})
        n_predict = {} if length is None else {"n_predict": length}
        body = {"input_prefix": PROMPT, "input_suffix": "return y", **n_predict, "dgemma": SHAPED}
        llama = _post(server, "/infill", body)
        middle = completions["choices"][0]["text"]
        assert middle == ollama["response"] == llama["content"], length
        assert completions["usage"]["completion_tokens"] == ollama["eval_count"] == llama["tokens_predicted"]
