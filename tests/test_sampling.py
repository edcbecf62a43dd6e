"""The sampling functions: the fast forms equal the reference forms on fixed logits, in value or in law."""

from __future__ import annotations

import pytest
import torch

from dgemma.generation.sampling import (
    CanvasStats,
    ConfidenceThreshold,
    EntropyBound,
    FixedCount,
    StableAndConfident,
    canvas_stats,
    draw,
    entropy_bound_mask_reference,
    entropy_reference,
    fast_transition,
    reference_transition,
    row_max,
    temperature,
)


def _logits(b=3, c=10, v=50, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, c, v, generator=g) * scale


def test_temperature_schedule_is_linear_from_t_max_to_t_min():
    assert temperature(48, 48, 0.4, 0.8).item() == pytest.approx(0.8)
    assert temperature(1, 48, 0.4, 0.8).item() == pytest.approx(0.4 + 0.4 / 48)
    assert temperature(24, 48, 0.4, 0.8).dtype == torch.float32


def test_canvas_stats_match_reference_quantities():
    logits = _logits()
    emb = torch.randn(50, 16)
    stats = canvas_stats(logits, emb, torch.tensor(4.0), chunk=7)  # a chunk that does not divide the rows
    # H = lse - sum p * l against -sum p * log p: |l| <= ~12 here, so 1e-5 is ~10 fp32 ulps of those terms
    torch.testing.assert_close(stats.entropy, entropy_reference(logits), rtol=0, atol=1e-5)
    assert torch.equal(stats.argmax, logits.argmax(-1))  # the first maximum of the same values, both ways
    torch.testing.assert_close(stats.confidence, torch.softmax(logits, -1).amax(-1))
    torch.testing.assert_close(stats.soft_embeds, (torch.softmax(logits, -1) @ emb) * 4.0, rtol=1e-5, atol=1e-5)
    assert (canvas_stats(torch.full((1, 2, 5), 1e4)).entropy >= 0).all()
    # a bf16 embedding: chunk products in bf16, summed in fp32; bf16 rounds to 2^-8 relative, so the result
    # is within a few bf16 ulps of the fp32 product of the same rounded inputs
    half = canvas_stats(logits, emb.bfloat16(), torch.tensor(4.0, dtype=torch.bfloat16), chunk=7).soft_embeds
    want = (torch.softmax(logits, -1) @ emb.bfloat16().float()) * 4.0
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("v", [50, 128, 300, 1000])  # fewer than a block, whole blocks, a short last block
def test_row_max_is_torch_max_ties_included(v):
    g = torch.Generator().manual_seed(v)
    flat = torch.randn(40, v, generator=g)
    flat[1] = 0.5  # every entry tied: the first one wins
    flat[2, [3, v - 1]] = 9.0  # a tie between the first block and the last
    flat[3, [v - 1, v - 2]] = 9.0  # a tie inside the last block
    flat[4] = torch.finfo(torch.float32).min  # a row made of what `restrict` writes outside the allowed set
    flat[4, v // 2] = -1.0
    flat[5, : v // 2] = torch.finfo(torch.float32).min
    top, index = row_max(flat)
    want = flat.max(dim=-1)
    assert torch.equal(top, want.values) and torch.equal(index, want.indices)
    assert torch.equal(index, flat.argmax(-1))


def test_entropy_bound_accepts_what_the_reference_accepts():
    for seed in range(20):
        logits = _logits(seed=seed, scale=1.0 + seed)
        entropy = entropy_reference(logits)
        stats = CanvasStats(entropy, logits.argmax(-1), entropy, None)
        everyone = torch.ones_like(entropy, dtype=torch.bool)
        ours = EntropyBound(0.1 * (seed % 4 + 1)).accept(stats, 1, everyone)
        assert torch.equal(ours, entropy_bound_mask_reference(entropy, 0.1 * (seed % 4 + 1)))
        assert ours.any(-1).all(), "the lowest-entropy position is always accepted"


def test_samplers_respect_candidates_and_their_rules():
    logits = _logits(b=2, c=12)
    stats = canvas_stats(logits)
    candidates = torch.ones(2, 12, dtype=torch.bool)
    candidates[:, :3] = False  # pinned positions are never "accepted" by a sampler
    for sampler in (EntropyBound(1.0), ConfidenceThreshold(0.5), FixedCount(2)):
        acc = sampler.accept(stats, 1, candidates)
        assert not acc[:, :3].any() and acc.any(-1).all()
    conf = ConfidenceThreshold(0.3).accept(stats, 1, candidates)
    expected = (stats.confidence >= 0.3) & candidates
    expected[torch.arange(2), stats.confidence.masked_fill(~candidates, -1).argmax(-1)] = True
    assert torch.equal(conf, expected)
    fixed = FixedCount(2)
    assert fixed.accept(stats, 1, candidates).sum(-1).tolist() == [2, 2]
    assert fixed.accept(stats, 3, candidates).sum(-1).tolist() == [6, 6]
    assert fixed.accept(stats, 99, candidates).sum(-1).tolist() == [9, 9]
    low = stats.entropy.masked_fill(~candidates, float("inf")).argsort(-1)[:, :2]
    assert fixed.accept(stats, 1, candidates).gather(-1, low).all()


def _marginals(tokens: torch.Tensor, v: int) -> torch.Tensor:
    """Per-position empirical token distribution [C, V] over the batch of samples."""
    return torch.stack(
        [torch.bincount(tokens[:, j], minlength=v).float() / tokens.shape[0] for j in range(tokens.shape[1])]
    )


def _transition_law(logits: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
    """Exact per-position law of the next canvas token: softmax where accepted, uniform where renoised."""
    v = logits.shape[-1]
    return torch.where(accept[..., None], torch.softmax(logits, -1), torch.full_like(logits, 1.0 / v))


def test_fast_transition_has_the_reference_law():
    v, c, n = 6, 5, 20_000
    base = _logits(b=1, c=c, v=v, scale=1.5, seed=3)
    logits = base.expand(n, c, v).contiguous()
    canvas = torch.zeros(n, c, dtype=torch.long)
    torch.manual_seed(0)
    ref = reference_transition(logits, canvas, bound=0.8)
    accept = ref.accepted[0]
    assert 0 < int(accept.sum()) < c, "the test needs accepted and renoised positions"
    # the two paths compute the entropies differently (to rounding); no accept decision is near the bound,
    # so they must make the same ones
    low, _ = entropy_reference(base).sort(-1)
    assert ((low.cumsum(-1) - low - 0.8).abs() > 1e-3).all()
    law = _transition_law(base[0], accept)
    g = torch.Generator().manual_seed(1)
    pinned = torch.zeros(n, c, dtype=torch.bool)
    fast = fast_transition(logits.clone(), EntropyBound(0.8), 1, pinned, canvas, generator=g)
    assert torch.equal(fast.accepted, ref.accepted)
    tv_ref = 0.5 * (_marginals(ref.tokens, v) - law).abs().sum(-1).max()
    tv_fast = 0.5 * (_marginals(fast.tokens, v) - law).abs().sum(-1).max()
    assert tv_ref < 0.02 and tv_fast < 0.02, (tv_ref, tv_fast)
    # ...and the check can fail: a wrong temperature moves the law far beyond that tolerance
    hot = fast_transition(logits * 0.3, EntropyBound(0.8), 1, pinned, canvas, generator=g)
    assert 0.5 * (_marginals(hot.tokens, v) - law).abs().sum(-1).max() > 0.05


def test_a_greedy_transition_takes_the_argmax_where_it_accepts():
    """greedy (the server's temperature 0): the same positions accepted as a drawing step, each holding its
    argmax; the rest renoised as ever."""
    logits = _logits(b=64, c=5, v=6, scale=1.5, seed=4)
    pinned = torch.zeros(64, 5, dtype=torch.bool)
    canvas = torch.zeros(64, 5, dtype=torch.long)
    drawn = fast_transition(logits, EntropyBound(0.8), 1, pinned, canvas, torch.Generator().manual_seed(0))
    greedy = fast_transition(
        logits, EntropyBound(0.8), 1, pinned, canvas, torch.Generator().manual_seed(0), greedy=True
    )
    assert torch.equal(greedy.accepted, drawn.accepted) and 0 < int(greedy.accepted.sum()) < greedy.accepted.numel()
    argmax = logits.argmax(-1)
    assert torch.equal(greedy.tokens[greedy.accepted], argmax[greedy.accepted])
    assert not torch.equal(drawn.tokens[drawn.accepted], argmax[drawn.accepted])  # a draw is not the argmax


def test_draw_only_where_asked_and_from_softmax():
    v, n = 5, 30_000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]).expand(n, v).reshape(n, 1, v).contiguous()
    where = torch.ones(n, 1, dtype=torch.bool)
    where[::2] = False
    out = draw(logits, where, torch.Generator().manual_seed(0), chunk=4096)
    assert (out[::2] == 0).all()
    freq = torch.bincount(out[1::2, 0], minlength=v).float() / out[1::2].numel()
    assert 0.5 * (freq - torch.softmax(logits[0, 0], -1)).abs().sum() < 0.015


def test_pinned_positions_keep_their_values():
    logits = _logits(b=2, c=6, v=20)
    pinned = torch.zeros(2, 6, dtype=torch.bool)
    pinned[:, [1, 4]] = True
    values = torch.full((2, 6), -1)
    values[:, [1, 4]] = 7
    t = fast_transition(logits, EntropyBound(0.01), 1, pinned, values)
    assert (t.tokens[:, [1, 4]] == 7).all() and (t.argmax[:, [1, 4]] == 7).all()
    assert t.accepted[:, [1, 4]].all()


def test_stop_rule_matches_reference_and_counts_only_chosen_positions():
    stop = StableAndConfident(1, 0.5)
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    low = torch.full((2, 3), 0.1)
    assert stop(a, low).tolist() == [False, False]  # no history yet
    assert stop(a, low).tolist() == [True, True]
    b = a.clone()
    b[1, 2] = 9
    assert stop(b, low).tolist() == [True, False]
    counted = torch.tensor([[True, True, True], [True, True, False]])
    assert stop(b, low, counted).tolist() == [True, True]  # the changed position no longer counts
    high = low.clone()
    high[0, 0] = 5.0
    assert stop(b, high).tolist() == [False, True]
    rows = StableAndConfident(1, 0.5, canvas_shape=(3, 3))
    assert rows(a, low, rows=torch.tensor([0, 2])).tolist() == [False, False]
    assert rows(a, low, rows=torch.tensor([0, 2])).tolist() == [True, True]
    assert rows(a, low, rows=torch.tensor([1, 2])).tolist() == [False, True]
