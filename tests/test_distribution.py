"""Fast mode against exact mode over many samples: the same law of outputs, on a model far from one-hot.

`test_generate.py` checks exact mode token for token against transformers, and fast mode against exact
mode on a peaked model (where every draw is the argmax); `test_sampling.py` checks one fast step's law on
fixed logits. What neither covers is the whole loop on a model whose draws are really random: several
steps with self-conditioning, the entropy-bound acceptance, the stop rule ending canvases at different
steps, and rows leaving the batch at different steps and canvases. Here each mode generates from one
prompt repeated over many rows (the rows of a batch are independent samples), and the outputs are
compared as distributions (chi-square tests of frequency tables, z-tests of means).
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from helpers import load_quiet, make_oracle_checkpoint

from dgemma.generation.programs import generate

ROWS = 2000  # samples per mode
CANVAS, STEPS, NEW = 4, 6, 8  # two canvases of up to 6 steps
EOS = 1
# Low temperatures and a wide entropy bound let drafts settle, so the stop rule ends canvases anywhere from
# step 2 to the cap; the first step still has ~1.2 nats per position (of log 16 = 2.8): far from one-hot.
SETTINGS = dict(
    max_new_tokens=NEW,
    max_denoising_steps=STEPS,
    t_min=0.1,
    t_max=0.3,
    entropy_bound=1.5,
    stability_threshold=1,
    confidence_threshold=0.3,
    stop_token_ids=[EOS],
)
# False-failure rate: on a machine whose rounding changes the draws, each run is a fresh sample, and the
# test below fails one that has the same law with probability at most ALPHA (Bonferroni over its 13 tests;
# over 12 such runs with other seeds, 2 of 156 p-values fell under 0.05: the tests are if anything cautious).
ALPHA = 1e-4


def small_model(directory, self_conditioning_gain: float = 3.0):
    """A tiny random checkpoint with a 16-token vocabulary (a token's frequency is then well estimated from a
    few thousand samples), canvases of 4 and 2 layers (fast). Its self-conditioning block's output is
    scaled up so that a step's signal changes the next step's law clearly (~0.25 in total variation)."""
    with warnings.catch_warnings():  # 2 layers: the config says it makes the last one global, as it must be
        warnings.filterwarnings("ignore", message=".*last layer must use full attention.*")
        make_oracle_checkpoint(directory, seed=0, canvas_length=CANVAS, vocab_size=16, num_hidden_layers=2)
        model = load_quiet(directory, dtype="fp32")
    with torch.no_grad():
        model.self_conditioning.down_proj.weight.mul_(self_conditioning_gain)
    return model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_model(tmp_path_factory.mktemp("small-vocab"))


def _tables(result) -> dict[str, Counter]:
    """Per-row outcomes of a batch, as one frequency table per statistic."""
    tables: dict[str, Counter] = {f"token {j}": Counter() for j in range(NEW)}
    tables |= {f"canvas {k} steps, stopped by the rule": Counter() for k in (1, 2)}
    tables["finish reason, length"] = Counter()
    for tokens, reason, steps, converged in zip(
        result.tokens,
        result.finish_reasons,
        result.stats.steps_per_canvas,
        result.stats.converged_per_canvas,
        strict=True,
    ):
        for j in range(NEW):
            tables[f"token {j}"][tokens[j] if j < len(tokens) else "ended"] += 1
        for k in (1, 2):  # a row that stopped in canvas 1 runs no step of canvas 2 (0 steps)
            ran = k <= len(steps) and steps[k - 1] > 0
            tables[f"canvas {k} steps, stopped by the rule"][(steps[k - 1], converged[k - 1]) if ran else None] += 1
        tables["finish reason, length"][(reason, len(tokens))] += 1
    return tables


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of Pearson's chi-square test that two frequency tables are samples of one law. Categories
    seen fewer than 10 times in both tables together are pooled (the test's chi-square law needs expected
    counts of 5 or more), with the next rarest added if the pool itself stays under 10."""
    keys = sorted(set(a) | set(b), key=lambda k: a[k] + b[k])
    counts = torch.tensor([[a[k] for k in keys], [b[k] for k in keys]], dtype=torch.float64)
    total = counts.sum(0)
    rare = int((total < 10).sum())
    if rare and total[:rare].sum() < 10:
        rare += 1
    if rare > 1:
        counts = torch.cat([counts[:, :rare].sum(1, keepdim=True), counts[:, rare:]], 1)
    if counts.shape[1] < 2:
        return 1.0
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def mean_p(a: list[int], b: list[int]) -> float:
    """Two-sided p-value of the z-test that two samples have one mean (thousands of samples of a bounded
    count: the normal law of the difference holds). More sensitive than the table to a shift in a count."""
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    spread = (a.var() / len(a) + b.var() / len(b)).sqrt()
    if spread == 0:
        return float(a.mean() == b.mean())
    return float(torch.special.erfc((a.mean() - b.mean()).abs() / spread / 2**0.5))


