"""One test per trap in architecture.md: each checks the behaviour, not just the structure."""

from __future__ import annotations

import pytest
import torch
from helpers import fp32_logit_tolerance, fp32_tolerance, load_quiet

from dgemma import build, preset
from dgemma.model.config import FULL, SLIDING
from dgemma.model.model import Router, embed_scale, rope_inv_freq


@pytest.fixture(scope="module")
def model(moe_ckpt):
    return load_quiet(moe_ckpt[0], dtype="fp32")


def _prompt(model, t=20, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.text_config.vocab_size, (b, t), generator=g)


def _record(store, key, value):
    """Forward-hook body that records without returning (a hook's return value replaces the output)."""
    store.append(value) if isinstance(store, list) else store.setdefault(key, value)


def _encode_hidden(model, ids):
    cache = model.new_cache(ids.shape[0], 64)
    return model.encode(ids, cache).hidden_states, cache


# 1. Encoder and decoder layer_scalar differ, and each mode uses its own.
def test_encoder_and_decoder_layer_scalars_are_separate(model):
    enc = torch.stack([layer.encoder_layer_scalar for layer in model.layers])
    dec = torch.stack([layer.layer_scalar for layer in model.layers])
    assert not torch.equal(enc, dec), "the oracle checkpoint was saved with distinct scalars"
    ids = _prompt(model)
    base, _ = _encode_hidden(model, ids)
    layer = model.layers[2]
    with torch.no_grad():
        saved = layer.layer_scalar.clone()
        layer.layer_scalar.mul_(3.0)  # the decoder's scalar must not touch the encoder
        same, cache = _encode_hidden(model, ids)
        canvas = torch.randint(0, model.text_config.vocab_size, (1, 8))
        changed_logits = model.denoise(canvas, cache)
        layer.layer_scalar.copy_(saved)
        logits = model.denoise(canvas, cache)
        layer.encoder_layer_scalar.mul_(3.0)
        moved, _ = _encode_hidden(model, ids)
        layer.encoder_layer_scalar.div_(3.0)
    assert torch.equal(base, same)
    assert not torch.allclose(logits, changed_logits)
    assert not torch.allclose(base, moved)


# 2. Global layers: V is the raw k_proj output (before k_norm and RoPE), normalised without weight.
def test_global_layers_take_values_from_k_proj(model):
    spec_types = model.text_config.layer_types
    g = spec_types.index(FULL)
    attn = model.layers[g].self_attn
    assert attn.v_proj is None and attn.v_norm.weight is None
    assert all(model.layers[i].self_attn.v_proj is not None for i, t in enumerate(spec_types) if t == SLIDING)
    seen = {}
    attn.register_forward_hook(lambda m, args, out: _record(seen, "x", args[0]))
    try:
        ids = _prompt(model, t=12)
        _, cache = _encode_hidden(model, ids)
    finally:
        attn._forward_hooks.clear()
    x = seen["x"]
    d = attn.spec.head_dim
    k_raw = attn.k_proj(x).view(1, 12, -1, d).float()
    expected_v = (k_raw * torch.pow(k_raw.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)).transpose(1, 2)
    torch.testing.assert_close(cache.values[g][:, :, :12], expected_v, rtol=0, atol=1e-6)
    assert not torch.allclose(cache.keys[g][:, :, :12], expected_v, atol=1e-3)


# 3. The router reads the raw residual; per_expert_scale is applied after renormalising the top-k.
def test_router_renormalises_then_scales():
    cfg = preset("tiny").text_config
    router = Router(cfg)
    with torch.no_grad():
        router.proj.weight.normal_()
        router.per_expert_scale.copy_(torch.tensor([0.5, 1.0, 2.0, 4.0]))
    r = torch.randn(7, cfg.hidden_size)
    weights, index = router(r)
    assert weights.dtype == torch.float32
    unscaled = weights / router.per_expert_scale[index]
    torch.testing.assert_close(unscaled.sum(-1), torch.ones(7))
    probs = torch.softmax(router.proj(router.norm(r) * router.scale * cfg.hidden_size**-0.5), -1)
    top, top_index = probs.topk(cfg.top_k_experts, dim=-1)
    assert torch.equal(index, top_index)
    torch.testing.assert_close(unscaled, top / top.sum(-1, keepdim=True))


