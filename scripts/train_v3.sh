#!/usr/bin/env bash
# Stage 3 of the default model (docs/models-and-import.md, "The default model"): the bundled
# v2 fine-tuned gently (training/recipes/robust3.toml) on espeak-ng, flite, festival and the
# neural voice hibari, two voices a sentence, then exported and measured beside v2 on every
# held-out set (scripts/heldout_sets.sh: clean and degraded, hibari, and the unseen neural
# voice that no recipe trains on). Every step resumes or skips what is done, so rerun it
# after an interruption (same thread count).
#   bash scripts/train_v3.sh [key=value ...]        # e.g. max_steps=2000
#   ECHOIC_SENTENCES=2000 bash scripts/train_v3.sh    # fewer sentences (default 4000, x2 voices)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
E=.venv/bin/echoic
D=data/default
H=data/heldout-sets
[ -f $D/text/train.txt ] || $E synth --make-text $D/text --seed 1
$E synth --text $D/text/train.txt --out $D/train4 --engines espeak,flite,festival,hibari \
  --seed 23 --limit "${ECHOIC_SENTENCES:-4000}" --voices-per-sentence 2 --espeak-formants 0.88 1.12
# Validation: held-out sentences 101-150, as stage 2's (the held-out sets use 1-100).
sed -n 101,150p $D/text/heldout.txt > $D/text/val.txt
$E synth --text $D/text/val.txt --out $D/val3 --engines espeak,flite,festival --seed 17 \
  --voices-per-sentence 3 --espeak-formants 0.88 1.12
mkdir -p $H
# v2, before it is replaced: the left-hand columns of the table.
[ -s $H/v2.txt ] || { bash scripts/heldout_sets.sh model/default 100 > $H/v2.tmp && mv $H/v2.tmp $H/v2.txt; }
${ECHOIC_LAUNCH:-} $E train --config training/recipes/robust3.toml --no-progress "$@"
rm -rf runs/robust3-export/1
$E export runs/robust3/last.pt runs/robust3-export/1 --name echoic-en-default --version 3
cp model/default/lm.arpa runs/robust3-export/1/lm.arpa
bash scripts/heldout_sets.sh runs/robust3-export/1 100 | tee $H/v3.txt
# Not installed: the bundled model is chosen by the two tables (v2.txt, v3.txt), and at
# 230 steps v3 lost to v2 (docs/models-and-import.md, "Stage 3"). To install a winner:
#   rm -rf model/default && cp -r runs/robust3-export/1 model/default
