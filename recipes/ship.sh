#!/usr/bin/env bash
# Copy a finished run into a shipped model directory, replacing it only once the copy is complete:
#   recipes/ship.sh runs/NAME/final DST TOKENIZER_DIR
set -euo pipefail
run=$1 dst=$2 tokenizer=$3
rm -rf "$dst.tmp" && mkdir -p "$dst.tmp"
cp "$run"/config.json "$run"/model.safetensors "$dst.tmp"/
[ -f "$run"/generation_config.json ] && cp "$run"/generation_config.json "$dst.tmp"/
cp "$tokenizer"/* "$dst.tmp"/
rm -rf "$dst" && mv "$dst.tmp" "$dst"
echo "shipped $run -> $dst"
