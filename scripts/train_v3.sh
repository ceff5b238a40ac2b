#!/usr/bin/env bash
# Stage 3 of the default model (docs/models-and-import.md, "The default model"): the bundled
# v2 fine-tuned gently (training/recipes/robust3.toml) on espeak-ng, flite, festival and the
# neural voice hibari, two voices a sentence, exported, blended half and half with v2
# (training/blend.py), and measured beside v2 on every held-out set
# (scripts/heldout_sets.sh: clean and degraded, hibari, and the unseen neural voice that no
# recipe trains on); the blend is installed as the bundled model (v3). Run it after
# scripts/train_robust.sh, which leaves v2 in model/default: v2 is copied to runs/robust3-base
# first, so a rerun after the install still starts from it and blends with it. Every step
# resumes or skips what is done, so rerun it after an interruption (same thread count).
#   bash scripts/train_v3.sh [key=value ...]        # e.g. max_steps=2000
#   ECHOIC_SENTENCES=2000 bash scripts/train_v3.sh    # fewer sentences (default 4000, x2 voices)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
E=.venv/bin/echoic
H=data/heldout-sets
bash scripts/default_corpus.sh  # train4 and val3 (validation: held-out sentences 101-150)
mkdir -p $H runs
[ -d runs/robust3-base ] || cp -r model/default runs/robust3-base
grep -q '"version": "2"' runs/robust3-base/export.json || {
  echo "train_v3: stage 3 starts from v2, and runs/robust3-base holds another version" \
    "(model/default is v3 once this script has installed it): run scripts/train_robust.sh" \
    "first, or copy v2 to runs/robust3-base" >&2
  exit 1
}
# v2, before it is replaced: the left-hand columns of the table.
[ -s $H/v2.txt ] || { bash scripts/heldout_sets.sh runs/robust3-base 100 > $H/v2.tmp && mv $H/v2.tmp $H/v2.txt; }
${ECHOIC_LAUNCH:-} $E train --config training/recipes/robust3.toml --no-progress \
  init_from=runs/robust3-base "$@"
rm -rf runs/robust3-export runs/robust3-blend
$E export runs/robust3/last.pt runs/robust3-export/3 --name echoic-en-default --version 3
cp runs/robust3-base/lm.arpa runs/robust3-base/lm.bin runs/robust3-export/3/
bash scripts/heldout_sets.sh runs/robust3-export/3 100 | tee $H/v3-finetune.txt
.venv/bin/python -m echoic.training.blend runs/robust3-base runs/robust3-export/3 --weight 0.5 \
  --out runs/robust3-blend.pt
$E export runs/robust3-blend.pt runs/robust3-blend/3 --name echoic-en-default --version 3
cp runs/robust3-base/lm.arpa runs/robust3-base/lm.bin runs/robust3-blend/3/
bash scripts/heldout_sets.sh runs/robust3-blend/3 100 | tee $H/v3.txt
# Install the blend as the bundled model; the three tables (v2.txt, v3-finetune.txt,
# v3.txt) are what chose it.
rm -rf model/default && cp -r runs/robust3-blend/3 model/default
