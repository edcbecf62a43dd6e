#!/usr/bin/env bash
# Reproduce the shipped Sudoku models from nothing: puzzles, the diffusion model, its AR twin, and the
# shipped copies (dgemma/models/sudoku inside the package; models/sudoku-ar beside it, for the evaluation). About 6 hours on 2 cores:
# data ~20 min, diffusion model ~70 + ~100 + ~100 min, AR twin ~55 min (figures in docs/sudoku.md).
#   ./recipes/sudoku.sh && python benchmarks/sudoku_eval.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DGEMMA=${DGEMMA:-.venv/bin/dgemma}
[ -f recipes/data/sudoku/train-records.jsonl ] || "$PY" recipes/sudoku_data.py
[ -f recipes/data/sudoku/train-aug-records.jsonl ] || "$PY" recipes/sudoku_data.py --augment 8
"$DGEMMA" train recipes/sudoku-tiny.yaml
"$DGEMMA" train recipes/sudoku-tiny-long.yaml
"$DGEMMA" train recipes/sudoku-tiny-longer.yaml
"$DGEMMA" train recipes/sudoku-tiny-ar.yaml
recipes/ship.sh runs/sudoku-tiny-longer/final dgemma/models/sudoku recipes/data/sudoku/tokenizer
recipes/ship.sh runs/sudoku-tiny-ar/final models/sudoku-ar recipes/data/sudoku/tokenizer
