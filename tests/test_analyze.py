"""`dgemma analyze` on the shipped models, offline: it writes traces that load back, statistics that
agree with them, and its pictures; bad inputs are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dgemma import analysis
from dgemma.cli import main
from dgemma.tasks import extract, sudoku
from dgemma.tracing import Trace

pytest.importorskip("matplotlib")


def _traces(out) -> list[Trace]:
    return [Trace.from_dict(json.loads(line)) for line in (out / "traces.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not (sudoku.MODEL_DIR / "model.safetensors").is_file(), reason="the Sudoku model is not shipped")
def test_sudoku_traces_statistics_and_pictures(tmp_path, capsys):
    out = tmp_path / "sudoku"
    assert main(["analyze", "--task", "sudoku", "--n", "4", "--out", str(out), "--max-denoising-steps", "12"]) == 0
    traces = _traces(out)
    stats = json.loads((out / "stats.json").read_text())
    assert len(traces) == stats["generations"] == 4
    for t in traces:
        (c,) = t.canvases
        blanks = np.array([ch == sudoku.BLANK for ch in t.meta["puzzle"]])
        assert np.array_equal(c.content, blanks)  # the clues are pinned; the blanks are what is measured
        assert c.steps <= 12 == t.max_steps
    assert stats["left_to_right"]["token"] == pytest.approx(analysis.left_to_right(traces))
    assert stats["tokens_per_forward"] == pytest.approx(analysis.tokens_per_forward(traces))
    right = sum(
        int((c.tokens[c.content] == np.array(t.meta["reference"])[c.content]).sum()) for t in traces for c in t.canvases
    )
    assert stats["calibration"]["accuracy"] == pytest.approx(right / stats["content_tokens"])
    assert -1 <= stats["sudoku"]["constraints_vs_step_rho"] <= 1
    for name in ("heatmap.png", "commits.png", "calibration.png", "sudoku.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "left-to-right rho" in capsys.readouterr().out


@pytest.mark.skipif(
    not (extract.MODEL_DIR / "model.safetensors").is_file(), reason="the extraction model is not shipped"
)
def test_extract_traces_are_the_generations(tmp_path):
    import dgemma

    out = tmp_path / "extract"
    args = ["analyze", "--task", "extract", "--n", "2", "--out", str(out), "--no-pictures", "--kernels", "reference"]
    assert main(args) == 0  # the reference modules, as dgemma.generate runs them: the same tokens
    traces = _traces(out)
    model = dgemma.load(extract.MODEL_DIR, dtype="auto")
    for i, t in enumerate(traces):  # generation i draws with seed i
        assert t.tokens == dgemma.generate(model, t.prompt, seed=i).tokens[0]
    assert not list(out.glob("*.png"))


def test_prompts_from_a_file_and_refusals(tmp_path, model_dir, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello", "reference": "a b"}\n\n{"prompt": "x = ", "reference": "1"}\n')
    out = tmp_path / "out"
    args = ["analyze", "-m", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "8"]
    assert main([*args, "--max-denoising-steps", "3"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["generations"] == 2 and "calibration" in stats and "line" in stats["left_to_right"]
    bad = tmp_path / "bad.jsonl"
    for text, message in (('{"text": 1}', 'needs a "prompt"'), ("nope", "not JSON"), ("", "holds no prompt")):
        bad.write_text(text)
        assert main(["analyze", "-m", str(model_dir), "--prompts", str(bad), "--out", str(out)]) != 0
        assert message in capsys.readouterr().err
    assert main(["analyze", "-m", str(model_dir), "-p", "x", "--task", "sudoku", "--out", str(out)]) != 0
    assert "one of" in capsys.readouterr().err
