"""The fixed-shape KV cache: chunked and multi-turn use equals one pass, sizes, and clear errors."""

from __future__ import annotations

import pytest
import torch
from helpers import fp32_tolerances, load_quiet

from dgemma import KVCache, build, preset


@pytest.fixture(scope="module")
def model(moe_ckpt):
    return load_quiet(moe_ckpt[0], dtype="fp32")


def test_chunked_encode_equals_one_pass(model):
    ids = torch.randint(3, 512, (2, 45))
    one = model.new_cache(2, 64)
    h_one = model.encode(ids, one).hidden_states
    chunked = model.new_cache(2, 64)
    parts = [model.encode(ids[:, a:b], chunked).hidden_states for a, b in ((0, 7), (7, 30), (30, 45))]
    logits_tol, state_tol = fp32_tolerances(model)  # the same values through matmuls of other shapes
    torch.testing.assert_close(torch.cat(parts, 1), h_one, rtol=0, atol=state_tol)
    canvas = torch.randint(0, 512, (2, 8))
    torch.testing.assert_close(model.denoise(canvas, chunked), model.denoise(canvas, one), rtol=0, atol=logits_tol)
    assert chunked.length == one.length == 45


def test_multi_turn_reuse_continues_positions(model):
    a, b = torch.randint(3, 512, (1, 10)), torch.randint(3, 512, (1, 6))
    cache = model.new_cache(1, 40)
    model.encode(a, cache)
    logits_turn2 = model.encode(b, cache, return_logits=True).logits
    fresh = model.new_cache(1, 40)
    ref = model.encode(torch.cat([a, b], 1), fresh, return_logits=True).logits[:, 10:]
    torch.testing.assert_close(logits_turn2, ref, rtol=0, atol=fp32_tolerances(model)[0])  # other shapes
    cache.reset()
    assert cache.length == 0
    model.encode(b, cache)
    assert cache.length == 6


def test_sliding_layers_store_only_their_window():
    config = preset("26b-a4b").text_config
    cache = KVCache(config, batch_size=1, max_length=4096, dtype=torch.bfloat16, device="meta")
    sliding = [k.shape[2] for k, s in zip(cache.keys, cache.is_sliding, strict=True) if s]
    full = [k.shape[2] for k, s in zip(cache.keys, cache.is_sliding, strict=True) if not s]
    assert set(sliding) == {1023} and set(full) == {4096}
    per_pos_full = 2 * 2 * 512 * 2  # K and V, 2 heads, head_dim 512, bf16
    per_pos_sliding = 2 * 8 * 256 * 2
    assert cache.nbytes() == 5 * 4096 * per_pos_full + 25 * 1023 * per_pos_sliding


def test_encode_logits_are_the_ar_head(model):
    ids = torch.randint(3, 512, (1, 5))
    out = model.encode(ids, model.new_cache(1, 8), return_logits=True)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (1, 5, 512)
    assert torch.equal(out.logits, model.lm_head(out.hidden_states))  # encode calls the same lm_head
    assert model.encode(ids, model.new_cache(1, 8)).logits is None


def test_errors_are_clear():
    m = build(preset("tiny"))
    cache = m.new_cache(1, 8)
    with pytest.raises(ValueError, match="holds 8 positions; 0 are used and 9 more do not fit"):
        m.encode(torch.ones(1, 9, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        m.encode(torch.tensor([[5, 512]]), cache)
    with pytest.raises(ValueError, match="integer tensor"):
        m.encode(torch.tensor([[1.0]]), cache)
    with pytest.raises(ValueError, match="shape"):
        m.encode(torch.ones(4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        m.encode(torch.ones(1, 2, dtype=torch.long), cache, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="must be positive"):
        m.new_cache(0, 8)
    with pytest.raises(ValueError, match="batch of 2 rows, but the KV cache was made for 1"):
        m.encode(torch.ones(2, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="batch of 3 rows"):
        m.denoise(torch.ones(3, 8, dtype=torch.long), cache)
    assert cache.length == 0, "failed calls leave the cache as it was"


def test_image_placeholder_tokens_are_rejected():
    config = preset("tiny")
    config.image_token_id = 77
    m = build(config)
    with pytest.raises(ValueError, match="image placeholder tokens"):
        m.encode(torch.tensor([[5, 77]]), m.new_cache(1, 8))
