#!/usr/bin/env bash
# Create .venv (if needed) and install dgemma with its test dependencies.
# torch is pinned first: the local CPU build of 2.13.0 satisfies dgemma's torch requirement, so pip
# does not fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
