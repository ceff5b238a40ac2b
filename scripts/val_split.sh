#!/usr/bin/env bash
# The default model's validation split since stage 2: data/default/val3, held-out sentences
# 101-150 by espeak-ng, flite and festival, three voices a sentence (the held-out sets,
# scripts/heldout_sets.sh, use sentences 1-100). Skips what is made.
#   bash scripts/val_split.sh
set -euo pipefail
cd "$(dirname "$0")/.."
E=.venv/bin/echoic
D=data/default
[ -f $D/text/heldout.txt ] || $E synth --make-text $D/text --seed 1
sed -n 101,150p $D/text/heldout.txt > $D/text/val.txt
$E synth --text $D/text/val.txt --out $D/val3 --engines espeak,flite,festival --seed 17 \
  --voices-per-sentence 3 --espeak-formants 0.88 1.12
