"""Traces and their statistics on constructed step sequences with known answers; a traced generation
returns the tokens an untraced one does; the rank statistics agree with scipy and scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest

import dgemma
from dgemma import analysis
from dgemma.tracing import Trace, canvas_trace, trace


def _canvas(drafts, accepted=None, pinned=None, content=None, conf=None):
    drafts = np.asarray(drafts)
    s, c = drafts.shape
    accepted = np.zeros((s, c), bool) if accepted is None else np.asarray(accepted, bool)
    conf = np.full((s, c), 0.5) if conf is None else np.asarray(conf)
    ent = np.tile(np.arange(s, 0, -1.0)[:, None], (1, c))  # entropy s, s-1, ..., 1 at every position
    pinned = np.zeros(c, bool) if pinned is None else np.asarray(pinned, bool)
    content = np.ones(c, bool) if content is None else np.asarray(content, bool)
    return canvas_trace(0, drafts, accepted, ent, conf, pinned, content)


def _trace(*canvases, max_steps=8):
    return Trace([1], [], list(canvases), max_steps)


def test_a_canvas_record_from_its_steps():
    # 4 positions over 4 steps: 0 is right from the start; 1 settles at step 2; 2 changes back and forth
    # and settles at step 4; 3 is pinned
    drafts = [[7, 1, 5, 9], [7, 2, 6, 9], [7, 2, 5, 9], [7, 2, 8, 9]]
    accepted = [[1, 0, 0, 1], [0, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]]
    c = _canvas(drafts, accepted, pinned=[0, 0, 0, 1])
    assert c.tokens.tolist() == [7, 2, 8, 9] and c.steps == 4
    assert c.final_step.tolist() == [1, 2, 4, 1]
    assert c.first_accepted.tolist() == [1, 2, 3, 1]
    assert c.changes.tolist() == [0, 1, 3, 0]
    assert c.content.tolist() == [True, True, True, False]  # pinned positions are not content
    assert c.finalised_per_step.tolist() == [1, 1, 0, 1]
    assert c.accepted_per_step.tolist() == [1, 1, 2, 2]  # content positions accepted at each step
    assert c.first_accepted_per_step.tolist() == [1, 1, 1, 0]
    assert c.mean_entropy.tolist() == [4, 3, 2, 1]
    never = _canvas([[3, 4], [3, 4]])
    assert never.first_accepted.tolist() == [0, 0]  # never accepted


def test_confidence_at_commit_is_read_at_the_finalisation_step():
    conf = [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]
    c = _canvas([[1, 9], [1, 2], [1, 2]], conf=conf)
    assert c.final_step.tolist() == [1, 2]
    assert np.allclose(c.commit_confidence, [0.1, 0.4])


def test_left_to_right_bias_at_each_granularity():
    ltr = _canvas(_staircase(4))
    assert ltr.final_step.tolist() == [1, 2, 3, 4]
    assert analysis.left_to_right([_trace(ltr)]) == pytest.approx(1.0)
    rtl = _canvas(_staircase(4)[:, ::-1])
    assert analysis.left_to_right([_trace(rtl)]) == pytest.approx(-1.0)
    # 8 positions finalised at steps 2 1 2 1 | 4 3 4 3: no order inside windows of 4, strict order between
    steps = [2, 1, 2, 1, 4, 3, 4, 3]
    c = _canvas(_finalised_at(steps))
    assert c.final_step.tolist() == steps
    assert analysis.left_to_right([_trace(c)], "window", window=4) == pytest.approx(1.0)
    assert analysis.left_to_right([_trace(c)], "token") == pytest.approx(analysis.spearman(range(8), steps))
    texts = {i: "\n" if i in (1, 5) else "x" for i in range(10)}  # lines: positions 0-1, 2-5, 6-7
    lines = _canvas(_finalised_at([3, 3, 1, 1, 2, 2, 2, 2]))  # its tokens are 0..7
    rho = analysis.left_to_right([_trace(lines)], "line", texts=lambda ids: [texts[i] for i in ids])
    assert rho == pytest.approx(analysis.spearman([0, 1, 2], [3, 1.5, 2]))


def _staircase(n: int) -> np.ndarray:
    """n positions over n steps, position i finalised at step i + 1 (its argmax wrong before)."""
    return _finalised_at(list(range(1, n + 1)))


def _finalised_at(steps: list[int]) -> np.ndarray:
    s = max(steps)
    drafts = np.full((s, len(steps)), 100)
    for i, f in enumerate(steps):
        drafts[: f - 1, i] = 200 + np.arange(f - 1)  # other tokens before its step
        drafts[f - 1 :, i] = i
    return drafts


def test_commit_sizes_late_burst_and_tokens_per_forward():
    a = _canvas(_finalised_at([1, 1, 1, 4, 4, 4, 4, 4]))  # 8 tokens, 4 steps: batches of 3 and 5
    b = _canvas(_finalised_at([2, 2]), content=[True, False])  # one content token, finalised at step 2
    traces = [_trace(a), _trace(b)]
    sizes = analysis.commit_sizes(traces)
    assert sizes.per_step == [1.5, 0.5, 0.0, 5.0]  # step 4 is run by one canvas only
    assert sizes.largest_share == pytest.approx((5 / 8 + 1) / 2)
    assert sizes.steps_with_commits == 1.5
    burst = analysis.late_burst(traces, k=1)  # a's last step finalises 5, b's last (2) its one
    assert burst.share == pytest.approx(6 / 9) and burst.steps_used == pytest.approx((4 / 8 + 2 / 8) / 2)
    assert analysis.tokens_per_forward(traces) == pytest.approx(9 / 6)


def test_calibration_and_auroc():
    conf = np.array([[0.95, 0.9, 0.15, 0.1]])
    c = _canvas([[1, 2, 3, 4]], conf=conf)
    right = np.array([1, 1, 0, 1])
    cal = analysis.calibration([_trace(c)], lambda t, canvas: right, n_bins=2)
    assert cal.count == 4 and cal.accuracy == 0.75
    unknown = analysis.calibration([_trace(c)], lambda t, canvas: np.array([1, -1, 0, -1]), n_bins=2)
    assert unknown.count == 2 and unknown.auroc == 1.0  # positions without a reference are left out
    assert [b[2] for b in cal.bins] == [2, 2] and [b[4] for b in cal.bins] == [0.5, 1.0]
    assert cal.ece == pytest.approx((2 * abs(0.5 - 0.125) + 2 * abs(1.0 - 0.925)) / 4)
    assert cal.auroc == pytest.approx(2 / 3)  # the right 0.1 is below the wrong 0.15


def test_rank_statistics_agree_with_scipy_and_sklearn():
    from scipy import stats
    from sklearn import metrics

    rng = np.random.default_rng(0)
    for _ in range(20):
        x, y = rng.integers(0, 6, 40), rng.normal(size=40)  # ties in x
        assert analysis.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
        labels = rng.random(40) < 0.5
        scores = np.round(rng.random(40), 1)  # ties in the scores
        assert analysis.auroc(scores, labels) == pytest.approx(metrics.roc_auc_score(labels, scores), abs=1e-12)


def test_a_traced_generation_returns_the_untraced_tokens_and_saves_both_ways(tmp_path, model_dir):
    from helpers import load_quiet

    from dgemma.checkpoints.tokenizer import Tokenizer

    model, tok = load_quiet(model_dir), Tokenizer.from_dir(model_dir)
    kw = dict(seed=3, max_new_tokens=40, max_denoising_steps=6)
    t = trace(model, "hello there", tokenizer=tok, **kw)
    assert t.tokens == dgemma.generate(model, "hello there", tokenizer=tok, **kw).tokens[0]
    assert t.max_steps == 6 and all(1 <= c.steps <= 6 for c in t.canvases)
    assert sum(int(c.content.sum()) for c in t.canvases) == len(t.tokens)
    for c in t.canvases:
        assert c.entropy.shape == c.confidence.shape == (c.steps, model.config.canvas_length)
        assert np.all((c.confidence > 0) & (c.confidence <= 1)) and np.all(c.final_step >= 1)
    for name in ("t.json", "t.npz"):
        back = Trace.load(t.save(tmp_path / name))
        assert back.tokens == t.tokens and back.max_steps == 6
        assert all(np.array_equal(a.final_step, b.final_step) and np.allclose(a.entropy, b.entropy)
                   for a, b in zip(back.canvases, t.canvases, strict=True))  # fmt: skip
    exact = dict(kw, mode="exact")
    assert (
        trace(model, "hello", tokenizer=tok, **exact).tokens
        == dgemma.generate(model, "hello", tokenizer=tok, **exact).tokens[0]
    )
    pins = torch_pins(model, 40)
    pinned = trace(model, "hello there", tokenizer=tok, pins=pins, **kw)
    assert pinned.canvases[0].pinned[:2].all() and not pinned.canvases[0].content[:2].any()


def torch_pins(model, length: int):
    import torch

    pins = torch.full((1, length), -1, dtype=torch.long)
    pins[0, :2] = 5
    return pins
