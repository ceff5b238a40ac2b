#!/usr/bin/env bash
# The main job, end to end on this machine: set up, synthesize a small corpus,
# train the tiny model on it for a few steps, and show the learning curve.
#   bash scripts/demo.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
work=${1:-runs/demo}
mkdir -p "$work"
.venv/bin/echoic synth --make-text "$work/text" --held-out 20 >/dev/null
head -n 60 "$work/text/train.txt" > "$work/text/small.txt"
.venv/bin/echoic synth --text "$work/text/small.txt" --out "$work/corpus"
.venv/bin/echoic train --config training/recipes/tiny.toml \
  data.train_manifest="$work/corpus/manifest.jsonl" data.val_manifest="$work/corpus/manifest.jsonl" \
  eval_at_start=true out_dir="$work/tiny"
echo "learning curve ($work/tiny/metrics.jsonl):"
grep '"eval"' "$work/tiny/metrics.jsonl"
