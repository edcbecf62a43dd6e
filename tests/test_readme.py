"""The README's Python example runs as written, and the README names the scripts CI uses."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_python_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README shows a Python example"
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(blocks[0], "README.md", "exec"), {})
    assert (tmp_path / "tiny-ckpt" / "model.safetensors").is_file()
    assert "torch.Size([1, 8, 512])" in capsys.readouterr().out


def test_commands_exist():
    text = README.read_text()
    root = README.parent
    for script in ("./scripts/main.sh", "./scripts/test.sh"):
        assert script in text and (root / script).is_file()
    assert "./scripts/test.sh" in (root / ".ci" / "run").read_text()
