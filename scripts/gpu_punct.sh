#!/usr/bin/env bash
# The punctuation tagger trained on a lent GPU in one device call (docs/formatting.md,
# "On a lent GPU"): torch there but no network and none of the prose, 64 MiB carried in,
# at most 8 files of 16 MiB back, 64 MiB in all. The GPU only trains (--device cuda
# --train-only); calibrating the marks, writing the int8 file and scoring it need no GPU
# and are done here after.
#
#   bash scripts/gpu_punct.sh pack [INIT [OPTION ...]]   here: .gpu-punct/ holds the prose
#        in one file (--write-prose), the tagger to go on from (INIT, default the bundled
#        model/punct/punct.onnx) and the training's options (default: $DEFAULT_OPTIONS)
#   bash scripts/gpu_punct.sh run           there: a run for each of SEEDS (default 21; two
#        side by side, members for --soup, where both runs' weights fit what a call sends
#        back), the steps that fit BUDGET_S trained on the GPU, then to $OUT: train.log,
#        steps (the budget it chose) and each run's best weights in parts
#        (ckpt-SEED.pt.part-NN); a run cut off by the budget sends its best weights so far
#   bash scripts/gpu_punct.sh finish DIR OUT.onnx   here: DIR is the call's files; the same
#        training command, on the CPU, writes OUT-seedSEED.onnx of each run (calibrated,
#        int8, scored)
#
# run's environment: BUDGET_S (the whole call, default 500: a device call's 9 minutes less
# its start), SEEDS (one or two), STEPS (default auto: a probe of PROBE_STEPS (default 60)
# steps times this machine's steps and scorings first, and the runs take what fits; or N),
# EVAL_STEPS (default a fifth of the steps), DEVICE (default cuda; cpu proves the script),
# PYTHON (default python3), WORK (where the run writes; default the checkout), FRESH=1
# (start over; without it, a run left by an earlier call on the same machine resumes),
# PACK (default .gpu-punct), PROSE (pack's: default data/prose).
set -euo pipefail
CALLER=$PWD  # relative paths given (INIT, PROSE, DIR, OUT.onnx) are the caller's
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON_SET=${PYTHON:-}
PYTHON=${PYTHON:-python3}
WORK=${WORK:-$ROOT}
# Relative, so that the training's options, which name its files, are the same on both
# machines (an absolute PACK serves where all three parts run on one machine: the test).
PACK=${PACK:-.gpu-punct}
DEFAULT_OPTIONS="--lr 5e-5 --utterances 0.5 --batch 32"  # the seed is SEEDS'
SET_HERE="--prose --write-prose --init --steps --eval-steps --checkpoint --out --device --train-only --seed"
part=${1:-}
shift || true
source "$ROOT/scripts/gpu_env.sh"

# train_cmd STEPS CHECKPOINT [OPTION ...]: `cmd`, the training on the packed prose from the
# packed tagger with the packed options; options after them win.
train_cmd() {
    local steps=$1 checkpoint=$2
    shift 2
    local options
    read -r -a options <"$PACK/options"
    cmd=("$PYTHON" -m echoic.training.punctuation --prose "$PACK/prose.json.gz"
        --init "$PACK/init.onnx" --steps "$steps" "${options[@]}" --checkpoint "$checkpoint"
        "$@")
}

