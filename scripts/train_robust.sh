#!/usr/bin/env bash
# Stage 2 of the default model (docs/models-and-import.md, "The default model"): stage 1 (v1) fine-tuned
# on espeak-ng, flite and festival voices with augmentation (training/recipes/robust.toml),
# then exported and measured on the held-out sets (scripts/heldout_sets.sh). Every step
# resumes or skips what is done, so rerun it after an interruption (same thread count).
#   bash scripts/train_robust.sh [key=value ...]      # e.g. max_steps=1500
#   ECHOIC_SENTENCES=4000 bash scripts/train_robust.sh  # a smaller corpus (default 8000)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
E=.venv/bin/echoic
D=data/default
[ -f $D/text/train.txt ] || $E synth --make-text $D/text --seed 1
$E synth --text $D/text/train.txt --out $D/train3 --engines espeak,flite,festival \
  --seed 13 --limit "${ECHOIC_SENTENCES:-8000}" --espeak-formants 0.88 1.12
bash scripts/val_split.sh  # validation: held-out sentences 101-150 (the held-out sets use 1-100)
mkdir -p data/heldout-sets
bash scripts/heldout_sets.sh model/default 100 > data/heldout-sets/before.txt
${ECHOIC_LAUNCH:-} $E train --config training/recipes/robust.toml --no-progress "$@"
rm -rf runs/robust-export
$E export runs/robust/last.pt runs/robust-export/1 --name echoic-en-default --version 2
cp model/default/lm.arpa model/default/lm.bin runs/robust-export/1/
bash scripts/heldout_sets.sh runs/robust-export/1 100 | tee data/heldout-sets/after.txt
# Install it as the bundled model (it fine-tunes what model/default holds: run this after
# scripts/train_default.sh, which leaves v1 there).
rm -rf model/default && cp -r runs/robust-export/1 model/default
