#!/usr/bin/env bash
# Stage 4 of the default model (docs/models-and-import.md, "The default model"): a 5 x 320
# BiGRU (training/recipes/gpu_default.toml) trained from scratch on a lent GPU in two
# device calls (docs/training-gpu.md), exported with its weights stored as float16 (the
# model directory stays under 40 MB), and measured beside the bundled model on every
# held-out set (scripts/heldout_sets.sh). The GPU part is two calls of the device tool,
# which no script here can make: `pack` prints them.
#   bash scripts/train_v4.sh pack           # here: the corpus made and packed
#   (the two device calls that `pack` prints, on one machine, the second while it is warm)
#   bash scripts/train_v4.sh finish DIR     # here: DIR is the second call's files
#   bash scripts/train_v4.sh install        # the export as model/default (what chose it:
#                                           # data/heldout-sets/v4.txt, v3-beside-v4.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
E=.venv/bin/echoic
D=data/default
H=data/heldout-sets
OUT=runs/gpu-default-export/4
case "${1:-}" in
pack)
    bash scripts/bootstrap.sh
    bash scripts/default_corpus.sh
    # The first 7,500 utterances (7.15 h) are what fits a call beside the checkout.
    head -n 7500 $D/train4/manifest.jsonl > $D/train4/first7500.jsonl
    # The corpus (56 MB) fits beside the checkout's files only without the bundled models.
    bash scripts/gpu_train.sh aside
    RECIPE=training/recipes/gpu_default.toml OPUS_LEVEL=0.97 MAX_MB=60 VAL_MB=2 \
        bash scripts/gpu_train.sh pack $D/train4/first7500.jsonl $D/val3/manifest.jsonl
    cat <<'CALLS'
train_v4: now two device calls, carry [".gpu-train", ".gpu-wheels"] (the bundled models
are in .gpu-aside/ meanwhile):
  1. OUT=$OUT BUDGET_S=555 bash scripts/gpu_train.sh run max_steps=1452      (timeout 595)
  2. OUT=$OUT BUDGET_S=250 RESERVE_S=35 bash scripts/gpu_train.sh run max_steps=2000
     (the same machine, still warm: it resumes the first call's run)
then: bash scripts/train_v4.sh finish FILES_AT_OF_CALL_2 (which puts the models back)
CALLS
    ;;
finish)
    [[ $# -ge 2 ]] || { echo "usage: train_v4.sh finish DIR" >&2; exit 2; }
    bash scripts/gpu_train.sh back
    mkdir -p runs/gpu-default
    bash scripts/gpu_train.sh join "$2" runs/gpu-default/weights.pt
    rm -rf "$OUT"
    $E export runs/gpu-default/weights.pt "$OUT" --name echoic-en-default --version 4 \
        --weights float16
    cp model/default/lm.arpa model/default/lm.bin "$OUT/"
    mkdir -p $H
    if [[ ! -s $H/v3-beside-v4.txt ]] && grep -q '"version": "3"' model/default/export.json; then
        bash scripts/heldout_sets.sh model/default 100 > $H/v3-beside-v4.txt
    fi
    bash scripts/heldout_sets.sh "$OUT" 100 | tee $H/v4.txt
    ;;
install)
    [[ -f $OUT/model.onnx ]] || { echo "train_v4: no $OUT: run finish first" >&2; exit 2; }
    rm -rf model/default && cp -r "$OUT" model/default
    ;;
*)
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
    exit 2
    ;;
esac
