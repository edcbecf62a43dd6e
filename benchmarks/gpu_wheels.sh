#!/usr/bin/env bash
# Fetch what benchmarks/gpu_suite.sh brings to a GPU machine without network: the transformers==5.23.0
# wheel (pure Python; its own dependencies are already on such machines). Run where there is network:
#   benchmarks/gpu_wheels.sh       # -> .whl/transformers-5.23.0-py3-none-any.whl (ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl transformers==5.23.0
ls -l .whl
