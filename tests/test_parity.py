"""Numerical parity with transformers' DiffusionGemmaForBlockDiffusion (the oracle) on tiny random models."""

from __future__ import annotations

import pytest
import torch

from dgemma.testing import PARITY_SCENARIOS, dense_checkpoint_from_oracle, load_quiet, parity_case

FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def models(moe_ckpt, dense_ckpt, tmp_path_factory):
    moe_dir, moe_oracle = moe_ckpt
    dense_dir, dense_oracle = dense_ckpt
    dense_only = dense_checkpoint_from_oracle(dense_dir, tmp_path_factory.mktemp("dense_only"))
    return {
        "moe": (moe_oracle, load_quiet(moe_dir, dtype="fp32")),
        "dense": (dense_oracle, load_quiet(dense_only, dtype="fp32")),
    }


def test_dense_model_has_no_experts(models):
    _, model = models["dense"]
    assert all(layer.experts is None and layer.router is None for layer in model.layers)
    assert not any("experts" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("variant", ["moe", "dense"])
@pytest.mark.parametrize("scenario", sorted(PARITY_SCENARIOS))
def test_fp32_parity(models, variant, scenario):
    oracle, model = models[variant]
    lengths, commit = PARITY_SCENARIOS[scenario]
    diffs = parity_case(oracle, model, prompt_lengths=lengths, commit=commit)
    expected = {"prefill_hidden", "prefill_kv", "logits", "logits_sc"}
    if commit:
        expected |= {"commit_hidden", "logits_canvas2", "logits_canvas2_sc"}
    assert set(diffs) == expected
    assert max(diffs.values()) <= FP32_TOL, diffs


def test_parity_detects_a_wrong_weight(models):
    """The comparison can fail: one perturbed norm weight shows up in the logits."""
    oracle, model = models["moe"]
    with torch.no_grad():
        model.layers[3].post_attention_layernorm.weight.mul_(1.01)
    try:
        diffs = parity_case(oracle, model, prompt_lengths=[10], commit=False)
        assert diffs["logits"] > FP32_TOL
    finally:
        with torch.no_grad():
            model.layers[3].post_attention_layernorm.weight.div_(1.01)


def test_bf16_parity_reported(moe_ckpt):
    """bf16 is not held to the fp32 tolerance, but dgemma follows the oracle's op order and dtypes."""
    from transformers import DiffusionGemmaForBlockDiffusion

    directory, _ = moe_ckpt
    oracle = DiffusionGemmaForBlockDiffusion.from_pretrained(directory, dtype=torch.bfloat16).eval()
    model = load_quiet(directory, dtype="bf16")
    assert model.dtype == torch.bfloat16
    diffs = parity_case(oracle, model, prompt_lengths=[40, 27], commit=True)
    print("bf16 max |diff|:", diffs)
    assert max(diffs.values()) <= 0.05, diffs
