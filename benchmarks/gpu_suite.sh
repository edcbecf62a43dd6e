#!/usr/bin/env bash
# The GPU suite (benchmarks/gpu_suite.py): the real 26b-a4b architecture with random bf16 weights on one
# GPU; results into OUTDIR/gpu_suite.{json,md}. Under 8 minutes on an H200; installs nothing from the network.
#
#   benchmarks/gpu_suite.sh OUTDIR              # on the GPU machine
#   benchmarks/gpu_suite.sh OUTDIR --dry-run    # the same steps, small preset, on this CPU
#
# It needs PyTorch with CUDA (any recent version) and transformers==5.23.0, the numerical oracle. When the
# installed transformers is another version, the wheel is taken from .whl/ (fetch it beforehand, where
# there is network: benchmarks/gpu_wheels.sh) and installed into a private folder, never from the network.
# dgemma itself runs from this checkout (pure Python, nothing to build).
set -euo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUTDIR [--dry-run]}
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [ "${1:-}" = "--dry-run" ] && PY=.venv/bin/python
if ! "$PY" -c 'import sys, transformers; sys.exit(transformers.__version__ != "5.23.0")' 2>/dev/null; then
    wheel=$(ls .whl/transformers-5.23.0-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
        echo "gpu_suite: transformers==5.23.0 is not installed and .whl/ has no wheel of it;" \
             "run benchmarks/gpu_wheels.sh where there is network, and carry .whl" >&2
        exit 2
    fi
    site=${TMPDIR:-/tmp}/dgemma-suite-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheel"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
set -o pipefail
timeout 470 "$PY" benchmarks/gpu_suite.py "$out" "$@" 2> >(tee "$out/gpu_suite.log" >&2)
