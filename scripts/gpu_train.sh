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
#   bash scripts/gpu_train.sh aside | back          here: the bundled models out of the
#        checkout (and its index) for the calls, when the corpus needs their room, and back
#
# pack's environment: RECIPE (default training/recipes/gpu_mid.toml), INIT (a checkpoint
# or an exported model directory to start from; an export is rebuilt here, where
# onnxruntime is; default none: a fresh network), FORMAT (opus, default, about 3.4 kB per
# second of speech; or flac, about 25 kB), OPUS_LEVEL (libsndfile's Opus level, 0-1:
# 0.97 is about 1.9 kB/s), MAX_MB (the corpus, default 48), VAL_MB
# (default 3), PACK (default .gpu-train), NO_WHEELS=1 (no download: the GPU side has them),
# CARRY_MIB (what a call carries in, default 64: pack fails above it).
# run's: BUDGET_S (the whole step, default 510: a device call's 9 minutes less start-up),
# RESERVE_S (kept for the last evaluation, checkpoint and parts, default 45), PACK, WORK
# (where the corpus unpacks and the run writes; default the checkout), FRESH=1 (start
# over: without it, a run directory left by an earlier call on the same machine resumes
# exactly), PYTHON (default python3), MAX_STEPS=auto (the recipe's max_steps made what fits
# the budget: PROBE_STEPS (default 40) steps first measure this machine's steps a second;
# train.log says the number chosen, which max_steps=N reproduces).
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

# train_cmd DIR: `cmd`, echoic train on the unpacked corpus into DIR with the packed
# validation set and start (`extra`); settings after it win.
train_cmd() {
    cmd=("$PYTHON" -m echoic.cli.main train --config "$PACK/recipe.toml" --no-progress
        "out_dir=$1" "data.train_manifest=$data/train/manifest.jsonl" "${extra[@]}")
}

# probe_steps N LEFT [KEY=VALUE ...]: train N steps into a scratch directory, and set
# `chosen` to the steps that fit in LEFT seconds at the rate of the steps after the first
# record, less the probe itself and the start-up it measured, with 15% spared for
# evaluations and checkpoints.
probe_steps() {
    local n=$1 left=$2 probe="$WORK/.gpu-train-probe"
    shift 2
    if [[ $n -lt 20 ]]; then
        echo "gpu_train: PROBE_STEPS=$n: the probe needs 20 steps or more (two log records)" >&2
        exit 2
    fi
    rm -rf "$probe"
    local t0=$SECONDS
    # The user's settings first: the probe's own (its steps, directory, records) win.
    train_cmd "$probe"
    "${cmd[@]}" "$@" "data.val_manifest=" "max_steps=$n" log_every=10 eval_every=0 \
        checkpoint_every=1000000 >"$OUT/train.log" 2>&1 \
        || { echo "gpu_train: the probe failed" >&2; tail "$OUT/train.log" >&2; exit 1; }
    chosen=$("$PYTHON" - "$probe/metrics.jsonl" "$OUT/train.log" "$data/train/manifest.jsonl" \
        "$((SECONDS - t0))" "$((left - SECONDS + t0))" <<'PY'
# Audio seconds a second is the rate to go by: the probe's steps are an epoch's shortest
# utterances (SortaGrad), so its steps a second overstate the epoch's.
import json, re, sys
metrics, log, manifest, probe_s, left = sys.argv[1:]
with open(metrics) as f:
    rows = [json.loads(line) for line in f if '"train"' in line]
if len(rows) < 2 or rows[-1]["elapsed"] <= rows[0]["elapsed"]:
    sys.exit(f"gpu_train: the probe logged {len(rows)} training records: too few to time")
first, last = rows[0], rows[-1]
rate = (last["audio_seconds"] - first["audio_seconds"]) / (last["elapsed"] - first["elapsed"])
startup = float(probe_s) - last["audio_seconds"] / rate
with open(log) as f:
    per_epoch = int(re.search(r"(\d+) steps/epoch", f.read()).group(1))
with open(manifest) as f:
    audio = sum(json.loads(line)["duration"] for line in f if line.strip())
print(max(1, int(0.85 * rate * (float(left) - startup) / (audio / per_epoch))))
print(f"gpu_train: the probe trained {rate:.0f} audio seconds a second after {startup:.0f} s"
      f" of start-up; {audio / per_epoch:.0f} s a step", file=sys.stderr)
PY
    ) || exit 1
    rm -rf "$probe"
    echo "gpu_train: max_steps=$chosen fits the budget" | tee -a "$OUT/train.log"
}

# The bundled models' files, which a call carries with the checkout and training needs
# none of: `aside` takes them out of the index and the checkout (into .gpu-aside/) for
# the calls, `back` puts them back.
ASIDE=(model/default model/punct)

