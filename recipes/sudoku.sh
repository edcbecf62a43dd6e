#!/usr/bin/env bash
# Reproduce the shipped Sudoku models from nothing: puzzles, the diffusion model (stage 1 in four parts;
# stage 2 from part 3), its AR twin, and the shipped copies (dgemma/models/sudoku inside the package:
# stage 1 part 4; models/sudoku-stage1 (part 3), models/sudoku-stage2 and models/sudoku-ar beside it, for
# the evaluations). About 8.7 hours on 2 cores: data ~20 min, stage 1 ~70 + ~100 + ~100 + ~70 min,
# stage 2 ~67 min, AR twin ~55 min (docs/sudoku.md).
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
recipes/ship.sh runs/sudoku-tiny-longer/final models/sudoku-stage1 recipes/data/sudoku/tokenizer
"$DGEMMA" train recipes/sudoku-stage2-reference.yaml
recipes/ship.sh runs/sudoku-stage2-reference/final models/sudoku-stage2 recipes/data/sudoku/tokenizer
"$DGEMMA" train recipes/sudoku-tiny-part4.yaml
recipes/ship.sh runs/sudoku-tiny-part4/final dgemma/models/sudoku recipes/data/sudoku/tokenizer
recipes/ship.sh runs/sudoku-tiny-ar/final models/sudoku-ar recipes/data/sudoku/tokenizer
