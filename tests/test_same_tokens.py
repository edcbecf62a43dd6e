"""A request through the server, the command line and the Python API, with the same settings and seed,
gives the same tokens: the three front ends are one path to the same canvas loop."""

from __future__ import annotations

import json

import httpx
import pytest

import dgemma
from dgemma.checkpoints.tokenizer import Tokenizer
from dgemma.testing import load_quiet

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