case "$part" in
pack)
    [[ $# -ge 1 ]] || { echo "usage: gpu_train.sh pack MANIFEST [VAL_MANIFEST]" >&2; exit 2; }
    [[ -z $PYTHON_SET && -x .venv/bin/python ]] && PYTHON=.venv/bin/python
    recipe=${RECIPE:-training/recipes/gpu_mid.toml}
    rm -rf "$PACK"
    mkdir -p "$PACK"
    cp "$recipe" "$PACK/recipe.toml"
    [[ ${NO_WHEELS:-0} == 1 ]] || fetch_wheels
    level=()
    [[ -n ${OPUS_LEVEL:-} ]] && level=(--opus-level "$OPUS_LEVEL")
    {
        "$PYTHON" -m echoic.training.gpu_pack corpus "$1" "$PACK/corpus.tar" \
            --format "${FORMAT:-opus}" --max-mb "${MAX_MB:-48}" "${level[@]}"
        if [[ $# -ge 2 ]]; then
            "$PYTHON" -m echoic.training.gpu_pack corpus "$2" "$PACK/val.tar" \
                --format "${FORMAT:-opus}" --max-mb "${VAL_MB:-3}" "${level[@]}"
        fi
    } | tee "$PACK/pack.json"
    if [[ -n ${INIT:-} ]]; then
        "$PYTHON" -m echoic.training.gpu_pack init "$INIT" "$PACK/init.pt" \
            --recipe "$recipe" --manifest "$1"
    fi
    du -sh "$PACK" $([[ -d .gpu-wheels ]] && echo .gpu-wheels)
    # What a call carries: the checkout's files git does not ignore, and the two folders.
    tree=$(checkout_bytes)
    total=$(du -sbc "$PACK" $([[ -d .gpu-wheels ]] && echo .gpu-wheels) | tail -1 | cut -f1)
    total=$((total + ${tree:-0}))
    carry=${CARRY_MIB:-64}
    echo "gpu_train: a call carries $((total / 1024 / 1024)) MiB (the checkout's files" \
        "$((${tree:-0} / 1024 / 1024)) MiB) of $carry"
    if [[ $total -gt $((carry * 1024 * 1024)) ]]; then
        echo "gpu_train: $PACK, .gpu-wheels and the checkout's files hold" \
            "$((total / 1024 / 1024)) MiB, more than the $carry MiB a call carries in:" \
            "pack again with a smaller MAX_MB, or take the bundled models out of the" \
            "checkout for the calls ('gpu_train.sh aside', then 'back')" >&2
        exit 1
    fi
    ;;
aside)
    mkdir -p .gpu-aside
    echo '*' >.gpu-aside/.gitignore  # never carried, whatever the checkout's .gitignore says
    for path in "${ASIDE[@]}"; do
        [[ -e $path ]] || continue
        [[ ! -e .gpu-aside/$path ]] || { echo "gpu_train: .gpu-aside/$path exists" >&2; exit 1; }
        git rm -r -q --cached "$path"
        mkdir -p ".gpu-aside/$(dirname "$path")"
        mv "$path" ".gpu-aside/$path"
    done
    echo "gpu_train: ${ASIDE[*]} are in .gpu-aside/ until 'bash scripts/gpu_train.sh back'"
    ;;
back)
    for path in "${ASIDE[@]}"; do
        [[ -e .gpu-aside/$path ]] || continue
        [[ ! -e $path ]] || { echo "gpu_train: $path exists: not replaced" >&2; exit 1; }
        mv ".gpu-aside/$path" "$path"
        git reset -q -- "$path"
    done
    rm -rf .gpu-aside
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
    steps=()
    if [[ ${MAX_STEPS:-} == auto ]]; then
        if [[ -f $run/last.pt ]]; then
            echo "gpu_train: MAX_STEPS=auto sizes a fresh run, and $run holds one: FRESH=1" \
                "starts over, max_steps=N resumes it" >&2
            exit 2
        fi
        probe_steps ${PROBE_STEPS:-40} "$((budget - SECONDS - reserve))" "$@"
        steps=("max_steps=$chosen")
    fi
    left=$((budget - SECONDS - reserve))
    if [[ $left -lt 30 ]]; then
        echo "gpu_train: only ${left}s left of BUDGET_S=$budget after unpacking" >&2
        exit 2
    fi
    minutes=$(awk -v s="$left" 'BEGIN { printf "%.3f", s / 60 }')
    status=0
    # max_minutes stops the run at its next checkpoint once the time is spent; timeout is
    # the backstop for a checkpoint interval longer than the reserve.
    train_cmd "$run"
    timeout --kill-after=10 $((left + reserve - 15)) "${cmd[@]}" "max_minutes=$minutes" \
        "${steps[@]}" "$@" >>"$OUT/train.log" 2>&1 || status=$?
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
