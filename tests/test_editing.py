"""Infilling, editing and templates: given positions are kept, holes are generated, bad input is refused."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import load_quiet

from dgemma import edit, fill, infill
from dgemma.generation.editing import SCORED_SUFFIX, cut_at_end, infill_template, max_middle_length
from dgemma.generation.engine import score
from dgemma.generation.loop import end_of_text_ids

KW = dict(max_denoising_steps=3, seed=0)
EOS = 1  # the tiny checkpoint's end-of-text token


@pytest.fixture(scope="module")
def model(moe_ckpt):
    return load_quiet(moe_ckpt[0], dtype="fp32")


def test_fill_keeps_given_tokens_and_fills_holes(model):
    template = [None, 5, None, 7, None, None, 9, None, None, None, 11, None]  # spans two canvases of 8
    r = fill(model, template, **KW)
    out = r.tokens[0]
    assert len(out) == len(template)
    assert all(o == t for o, t in zip(out, template, strict=True) if t is not None)
    assert r.stats.canvases == 2
    batch = fill(model, [[None, 3, None], [4, None, 4]], prompt=[[2, 8], [2]], **KW)
    assert batch.tokens[0][1] == 3 and batch.tokens[1][0] == batch.tokens[1][2] == 4


def test_infill_with_given_length_keeps_both_sides(model):
    r = infill(model, [5, 6, 7], [40, 41, 42], 3, **KW)
    assert r.middle_length == 3 and len(r.middle) == 3
    assert r.tokens == [5, 6, 7, *r.middle, 40, 41, 42]
    # the canvas held [middle | suffix | end-of-text fill]
    assert r.result.tokens[0][3:6] == [40, 41, 42] and r.result.tokens[0][6:] == [1, 1]


@contextlib.contextmanager
def boosted_eos(model, factor):
    """Make the end-of-text token likely, so an untrained model ends the text inside the middle."""
    row = model.embed_tokens.weight[EOS]
    saved = row.clone()
    with torch.no_grad():
        row *= factor
    try:
        yield
    finally:
        with torch.no_grad():
            row.copy_(saved)


def _cut(ids):
    return ids[: ids.index(EOS)] if EOS in ids else ids


@pytest.mark.parametrize("length_score", ["encoder", "denoiser"])
def test_infill_auto_length_scores_candidates(model, length_score):
    r = infill(model, [5, 6, 7], [40, 41], length_score=length_score, **KW)
    assert set(r.scores) == {2, 4} and r.middle_length == max(r.scores, key=r.scores.get)
    assert r.middle == _cut(r.result.tokens[list(r.scores).index(r.middle_length)][: r.middle_length])
    for i, (n, given) in enumerate(r.scores.items()):
        middle = _cut(r.result.tokens[i][:n])
        # batched passes against one row at a time: equal to rounding (fp32, a few ulps of a log-softmax)
        assert given == pytest.approx(_slow_score(model, [5, 6, 7], middle, [40, 41], length_score), abs=1e-5)


@torch.no_grad()
def _slow_score(model, prompt, middle, suffix, length_score):
    """The length score of one candidate, written out: the middle, then what follows it in the text."""
    if length_score == "encoder":  # the middle, the suffix and the end of text, SCORED_SUFFIX tokens after
        return float(_slow_logprobs(model, prompt, (middle + suffix + [EOS])[: len(middle) + SCORED_SUFFIX]).mean())
    canvas_length = model.config.canvas_length
    canvas = (middle + suffix + [EOS] * canvas_length)[:canvas_length]
    cache = model.new_cache(1, len(prompt))
    model.encode(torch.tensor([prompt]), cache)
    logp = torch.log_softmax(model.denoise(torch.tensor([canvas]), cache)[0], -1)
    scored = min(len(middle) + len(suffix) + 1, canvas_length)  # middle, visible suffix, first end-of-text pin
    return float(logp[torch.arange(scored), torch.tensor(canvas[:scored])].mean())


def test_middle_ends_at_its_first_end_of_text_token(model):
    seen = 0
    with boosted_eos(model, 4.0):
        for seed in range(4):
            # 5: the longest middle that leaves the canvas room for the suffix and its end (infill_limit)
            r = infill(model, [5, 6, 7], [40, 41], 5, max_denoising_steps=3, seed=seed)
            raw = r.result.tokens[0][:5]
            seen += EOS in raw
            assert r.middle == _cut(raw) and EOS not in r.middle
            assert r.tokens == [5, 6, 7, *r.middle, 40, 41] and r.middle_length == 5
    assert seen, "the boosted model should end the text inside some middle (else this test checks nothing)"


@pytest.mark.parametrize("suffix", [[], [40, 41]])
@pytest.mark.parametrize("length_score", ["encoder", "denoiser"])
def test_auto_length_scores_the_text_a_fill_gives_not_its_end_of_text_run(model, suffix, length_score):
    # the reported case: an empty prefix or suffix, and a model that likes to end the text
    seen = 0
    with boosted_eos(model, 4.0):
        for seed in range(3):
            r = infill(model, [], suffix, length_score=length_score, max_denoising_steps=3, seed=seed)
            assert EOS not in r.middle and r.tokens == r.middle + suffix
            for i, (n, score) in enumerate(r.scores.items()):
                raw = r.result.tokens[i][:n]
                seen += EOS in raw
                # a fill that ends early is scored as the shorter middle it is (rounding: batched rows)
                assert score == pytest.approx(_slow_score(model, [2], _cut(raw), suffix, length_score), abs=1e-5)
    assert seen, "the boosted model should end the text inside some fill (else this test checks nothing)"


def test_public_template_helpers(model):
    assert end_of_text_ids(model) == [EOS]
    assert max_middle_length(model) == model.config.canvas_length - 1 == 7
    assert infill_template(model, [40, 41], 3) == [None, None, None, 40, 41, EOS, EOS, EOS]
    assert infill_template(model, list(range(40, 50)), 7) == [None] * 7 + [40]  # only what fits is seen
    assert infill_template(model, [], 2) == [None, None] + [EOS] * 6
    assert cut_at_end(model, [5, 6, EOS, 7, EOS]) == [5, 6]
    assert cut_at_end(model, [EOS, 5]) == [] and cut_at_end(model, [5, 6]) == [5, 6]
    for bad in (0, 8, True, "3"):
        with pytest.raises(ValueError, match=r"middle_length must be an integer in \[1, 7\]"):
            infill_template(model, [40], bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        infill_template(model, [40, 999], 2)


@torch.no_grad()
def _slow_logprobs(model, prompt, continuation):
    """One row, one encode of the whole text: the reference for calls.score's batched passes."""
    ids = torch.tensor([prompt + continuation])
    logits = model.encode(ids, model.new_cache(1, ids.shape[1]), return_logits=True).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)[len(prompt) - 1 :]


