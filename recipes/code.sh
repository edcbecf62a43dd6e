#!/usr/bin/env bash
# Reproduce the shipped code models from nothing: the standard-library corpus and tokenizer, the
# diffusion model and its AR twin (stage 1: continuation and random-cut infill records; stage 2, in two
# parts: half of the records infill a whole line, expression or function body), and the shipped copies
# (dgemma/models/code inside the package, the default model of every command; models/code-ar beside
# it, for the evaluation). About 5 hours on 2 cores (measured figures in docs/code.md).
#   ./recipes/code.sh && python benchmarks/code_eval.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DGEMMA=${DGEMMA:-.venv/bin/dgemma}
[ -f recipes/data/code/train-syntax-records.jsonl ] || "$PY" recipes/code_data.py
"$DGEMMA" train recipes/code-small.yaml
"$DGEMMA" train recipes/code-small-ar.yaml
"$DGEMMA" train recipes/code-small-syntax.yaml
"$DGEMMA" train recipes/code-small-ar-syntax.yaml
"$DGEMMA" train recipes/code-small-syntax-2.yaml
"$DGEMMA" train recipes/code-small-ar-syntax-2.yaml
recipes/ship.sh runs/code-small-syntax-2/final dgemma/models/code recipes/data/code/tokenizer
# The shipped sampler stops each canvas within 12 denoising steps: the same held-out exact match as 48
# (benchmarks/code_settle.py; BENCHMARKS.md, "Code model: the steps it needs").
"$PY" - <<'PYEOF'
import json, pathlib
path = pathlib.Path("dgemma/models/code/generation_config.json")
config = json.loads(path.read_text())
config["max_denoising_steps"] = 12
path.write_text(json.dumps(config, indent=2))
PYEOF
recipes/ship.sh runs/code-small-ar-syntax-2/final models/code-ar recipes/data/code/tokenizer
