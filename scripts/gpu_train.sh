#!/usr/bin/env bash
# Train on a lent GPU machine in one device call: no network there, torch and triton but
# no soundfile or soxr, 64 MiB carried in, at most 8 files of 16 MB back
# (docs/training-gpu.md gives the exact calls).
#
#   bash scripts/gpu_train.sh pack MANIFEST [VAL_MANIFEST]   here: $PACK/ (the corpus as
#        Ogg/Opus in one tar, the validation set, the recipe, init.pt) and .gpu-wheels/
#   bash scripts/gpu_train.sh run [KEY=VALUE ...]   there: unpack, train from init.pt with
#        the recipe for what is left of BUDGET_S, then write to $OUT: train.log,
#        metrics.jsonl and the weights (weights.pt, or weights.pt.part-NN)
#   bash scripts/gpu_train.sh join DIR [OUT.pt]     here: the weights back in one checkpoint
#        (then: echoic export OUT.pt DIR)
#
# pack's environment: RECIPE (default training/recipes/gpu_mid.toml), INIT (a checkpoint
# or an exported model directory to start from; an export is rebuilt here, where
# onnxruntime is; default none: a fresh network), FORMAT (opus, default, about 3 kB per
# second of speech; or flac, about 25 kB), MAX_MB (the corpus, default 48), VAL_MB
# (default 3), PACK (default .gpu-train), NO_WHEELS=1 (no download: the GPU side has them),
# CARRY_MIB (what a call carries in, default 64: pack fails above it).
# run's: BUDGET_S (the whole step, default 510: a device call's 9 minutes less start-up),
# RESERVE_S (kept for the last evaluation, checkpoint and parts, default 45), PACK, WORK
# (where the corpus unpacks and the run writes; default the checkout), FRESH=1 (start
# over: without it, a run directory left by an earlier call on the same machine resumes
# exactly), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON_SET=${PYTHON:-}
PYTHON=${PYTHON:-python3}
WORK=${WORK:-$ROOT}
PACK=$(realpath -m "${PACK:-.gpu-train}")  # relative to the checkout
part=${1:-}
shift || true
source "$ROOT/scripts/gpu_env.sh"

case "$part" in
pack)
    [[ $# -ge 1 ]] || { echo "usage: gpu_train.sh pack MANIFEST [VAL_MANIFEST]" >&2; exit 2; }
    [[ -z $PYTHON_SET && -x .venv/bin/python ]] && PYTHON=.venv/bin/python
    recipe=${RECIPE:-training/recipes/gpu_mid.toml}
    rm -rf "$PACK"
    mkdir -p "$PACK"
    cp "$recipe" "$PACK/recipe.toml"
    [[ ${NO_WHEELS:-0} == 1 ]] || fetch_wheels
    {
        "$PYTHON" -m echoic.training.gpu_pack corpus "$1" "$PACK/corpus.tar" \
            --format "${FORMAT:-opus}" --max-mb "${MAX_MB:-48}"
        if [[ $# -ge 2 ]]; then
            "$PYTHON" -m echoic.training.gpu_pack corpus "$2" "$PACK/val.tar" \
                --format "${FORMAT:-opus}" --max-mb "${VAL_MB:-3}"
        fi
    } | tee "$PACK/pack.json"
    if [[ -n ${INIT:-} ]]; then
        "$PYTHON" -m echoic.training.gpu_pack init "$INIT" "$PACK/init.pt" \
            --recipe "$recipe" --manifest "$1"
    fi
    du -sh "$PACK" $([[ -d .gpu-wheels ]] && echo .gpu-wheels)
    total=$(du -sbc "$PACK" $([[ -d .gpu-wheels ]] && echo .gpu-wheels) | tail -1 | cut -f1)
    carry=${CARRY_MIB:-64}
    if [[ $total -gt $((carry * 1024 * 1024)) ]]; then
        echo "gpu_train: $PACK and .gpu-wheels hold $((total / 1024 / 1024)) MiB, more than" \
            "the $carry MiB a call carries in: pack again with a smaller MAX_MB" >&2
        exit 1
    fi
    ;;
run)
    [[ -f $PACK/corpus.tar ]] || { echo "gpu_train: no $PACK/corpus.tar: pack first" >&2; exit 2; }
    budget=${BUDGET_S:-510}
    reserve=${RESERVE_S:-45}
    import_root
    OUT=${OUT:-$ROOT/.gpu-out}
    mkdir -p "$OUT"
    data="$WORK/.gpu-train-data"
    run="$WORK/.gpu-train-run"
    rm -rf "$data"
    mkdir -p "$data/train" "$data/val"
    [[ ${FRESH:-0} == 1 ]] && rm -rf "$run"
    tar -xf "$PACK/corpus.tar" -C "$data/train"
    extra=()
    if [[ -f $PACK/val.tar ]]; then
        tar -xf "$PACK/val.tar" -C "$data/val"
        extra+=("data.val_manifest=$data/val/manifest.jsonl")
    fi
    [[ -f $PACK/init.pt ]] && extra+=("init_from=$PACK/init.pt")
    left=$((budget - SECONDS - reserve))
    if [[ $left -lt 30 ]]; then
        echo "gpu_train: only ${left}s left of BUDGET_S=$budget after unpacking" >&2
        exit 2
    fi
    minutes=$(awk -v s="$left" 'BEGIN { printf "%.3f", s / 60 }')
    status=0
    # max_minutes stops the run at its next checkpoint once the time is spent; timeout is
    # the backstop for a checkpoint interval longer than the reserve.
    timeout --kill-after=10 $((left + reserve - 15)) \
        "$PYTHON" -m echoic.cli.main train --config "$PACK/recipe.toml" --no-progress \
        "out_dir=$run" "data.train_manifest=$data/train/manifest.jsonl" \
        "max_minutes=$minutes" "${extra[@]}" "$@" >"$OUT/train.log" 2>&1 || status=$?
    tail -n 5 "$OUT/train.log"
    [[ -f $run/metrics.jsonl ]] && cp "$run/metrics.jsonl" "$OUT/metrics.jsonl"
    if [[ -f $run/last.pt ]]; then
        "$PYTHON" -m echoic.training.gpu_pack parts "$run/last.pt" "$OUT"
    fi
    echo "gpu_train: training ended with status $status after ${SECONDS}s" | tee -a "$OUT/train.log"
    exit "$status"
    ;;
join)
    [[ $# -ge 1 ]] || { echo "usage: gpu_train.sh join DIR [OUT.pt]" >&2; exit 2; }
    [[ -z $PYTHON_SET && -x .venv/bin/python ]] && PYTHON=.venv/bin/python
    "$PYTHON" -m echoic.training.gpu_pack join "$1" "${2:-runs/gpu/weights.pt}"
    ;;
*)
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
    exit 2
    ;;
esac
