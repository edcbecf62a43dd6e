"""The `dgemma` console script."""

from __future__ import annotations

import json
import subprocess
import sys

from dgemma.cli import main


def test_info_preset_json(capsys):
    assert main(["info", "--preset", "26b-a4b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == "preset 26b-a4b"
    assert 25.1e9 < info["parameters_total"] < 25.3e9 and 3.75e9 < info["parameters_active"] < 3.9e9
    assert info["generation_defaults"]["max_denoising_steps"] == 48


def test_info_checkpoint_table(moe_ckpt, capsys):
    assert main(["info", str(moe_ckpt[0])]) == 0
    out = capsys.readouterr().out
    assert "4 experts (top-2" in out and "tokenizer.json           absent" in out


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dgemma info: error:") and "config.json" in err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "dgemma.cli", "--help"], capture_output=True, text=True, check=True)
    assert "DiffusionGemma" in out.stdout and "info" in out.stdout