def compare(fast, exact) -> dict[str, float]:
    """The p-value of each statistic's test, fast against exact: a chi-square test per table, and z-tests of
    the mean steps and the mean number of tokens of a row."""
    exact_tables = _tables(exact)
    p = {name: chi_square_p(table, exact_tables[name]) for name, table in _tables(fast).items()}
    for name, of in (("steps", lambda r: [sum(s) for s in r.stats.steps_per_canvas]), ("tokens", _lengths)):
        p[f"mean {name}"] = mean_p(of(fast), of(exact))
    return p


def _lengths(result) -> list[int]:
    return [len(t) for t in result.tokens]


def run(model, mode: str, seed: int):
    return generate(model, [[5, 6, 7]] * ROWS, mode=mode, seed=seed, **SETTINGS)


@pytest.fixture(scope="module")
def runs(model):
    """(exact, fast): one batch of ROWS samples in each mode (different seeds: independent samples)."""
    return run(model, "exact", seed=0), run(model, "fast", seed=1)


def test_fast_mode_has_the_law_of_exact_mode_over_whole_generations(runs):
    """Per-position tokens, steps per canvas with whether the stop rule ended it, finish reasons and lengths,
    mean steps and tokens: one law in both modes. Shown to fail (min p < 1e-16, in a patched copy of
    `_Loop._fast_step` / `run`) for a temperature 5% high or one step late, no or stale self-conditioning,
    a stop rule with no stability check, one step more of it, or another row's history; a 10-20% error in
    the entropy bound or in the stop rule's entropy moves the law too little to be seen in 2000 rows."""
    exact, fast = runs
    for result in runs:  # the run exercises what it is meant to: rows stop at different steps and canvases
        steps = Counter(s[0] for s in result.stats.steps_per_canvas)
        assert len(steps) >= 4 and steps[STEPS] < 0.8 * ROWS, steps
        assert 0.2 < result.finish_reasons.count("stop") / ROWS < 0.8
        assert sum(len(s) > 1 and s[1] == 0 for s in result.stats.steps_per_canvas) > 0.1 * ROWS  # left early
    p = compare(fast, exact)
    assert min(p.values()) > ALPHA / len(p), {name: f"{v:.1e}" for name, v in p.items()}


def test_rows_that_had_stopped_count_as_converged_in_both_modes(runs):
    """GenerationStats.converged_per_canvas: 'a row that had already stopped counts as ended'. Fast mode
    does so; exact mode keeps denoising such rows (as the reference does) and records whether its stop rule
    happened to end them before the canvas ended (generate.py, _Loop.run: `st.done` without finished rows)."""
    for result in runs:
        for steps, converged in zip(result.stats.steps_per_canvas, result.stats.converged_per_canvas, strict=True):
            assert all(c for s, c in zip(steps, converged, strict=True) if s == 0)
