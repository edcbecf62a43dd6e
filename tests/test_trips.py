"""Issue 56: a request crosses few files on its way to the model. benchmarks/trips.py records the package
files entered on a request's causal path, from its arrival to its first forward pass; the budgets here are
the issue's (a plain chat request through the app, and `dgemma.generate_json`, at most 12 each)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import load_quiet

pytest.importorskip("httpx")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from trips import measure

from dgemma.checkpoints.tokenizer import Tokenizer

BUDGETS = {"chat": 12, "chat_streamed": 12, "completions": 12, "generate_json": 12, "chat_json": 16}


def test_a_request_reaches_the_model_within_its_budget_of_files(model_dir):
    trips = measure(load_quiet(model_dir), Tokenizer.from_dir(model_dir))
    assert {name: len(trips[name]) for name in BUDGETS} == {
        name: min(len(trips[name]), most) for name, most in BUDGETS.items()
    }, trips
    chat = trips["chat"]
    assert chat[0] == "server/guard.py" and chat[-1] == "runtime/runner.py"
    assert "structured/plans.py" not in chat and "generation/reference.py" not in chat
