"""The GPU suite's dry run: every stage of benchmarks/gpu_suite.sh on a tiny preset on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_suite_dry_run(tmp_path):
    env = os.environ | {"PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), str(tmp_path), "--dry-run", "--preset", "tiny"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    failed = {k: v for k, v in result.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed
    assert float(result["parity"]) < 1e-4  # dgemma and transformers on the very same tensors
    for name in ("dgemma", "dgemma (no CUDA graphs)", "dgemma fp8"):
        r = result[name]
        assert [p["steps"] for p in r["points"]] == [1, 2, 4] and r["ar_tokens_per_s"] > 0, name
        assert r["step_bytes"]["weights"] > 0 and r["bound_s"] > 0
    assert result["dgemma fp8"]["step_bytes"]["weights"] < result["dgemma"]["step_bytes"]["weights"]
    assert result["transformers generate"]["tokens_per_s"] > 0
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "| dgemma |" in table and "| transformers generate |" in table and "crossover" in table
    assert (tmp_path / "gpu_suite.log").is_file()
