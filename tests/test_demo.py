"""`dgemma demo` runs non-interactively: plain text (no escape codes), every part, the statistics."""

from __future__ import annotations

import pytest
from helpers import make_tokenizer

import dgemma
from dgemma.cli import main
from dgemma.cli.demo import CODE_MODEL_DIR
from dgemma.tasks import sudoku


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random code model (BPE tokenizer, canvas 16) and a random Sudoku-format model."""
    root = tmp_path_factory.mktemp("demo")
    config = dgemma.preset("tiny")
    config.canvas_length = 16
    dgemma.save(dgemma.build(config, seed=0), root / "code")
    make_tokenizer(512).save(root / "code")
    config = dgemma.preset("tiny")
    config.text_config.vocab_size, config.canvas_length = 15, 81
    dgemma.save(dgemma.build(config, seed=0), root / "sudoku")
    sudoku.make_tokenizer().save(root / "sudoku")
    return root


def test_demo_plain_output(models, capsys):
    assert main(["demo", "--model", str(models / "code"), "--sudoku-model", str(models / "sudoku")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out  # not a terminal: no escape codes
    for part in ("1. A canvas", "2. Infilling", "3. Editing", "4. A Sudoku", "Statistics"):
        assert part in out
    assert "-- canvas 1, step 1 --" in out  # snapshots of the denoising
    stats = out.split("== Statistics ==")[1]
    assert all(name in stats for name in ("generate", "infill", "edit", "sudoku"))
    rows = {line.split()[0]: line.split() for line in stats.splitlines() if line.strip()}
    assert rows["AR"][1] == rows["AR"][2] and float(rows["AR"][3]) == 1.0  # one forward per token
    assert rows["generate"][-1].endswith("x") and not rows["sudoku"][-1].endswith("x")  # code parts vs AR


def test_demo_json_compares_the_code_parts_with_ar(models, capsys):
    import json

    assert main(["demo", "--model", str(models / "code"), "--no-sudoku", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ar = report["ar"]
    assert ar["name"] == "AR" and ar["tokens"] == ar["forwards"] > 0
    part = next(p for p in report["parts"] if p["name"] == "generate")
    want = (part["tokens"] / part["seconds"]) / (ar["tokens"] / ar["seconds"])
    assert part["vs_ar"] == pytest.approx(want, rel=1e-2)


def test_demo_without_a_code_model_says_what_to_do(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path)]) != 0
    assert "no code model" in capsys.readouterr().err


def test_demo_on_the_shipped_models(capsys):
    """What the README's first command runs: no arguments, the models inside the package."""
    assert (CODE_MODEL_DIR / "model.safetensors").is_file()
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "code model code (6.3M parameters" in out and "solved: a valid grid" in out
    assert "\x1b" not in out
