#!/usr/bin/env bash
# The main job as it stands: set up, show the real model's architecture, and print the parity report
# against transformers (generation and the embedded demo model arrive with later issues).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/dgemma info --preset 26b-a4b
.venv/bin/python benchmarks/parity.py
