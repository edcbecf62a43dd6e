"""Shared fixtures: tiny random checkpoints written by transformers (the oracle), built once per session."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_oracle_checkpoint

# 2 threads (the CI machine's cores); DGEMMA_TEST_THREADS=1 when something else (a training run) holds a
# core: oversubscribed OpenMP threads spin and make every small op ~100x slower.
torch.set_num_threads(int(os.environ.get("DGEMMA_TEST_THREADS", "2")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory):
    """(directory, oracle model) of a tiny MoE checkpoint with sliding window 16."""
    d = tmp_path_factory.mktemp("moe")
    return d, make_oracle_checkpoint(d, seed=0)


@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory):
    """A tiny oracle whose experts add exactly zero (down_proj = 0), for dense-only comparisons."""
    d = tmp_path_factory.mktemp("dense")
    return d, make_oracle_checkpoint(d, seed=1, dense=True)


@pytest.fixture(scope="session")
def model_dir(moe_ckpt, tmp_path_factory):
    """The tiny MoE checkpoint with a tokenizer (chat template included), as a server would load it."""
    import shutil

    from helpers import make_tokenizer

    d = tmp_path_factory.mktemp("served") / "tiny-model"
    shutil.copytree(moe_ckpt[0], d)
    make_tokenizer(512).save(d)
    return d


@pytest.fixture(scope="session")
def server(model_dir):
    """A live server (API key `live_server.KEY`) on the tiny checkpoint, shared by the HTTP tests."""
    pytest.importorskip("uvicorn")
    from helpers import load_quiet
    from live_server import KEY, LiveServer

    from dgemma.checkpoints.tokenizer import Tokenizer
    from dgemma.server.app import create_app

    app = create_app(
        load_quiet(model_dir), Tokenizer.from_dir(model_dir), model_name="tiny", api_key=KEY, max_batch=4, max_queue=8
    )
    with LiveServer(app) as live:
        yield live


@pytest.fixture(scope="session")
def vision_dir(tmp_path_factory):
    """A tiny checkpoint with a vision tower (image blocks bidirectional) and a tokenizer with image tokens."""
    from helpers import make_tokenizer

    path = tmp_path_factory.mktemp("vision") / "ckpt"
    make_oracle_checkpoint(path, images=True, seed=5)
    make_tokenizer(images=True).save(path)
    return path


@pytest.fixture(scope="session")
def vision_server(vision_dir):
    """A live server (API key `live_server.KEY`) on the vision checkpoint."""
    pytest.importorskip("uvicorn")
    from live_server import KEY, LiveServer

    import dgemma
    from dgemma.server.app import create_app

    app = create_app(dgemma.load(vision_dir), dgemma.Tokenizer.from_dir(vision_dir), model_name="tiny", api_key=KEY)
    with LiveServer(app) as live:
        yield live