def test_router_ignores_the_expert_input_norm(model):
    layer = model.layers[1]
    chosen = []
    layer.router.register_forward_hook(lambda m, a, out: _record(chosen, None, out[1].clone()))
    try:
        ids = _prompt(model)
        _encode_hidden(model, ids)
        with torch.no_grad():
            layer.pre_feedforward_layernorm_2.weight.mul_(-5.0)
            _encode_hidden(model, ids)
            layer.pre_feedforward_layernorm_2.weight.div_(-5.0)
    finally:
        layer.router._forward_hooks.clear()
    assert torch.equal(chosen[0], chosen[1])


# 4. Proportional RoPE on global layers.
def test_proportional_rope_matches_reference_definition():
    from transformers import DiffusionGemmaTextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text = preset("26b-a4b").text_config
    spec = text.layer(text.layer_types.index(FULL))
    inv = rope_inv_freq(spec)
    assert spec.head_dim == 512 and inv.shape == (256,)
    assert torch.count_nonzero(inv) == 64  # 25% of the 256 pairs rotate
    assert inv[0] == 1.0 and torch.all(inv[64:] == 0)
    torch.testing.assert_close(inv[1], torch.tensor(1e6 ** (-2 / 512)))  # exponent over the full head dim
    ref_cfg = DiffusionGemmaTextConfig(
        num_experts=4, top_k_experts=2, moe_intermediate_size=8, head_dim=256, global_head_dim=512, num_hidden_layers=6
    )
    ref, _ = ROPE_INIT_FUNCTIONS["proportional"](ref_cfg, None, layer_type=FULL)
    assert torch.equal(inv, ref)
    sliding = rope_inv_freq(text.layer(0))
    assert sliding.shape == (128,) and torch.count_nonzero(sliding) == 128


# 5. Embed scale is rounded to the weight dtype.
def test_embed_scale_rounds_in_low_precision():
    assert embed_scale(3072, torch.bfloat16).item() == 55.5
    assert abs(embed_scale(3072, torch.float32).item() - 3072**0.5) < 1e-5
    m = build(preset("tiny"), dtype=torch.bfloat16)
    ids = torch.tensor([[5, 6]])
    expected = m.embed_tokens.weight[ids] * torch.tensor(8.0, dtype=torch.bfloat16)
    assert torch.equal(m.embed(ids), expected)


# 6. The final softcap is computed in fp32, even for a bf16 model.
def test_softcap_in_fp32():
    m = build(preset("tiny"), dtype=torch.bfloat16)
    with torch.no_grad():
        m.embed_tokens.weight.mul_(400)  # large logits, where a bf16 tanh would round differently
    hidden = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    logits = m.lm_head(hidden)
    assert logits.dtype == torch.float32
    raw = torch.nn.functional.linear(hidden, m.embed_tokens.weight).float()
    assert torch.equal(logits, torch.tanh(raw / 30.0) * 30.0)
    assert logits.abs().max() < 30.0
    assert not torch.equal(logits, (torch.tanh(raw.bfloat16() / 30.0) * 30.0).float())


# 7. The decoder input always passes through the self-conditioning post-norm.
def test_decoder_input_is_post_normed_without_signal(model):
    seen = {}
    _, cache = _encode_hidden(model, _prompt(model))
    model.layers[0].register_forward_hook(lambda m, args, out: _record(seen, "x", args[0]))
    try:
        model.denoise(torch.randint(0, 512, (1, 8)), cache)
    finally:
        model.layers[0]._forward_hooks.clear()
    rms = seen["x"].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-4)