@pytest.mark.parametrize("prompt", [[2], [5, 6, 7], list(range(3, 40))])  # the last is longer than a window
def test_scores_match_one_row_at_a_time(model, prompt):
    rows = [[9], [10, 11, 12, 13], list(range(20, 31))]
    fast = score(model, prompt, rows).logprobs
    for row, got in zip(rows, fast, strict=True):
        assert got.shape == (len(row),)
        torch.testing.assert_close(got, _slow_logprobs(model, prompt, row), atol=1e-5, rtol=1e-5)


def test_edit_rewrites_only_the_span(model):
    text = list(range(10, 30))
    r = edit(model, text, (4, 7), **KW)
    assert r.tokens[:4] == text[:4] and r.tokens[7:] == text[7:] and len(r.tokens) == len(text)
    longer = edit(model, text, (4, 7), new_length=5, **KW)
    assert len(longer.tokens) == len(text) + 2 and longer.tokens[9:] == text[7:]
    inserted = edit(model, text, (0, 0), new_length=2, **KW)
    assert inserted.tokens[2:] == text


def test_text_api_with_tokenizer(model, tmp_path):
    from helpers import make_tokenizer

    tok = make_tokenizer(512)
    r = infill(model, "def f(x):\n    ", "\n    return y", 4, tokenizer=tok, **KW)
    assert r.text.startswith("def f(x):\n    ") and r.text.endswith("\n    return y")
    assert r.middle_text == tok.decode(r.middle)


def test_a_middle_too_long_to_see_the_suffix_is_reduced_as_the_server_reduces_it(model):
    """`middle_length` (the server's `max_tokens` with `suffix`) above `infill_limit` is reduced to it: the
    canvas keeps room for the suffix and its end, up to half the canvas; the result says the length used."""
    from dgemma.generation.editing import infill_limit

    for suffix in ([6], list(range(40, 52))):
        r = infill(model, [5], suffix, middle_length=99, **KW)
        assert r.middle_length == infill_limit(model, suffix) == 8 - min(len(suffix) + 1, 4)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: fill(m, []), "non-empty list"),
        (lambda m: fill(m, [1, 2, 3]), "no hole"),
        (lambda m: fill(m, [None, 999]), "outside the vocabulary"),
        (lambda m: fill(m, [[None], [None, 1]]), "same length"),
        (lambda m: fill(m, [[None], [None]], prompt=[[1], [2], [3]]), "3 prompts for 2 templates"),
        (lambda m: infill(m, [5], [6], middle_length=0), "middle_length must be"),
        (lambda m: infill(m, [5], [6], middle_length=-3), "middle_length must be"),
        (lambda m: infill(m, "text", [6]), "needs a tokenizer"),
        (lambda m: infill(m, [5], [6], length_score="best"), "length_score must be"),
        (lambda m: edit(m, [5, 6, 7], (2, 9)), "not within the text"),
        (lambda m: edit(m, [5, 6, 7], (2, 1)), "not within the text"),
        (lambda m: edit(m, [5, 6, 7], (1, 1)), "give new_length"),
        (lambda m: edit(m, [5, 6, 7], "1:2"), "span must be"),
    ],
)
def test_bad_input(model, call, message):
    with pytest.raises(ValueError, match=message):
        call(model)
