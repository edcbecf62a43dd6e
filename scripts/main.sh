#!/usr/bin/env bash
# The main job: set up .venv with dgemma's runtime dependencies only (torch CPU build, safetensors,
# tokenizers, jinja2, rich, pyyaml) and run `dgemma demo` on the models shipped inside the package:
# code denoised live from a random canvas, an infill, an edit, a Sudoku, and the statistics.
# No download of weights, no GPU; under a minute on 2 CPU cores once installed. Extra arguments go to
# `dgemma demo` (see `dgemma demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e .
exec .venv/bin/dgemma demo "$@"
