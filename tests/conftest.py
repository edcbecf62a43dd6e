"""Shared fixtures: tiny random checkpoints written by transformers (the oracle), built once per session."""

from __future__ import annotations

import pytest
import torch

from dgemma.testing import make_oracle_checkpoint

torch.set_num_threads(2)


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
