"""Per-position allowed-token sets: the step's distribution is the constrained one, outputs keep to their
sets, and sets that allow everything change nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import load_quiet

from dgemma import fill, generate
from dgemma.generation.loop import Allowed, as_allowed
from dgemma.generation.sampling import canvas_stats, restrict

KW = dict(max_denoising_steps=4, seed=0, stop_token_ids=[])


@pytest.fixture(scope="module")
def model(moe_ckpt):
    return load_quiet(moe_ckpt[0], dtype="fp32")


def test_restrict_gives_the_distribution_over_the_allowed_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 50, generator=g) * 3
    classes = torch.zeros(2, 50, dtype=torch.bool)
    classes[0, [3, 7, 11]] = True
    classes[1, 20:] = True
    index = torch.tensor([[0, -1, 1, 0, -1], [-1, -1, -1, 1, 0]])
    out = logits.clone()
    restrict(out, classes, index, chunk=3)  # chunks that cut through rows of the batch
    for b in range(2):
        for c in range(5):
            k = int(index[b, c])
            if k < 0:  # unconstrained positions keep their bits
                assert torch.equal(out[b, c], logits[b, c])
                continue
            allowed = classes[k]
            want = torch.zeros(50)
            want[allowed] = torch.softmax(logits[b, c, allowed], -1)
            # softmax over the allowed logits alone: the same numbers but for fp32 rounding of the sum
            torch.testing.assert_close(torch.softmax(out[b, c], -1), want, rtol=1e-6, atol=1e-7)
    stats = canvas_stats(out)
    p = torch.softmax(out, -1)
    direct = -(p * torch.log(p.clamp(min=1e-38))).sum(-1)
    assert torch.isfinite(stats.entropy).all()
    torch.testing.assert_close(stats.entropy, direct, rtol=1e-5, atol=1e-5)  # two entropy formulas, fp32 rounding
    assert bool(classes[index.clamp(min=0), stats.argmax][index >= 0].all())


def test_outputs_keep_to_their_sets_across_canvases_and_rows(model):
    v = model.text_config.vocab_size
    length = 13  # two canvases of 8
    sets = [[None] * length, [None] * length]
    for i in range(0, length, 2):
        sets[0][i] = {1 + i, 2 + i}
        sets[1][i] = set(range(40, 50))
    r = generate(model, [[2, 5, 6], [2, 9]], allowed=sets, max_new_tokens=length, **KW)
    assert r.stats.canvases == 2
    for row, out in zip(sets, r.tokens, strict=True):
        assert len(out) == length
        assert all(s is None or t in s for s, t in zip(row, out, strict=True))
    # a one-token set acts as a pin
    one = [None, {7}, None, {v - 1}]
    out = generate(model, [2, 5], allowed=one, max_new_tokens=4, **KW).tokens[0]
    assert out[1] == 7 and out[3] == v - 1


def test_sets_that_allow_everything_change_nothing(model):
    everything = torch.ones(model.text_config.vocab_size, dtype=torch.bool)
    free = generate(model, [2, 5, 6], max_new_tokens=12, **KW)
    same = generate(model, [2, 5, 6], allowed=[everything] * 12, max_new_tokens=12, **KW)
    assert free.tokens == same.tokens  # masked_fill with no True entry leaves every logit's bits


def test_the_constraint_moves_the_draft_not_just_the_output(model):
    # without the constraint the argmax at position 0 is some token t; forbidding t must change the draft
    free = generate(model, [2, 5, 6], max_new_tokens=4, **KW).tokens[0]
    others = set(range(model.text_config.vocab_size)) - {free[0]}
    out = generate(model, [2, 5, 6], allowed=[others, None, None, None], max_new_tokens=4, **KW).tokens[0]
    assert out[0] != free[0]


def test_fill_takes_allowed_aligned_with_its_template(model):
    template = [None, 5, None, None]
    r = fill(model, template, allowed=[{10, 11}, None, {12}, None], max_denoising_steps=3, seed=1)
    assert r.tokens[0][0] in {10, 11} and r.tokens[0][1] == 5 and r.tokens[0][2] == 12


@pytest.mark.parametrize(
    "allowed, message",
    [
        ([set()], "empty"),
        ([{10**6}], "outside the vocabulary"),
        ([{"a"}], "collection of token ids"),
        ([[None], [None, None]], "same length"),
    ],
)
def test_bad_sets_are_refused(model, allowed, message):
    with pytest.raises(ValueError, match=message):
        generate(model, [2, 5], allowed=allowed, max_new_tokens=2, **KW)


def test_pins_outside_their_set_and_exact_mode_are_refused(model):
    with pytest.raises(ValueError, match="not in its allowed set"):
        fill(model, [5, None], allowed=[{6}, None], max_denoising_steps=2)
    with pytest.raises(ValueError, match="mode 'fast'"):
        generate(model, [2, 5], allowed=[{3}], max_new_tokens=2, mode="exact")
    bad = Allowed(torch.zeros(1, 4, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="bool"):
        generate(model, [2, 5], allowed=bad, max_new_tokens=2)


def test_one_row_of_sets_is_broadcast_and_batches_are_kept():
    one = as_allowed([None, {1, 2}], rows=3, vocab_size=8)
    assert one.index.tolist() == [[-1, 0]] * 3
    batch = as_allowed([[None, {1}], [{2}, {1}]], rows=2, vocab_size=8)
    assert batch.index.tolist() == [[-1, 0], [1, 0]] and batch.classes.shape == (2, 8)
