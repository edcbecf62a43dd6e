#!/usr/bin/env bash
# The serving figures issue 41 prepared for a GPU: a stacked server batch's step, eager against the graph of
# its bucket (benchmarks/batched_steps.py), and 16 concurrent 512-token prefills, encodes one request at a
# time against batched (benchmarks/batched_encodes.py). The small preset, random bf16 weights; under 4
# minutes on an H200; results into OUTDIR/{batched_steps,batched_encodes}.txt.
#
#   benchmarks/gpu_serving.sh OUTDIR              # on the GPU machine (after benchmarks/gpu_suite.sh)
#   benchmarks/gpu_serving.sh OUTDIR --dry-run    # the same, tiny sizes, on this CPU
set -euo pipefail
out=${1:?usage: benchmarks/gpu_serving.sh OUTDIR [--dry-run]}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ "${2:-}" = "--dry-run" ]; then
    steps=(--preset tiny --batches 1,4 --steps 2 --device cpu)
    encodes=(--requests 4 --prompt 32 --steps 1 --repeats 1 --device cpu)
else
    steps=(--preset small --batches 1,2,4,8,16)
    encodes=(--requests 16 --prompt 512 --repeats 3)
fi
timeout 150 "$PY" benchmarks/batched_steps.py "${steps[@]}" 2>&1 | tee "$out/batched_steps.txt"
timeout 150 "$PY" benchmarks/batched_encodes.py "${encodes[@]}" 2>&1 | tee "$out/batched_encodes.txt"