def test_self_conditioning_mask_zeroes_the_signal(model):
    _, cache = _encode_hidden(model, _prompt(model, b=2))
    canvas = torch.randint(0, 512, (2, 8))
    sc = torch.randn(2, 8, 512) * 3
    decoder_inputs = []
    model.self_conditioning.register_forward_hook(lambda m, a, out: _record(decoder_inputs, None, out))
    try:
        soft = model.soft_embedding(sc)
        plain = model.denoise(canvas, cache)
        masked = model.denoise(canvas, cache, soft * torch.tensor([1.0, 0.0])[:, None, None])  # row 1 off
        full = model.denoise(canvas, cache, soft)
    finally:
        model.self_conditioning._forward_hooks.clear()
    # Bit for bit where the code guarantees it: a zeroed signal adds exactly zero, and the block computes
    # each row on its own.
    x_plain, x_masked, x_full = decoder_inputs
    assert torch.equal(x_masked[1], x_plain[1]) and torch.equal(x_masked[0], x_full[0])
    # The logits only to rounding: the rows share the MoE, whose per-expert matmuls run on other row counts
    # when the other row's routing changes (another BLAS path on some CPUs).
    tol = fp32_logit_tolerance(model)
    torch.testing.assert_close(masked[1], plain[1], rtol=0, atol=tol)
    torch.testing.assert_close(masked[0], full[0], rtol=0, atol=tol)
    assert not torch.allclose(full[0], plain[0])


# 8. Canvas queries on sliding layers see exactly the last W - 1 cached positions (the oracle's
#    behaviour, checked end to end by test_parity's long-prompt case); chunked prefill keeps that window.
def test_sliding_canvas_queries_see_last_window(model):
    w = model.text_config.sliding_window
    ids = _prompt(model, t=3 * w)
    _, cache = _encode_hidden(model, ids)
    i = model.text_config.layer_types.index(SLIDING)
    new = torch.zeros(1, 2, 8, 16)
    k, _ = cache.with_prefix(i, new, new)
    assert k.shape[2] == (w - 1) + 8
    chunked = model.new_cache(1, 4 * w)
    model.encode(ids[:, : 2 * w], chunked)
    model.encode(ids[:, 2 * w :], chunked)
    # layer i's keys come from the same embeddings through matmuls over other row counts: equal to rounding
    keys = cache.keys[i]
    tol = fp32_tolerance(keys.abs().max().item(), model.text_config.hidden_size, num_layers=i)
    torch.testing.assert_close(chunked.keys[i], keys, rtol=0, atol=tol)
    torch.testing.assert_close(k[:, :, : w - 1], cache.keys[i][:, :, -(w - 1) :])


# 9. Left padding is masked in both modes: what sits under the padding never matters.
def test_left_padding_is_invisible(model):
    ids = _prompt(model, t=20, b=2)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :7] = 0
    canvas = torch.randint(0, 512, (2, 8))
    results = []
    for filler in (0, 99):
        x = ids.clone()
        x[1, :7] = filler
        cache = model.new_cache(2, 64)
        hidden = model.encode(x, cache, attention_mask=mask).hidden_states
        results.append((hidden[mask.bool()], model.denoise(canvas, cache), cache))
    # Equal to rounding, not bit for bit: the padded positions are routed to experts too, so the real
    # tokens' expert matmuls run on other row counts when the filler changes.
    hidden = results[0][0]
    text = model.text_config
    hidden_tol = fp32_tolerance(hidden.abs().max().item(), text.hidden_size, text.num_hidden_layers)
    torch.testing.assert_close(results[1][0], hidden, rtol=0, atol=hidden_tol)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=fp32_logit_tolerance(model))
    # and the padded row really differs from an unmasked encode of the same tokens
    cache = model.new_cache(2, 64)
    model.encode(ids, cache)
    assert not torch.allclose(model.denoise(canvas, cache)[1], results[0][1][1])