case "$part" in
pack)
    [[ -z $PYTHON_SET && -x .venv/bin/python ]] && PYTHON=.venv/bin/python
    init=$(cd "$CALLER" && realpath -m "${1:-$ROOT/model/punct/punct.onnx}")
    prose=$(cd "$CALLER" && realpath -m "${PROSE:-$ROOT/data/prose}")
    shift || true
    [[ -f $init ]] || { echo "gpu_punct: no tagger $init to go on from" >&2; exit 2; }
    for option in "$@"; do
        if [[ " $SET_HERE " == *" ${option%%=*} "* ]]; then
            echo "gpu_punct: pack $option: the script sets $SET_HERE itself (the seeds:" \
                "SEEDS=... for run)" >&2
            exit 2
        fi
    done
    rm -rf "$PACK"
    mkdir -p "$PACK"
    cp "$init" "$PACK/init.onnx"
    if [[ $# -gt 0 ]]; then echo "$*" >"$PACK/options"; else echo "$DEFAULT_OPTIONS" >"$PACK/options"; fi
    "$PYTHON" -m echoic.training.punctuation --prose "$prose" --write-prose "$PACK/prose.json.gz"
    # What a call carries: the checkout's files git does not ignore, and the pack.
    tree=$(checkout_bytes)
    total=$(($(du -sb "$PACK" | cut -f1) + ${tree:-0}))
    echo "gpu_punct: options: $(cat "$PACK/options"); a call carries" \
        "$((total / 1024 / 1024)) MiB of 64, carry [\"$PACK\"]"
    if [[ $total -gt $((64 * 1024 * 1024)) ]]; then
        echo "gpu_punct: more than the 64 MiB a call carries in: take the bundled models" \
            "out of the checkout for the call ('bash scripts/gpu_train.sh aside', then 'back')" >&2
        exit 1
    fi
    ;;
run)
    [[ -f $PACK/prose.json.gz ]] || { echo "gpu_punct: no $PACK/prose.json.gz: pack first" >&2; exit 2; }
    read -r -a seeds <<<"${SEEDS:-21}"
    if [[ ${#seeds[@]} -lt 1 || ${#seeds[@]} -gt 2 || ${seeds[0]} == "${seeds[1]:-}" ]]; then
        echo "gpu_punct: SEEDS='${SEEDS:-}': one seed or two different ones" >&2
        exit 2
    fi
    GPU_IMPORTS="" import_root
    export PYTHONUNBUFFERED=1
    OUT=${OUT:-$ROOT/.gpu-out}
    mkdir -p "$OUT"
    budget=${BUDGET_S:-500}
    device=${DEVICE:-cuda}
    run="$WORK/.gpu-punct-run"
    [[ ${FRESH:-0} == 1 ]] && rm -rf "$run"
    mkdir -p "$run"
    : >"$OUT/train.log"
    back=$((62 * 1024 * 1024))  # of the 64 MiB a call sends back: the rest for the log
    if [[ -f $run/steps ]]; then  # an earlier call's run on this machine: resumed
        steps=$(cat "$run/steps")
        if [[ ${STEPS:-auto} != auto && $STEPS != "$steps" ]]; then
            echo "gpu_punct: $run holds a run of $steps steps: FRESH=1 starts over" >&2
            exit 2
        fi
    elif [[ ${STEPS:-auto} != auto ]]; then
        steps=$STEPS
    else
        # The probe: each seed's run for PROBE_STEPS steps, side by side as the runs will
        # be, scored (and saved) half way and scored at the end. Between the two scorings
        # lie a save, half the steps and the second scoring: a step's seconds; the start
        # (corpus, tagger, first batches) is the rest of the probe's time. The slower run
        # sets the steps.
        probe=${PROBE_STEPS:-60}
        batch=$(grep -o -- '--batch[ =][0-9]*' "$PACK/options" | tail -1 | tr -dc 0-9 || true)
        batch=${batch:-64}  # the training's default
        t0=$SECONDS
        pids=()
        rm -f "$run"/probe-*
        for seed in "${seeds[@]}"; do
            train_cmd "$probe" "$run/probe-$seed.pt" --seed "$seed" --eval-steps $((probe / 2)) \
                --train-only --device "$device" --out "$run/probe.onnx"
            "${cmd[@]}" >"$run/probe-$seed.log" 2>&1 &
            pids+=($!)
        done
        for i in "${!pids[@]}"; do
            wait "${pids[$i]}" || { tail "$run/probe-${seeds[$i]}.log" >&2; exit 1; }
        done
        spent=$((SECONDS - t0))
        # Two runs' best weights must fit what a call sends back: the probe's finished
        # checkpoint is the size of a run's.
        size=$(stat -c %s "$run/probe-${seeds[0]}.pt")
        if [[ ${#seeds[@]} -eq 2 && ( $((2 * size)) -gt $back ||
            $((2 * ((size + 15728639) / 15728640) + 2)) -gt 8 ) ]]; then
            echo "gpu_punct: two runs' weights ($((2 * size / 1048576)) MiB) pass what a call" \
                "sends back: seed ${seeds[0]} alone" | tee -a "$OUT/train.log"
            seeds=("${seeds[0]}")
        fi
        steps=
        for seed in "${seeds[@]}"; do
            cat "$run/probe-$seed.log" >>"$OUT/train.log"
            fits=$(awk -v probe="$probe" -v spent=$spent -v left=$((budget - SECONDS)) \
                -v batch="$batch" -v evals="${EVAL_STEPS:-0}" '
                BEGIN { n = 0 }
                /\(wall [0-9.]+ s, scoring [0-9.]+ s\)/ {
                    match($0, /wall [0-9.]+/); w[n] = substr($0, RSTART + 5, RLENGTH - 5)
                    match($0, /scoring [0-9.]+/); e[n] = substr($0, RSTART + 8, RLENGTH - 8); n++ }
                /^saved .* in [0-9.]+ s$/ && !saved { saved = $(NF - 1) }
                END {
                    if (n < 2) { print "gpu_punct: the probe scored " n " times" > "/dev/stderr"; exit 1 }
                    step = (w[n-1] - w[0] - e[n-1] - saved) / (probe / 2)
                    if (step <= 0) { print "gpu_punct: the probe timed no steps: PROBE_STEPS" \
                        " more, or STEPS=N" > "/dev/stderr"; exit 1 }
                    each = (e[0] > e[n-1] ? e[0] : e[n-1]) + saved  # a scoring and a save
                    start = spent - w[n-1]
                    # The run: its start again, its steps, its scorings and saves (6: a
                    # fifth of the steps each, and the end; or one each EVAL_STEPS), and at
                    # each epoch (3,745 steps of 32 windows on the whole prose) one more
                    # scoring and the windows dealt again (half the start, at most); a
                    # quarter spared.
                    epoch = 3745 * 32 / batch
                    fixed = evals > 0 ? 1 : 6
                    per = step + (each + start / 2) / epoch + (evals > 0 ? each / evals : 0)
                    s = int(0.75 * (left - start - fixed * each) / per)
                    printf "gpu_punct: the probe took %.4f s a step, %.1f s a scoring and " \
                        "save, %d s to start\n", step, each, start > "/dev/stderr"
                    print (s > 0 ? s : 0) }' "$run/probe-$seed.log")
            [[ -z $steps || $fits -lt $steps ]] && steps=$fits
        done
        rm -f "$run"/probe-*.pt
        [[ $steps -gt 0 ]] || { echo "gpu_punct: no steps fit in what is left of BUDGET_S=$budget" >&2; exit 2; }
    fi
    echo "$steps" >"$run/steps"
    echo "gpu_punct: $steps steps, seeds ${seeds[*]}" | tee -a "$OUT/train.log"
    evals=${EVAL_STEPS:-$((steps / 5 > 0 ? steps / 5 : 1))}
    left=$((budget - SECONDS > 30 ? budget - SECONDS : 30))
    pids=()
    for seed in "${seeds[@]}"; do
        train_cmd "$steps" "$run/ckpt-$seed.pt" --seed "$seed" --eval-steps "$evals" --train-only \
            --device "$device" --out "$run/unused.onnx"
        timeout --kill-after=10 "$left" "${cmd[@]}" >"$run/train-$seed.log" 2>&1 &
        pids+=($!)
    done
    status=0
    sent=0
    rm -f "$OUT"/ckpt-*.pt.part-*
    for i in "${!pids[@]}"; do
        seed=${seeds[$i]}
        wait "${pids[$i]}" || status=$?
        { echo "gpu_punct: seed $seed's run"; cat "$run/train-$seed.log"; } >>"$OUT/train.log"
        tail -n 2 "$run/train-$seed.log" | cut -c1-300
        [[ -f $run/ckpt-$seed.pt ]] || continue
        if ! grep -q "the same command without --train-only writes the tagger" "$run/train-$seed.log"; then
            # Cut off by the budget: its best weights so far come back (finish writes them;
            # the run itself resumes only in a next call on this machine, from its own file).
            "$PYTHON" -c "import sys, torch
state = torch.load(sys.argv[1], weights_only=True, map_location='cpu')
state['model'] = state['optimizer'] = None
torch.save(state, sys.argv[2])" "$run/ckpt-$seed.pt" "$run/best-$seed.pt"
            echo "gpu_punct: seed $seed's run was cut off: its best weights so far" \
                "come back" | tee -a "$OUT/train.log"
            mv "$run/best-$seed.pt" "$run/back-$seed.pt"
        else
            cp "$run/ckpt-$seed.pt" "$run/back-$seed.pt"
        fi
        size=$(stat -c %s "$run/back-$seed.pt")
        if [[ $((sent + size)) -gt $back ]]; then
            echo "gpu_punct: seed $seed's weights pass what a call sends back: left" \
                "out" | tee -a "$OUT/train.log"
            continue
        fi
        split -b 15m -d -a 2 "$run/back-$seed.pt" "$OUT/ckpt-$seed.pt.part-"
        sent=$((sent + size))
    done
    cp "$run/steps" "$OUT/steps"
    echo "gpu_punct: training ended with status $status after ${SECONDS}s" | tee -a "$OUT/train.log"
    # The runs' own limit is not the call's: another status than timeout's 124.
    [[ $status -eq 124 || $status -eq 137 ]] && exit 3
    exit "$status"
    ;;
finish)
    [[ $# -eq 2 ]] || { echo "usage: gpu_punct.sh finish DIR OUT.onnx" >&2; exit 2; }
    [[ -z $PYTHON_SET && -x .venv/bin/python ]] && PYTHON=.venv/bin/python
    dir=$(cd "$CALLER" && realpath -m "$1")
    out=$(cd "$CALLER" && realpath -m "$2")
    [[ -d $dir ]] || { echo "gpu_punct: no folder $1 (the call's files)" >&2; exit 2; }
    seeds=$(cd "$dir" && ls ckpt-*.pt.part-00 2>/dev/null | sed 's/^ckpt-\(.*\)\.pt\.part-00$/\1/' || true)
    [[ -n $seeds && -f $dir/steps ]] || {
        echo "gpu_punct: no ckpt-SEED.pt.part-* and steps in $1: no run came back (its" \
            "train.log says why)" >&2
        exit 2
    }
    mkdir -p "$WORK/.gpu-punct-run"
    for seed in $seeds; do
        cat "$dir/ckpt-$seed.pt".part-* >"$WORK/.gpu-punct-run/back-$seed.pt"
        train_cmd "$(cat "$dir/steps")" "$WORK/.gpu-punct-run/back-$seed.pt" --seed "$seed" \
            --out "${out%.onnx}-seed$seed.onnx"
        "${cmd[@]}"
    done
    ;;
*)
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
    exit 2
    ;;
esac
