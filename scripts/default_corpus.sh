#!/usr/bin/env bash
# The default model's corpus since stage 3 (scripts/train_v3.sh, scripts/train_v4.sh):
# data/default/train4, the training sentences by espeak-ng, flite, festival and the neural
# voice hibari, two voices a sentence, and data/default/val3, held-out sentences 101-150
# by the three synthesizers (the held-out sets use 1-100). Skips what is made.
#   bash scripts/default_corpus.sh
#   ECHOIC_SENTENCES=2000 bash scripts/default_corpus.sh   # fewer sentences (default 4000)
set -euo pipefail
cd "$(dirname "$0")/.."
E=.venv/bin/echoic
D=data/default
[ -f $D/text/train.txt ] || $E synth --make-text $D/text --seed 1
$E synth --text $D/text/train.txt --out $D/train4 --engines espeak,flite,festival,hibari \
  --seed 23 --limit "${ECHOIC_SENTENCES:-4000}" --voices-per-sentence 2 --espeak-formants 0.88 1.12
bash scripts/val_split.sh
