#!/usr/bin/env bash
# The checks that need a CUDA GPU (persistent kernels, training on the GPU), on a machine
# that has no network and no echoic installed: a Python with torch and triton is enough.
#
#   bash scripts/gpu_check.sh fetch         on a machine with network and echoic installed,
#                                           before: the wheels that a torch-only image lacks
#                                           -> .gpu-wheels/, the tests' speech corpus (it
#                                           needs espeak-ng and flite) -> .gpu-data/
#   bash scripts/gpu_check.sh env           on the GPU machine: GPU, versions, the imports
#   bash scripts/gpu_check.sh tests [EXPR]  pytest -m gpu tests/test_persistent_rnn.py and
#                                           the sm_90 fit table (EXPR: a -k filter)
#   bash scripts/gpu_check.sh train [EXPR]  pytest -m gpu tests/test_train.py and
#                                           tests/test_punct_training.py: training on the
#                                           GPU is deterministic, persistent ~ cuDNN;
#                                           `train sharing_each_batch`: two ranks sharing
#                                           each batch train one rank's weights (four runs:
#                                           left out of all and quick)
#   bash scripts/gpu_check.sh bench [NAME] [ARGS]   python bench/NAME.py ARGS
#                                           (NAME: persistent_rnn, the default, or another)
#   bash scripts/gpu_check.sh all           env, the barrier oracle (tests barrier), the GPU
#                                           tests, bench persistent_rnn --quick (the table:
#                                           bidirectional GRU, rows/tiles vs cuDNN per step,
#                                           B 1-64, H 512-2048, fwd and fwd+bwd) and train in
#                                           one call of at most 9.5 minutes (a lent GPU
#                                           machine runs one command for 10), each part
#                                           under its own time limit
#   bash scripts/gpu_check.sh quick         the same without the table, and `echoic train`
#                                           of the default recipe with the persistent
#                                           kernels (40 steps, a validation, a checkpoint)
#                                           in at most 5.5 minutes: a lent session's
#                                           device time (15 minutes, each start 1-2) fits
#                                           it twice, so that a fix can be checked again
#
# Each part writes its log (and the tests a JUnit XML) to $OUT when set, else .gpu-out/.
# The tests and train parts run with ECHOIC_PERSISTENT_STRICT=1: where the persistent
# kernels would fall back to cuDNN (and so match it exactly) they raise, and the test
# fails. The tests set it for their own subprocesses too; bench does not (it reports
# the shapes that do not fit).
# echoic is imported from .gpu-path/, where echoic.<part> links to this checkout's
# folders (what pyproject's package-dir does for an install), so nothing is installed
# but the fetched wheels, and only when an import fails. Compiled kernels are cached in
# .gpu-cache/ so that later calls on the same machine skip the compiles.
#
# pytest runs with -p no:benchmark: the CUDA image has pytest-benchmark beside
# pytest-xdist, and the warning it gives under xdist is an error with the suite's
# filterwarnings = error (an INTERNALERROR before any test ran).
#
# Environment: PYTHON (default python3; for fetch, .venv/bin/python when there is one),
# PYVER: the GPU machine's Python, for fetch (default 3.12, the GPU image's),
# GPU_CHECK_WORK: where .gpu-path, .gpu-site and .gpu-cache go (default: the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON_SET=${PYTHON:-}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$ROOT/.gpu-out}
WORK=${GPU_CHECK_WORK:-$ROOT}
part=${1:-}
shift || true

# wheels, fetch_wheels and import_root: shared with scripts/gpu_train.sh
source "$ROOT/scripts/gpu_env.sh"

case "$part" in
fetch)
    [[ -z ${PYTHON_SET:-} && -x .venv/bin/python ]] && PYTHON=.venv/bin/python
    rm -rf .gpu-data
    fetch_wheels
    "$PYTHON" - <<'EOF'
from pathlib import Path

from echoic.training.synth import SynthConfig, synthesize_corpus
from tests.conftest import SENTENCES

root = Path(".gpu-data")
root.mkdir()
(root / "sentences.txt").write_text(SENTENCES)
synthesize_corpus(
    root / "sentences.txt", root / "corpus", SynthConfig(seed=7), progress=False,
    relative_paths=True,
)
print("corpus:", root / "corpus" / "manifest.jsonl")
EOF
    ;;
env)
    import_root
    mkdir -p "$OUT"
    {
        nvidia-smi || echo "nvidia-smi: not found"
        "$PYTHON" - <<'EOF'
import sys

import torch
import triton

print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: sm_{p.major}{p.minor}, {p.multi_processor_count} SMs,",
          f"{getattr(p, 'regs_per_multiprocessor', '?')} registers/SM")
else:
    print("no CUDA GPU visible to torch")
from echoic.model.nn.persistent import function, launch  # noqa: F401
from echoic.training.train import load_recipe  # noqa: F401

print("echoic imports: ok, from", function.__file__)
EOF
    } 2>&1 | tee "$OUT/env.log"
    ;;
tests)
    import_root
    mkdir -p "$OUT"
    export ECHOIC_PERSISTENT_STRICT=1
    select="gpu or sm90"
    log=gpu_tests  # with EXPR, gpu_tests_EXPR (letters and digits), so parts keep their logs
    if [[ $# -gt 0 ]]; then
        select="($select) and ($*)"
        log="gpu_tests_$(tr -c 'A-Za-z0-9\n' _ <<<"$*")"
    fi
    # Each check is a subprocess that mostly compiles kernels on the CPU: with
    # pytest-xdist (in the CUDA image), four at a time.
    parallel=()
    "$PYTHON" -c "import xdist" 2>/dev/null && parallel=(-n 4)
    "$PYTHON" -m pytest -p no:cacheprovider -p no:benchmark -rA "${parallel[@]}" -m "gpu or slow" -k "$select" \
        tests/test_persistent_rnn.py -o junit_family=legacy --junitxml="$OUT/$log.xml" 2>&1 |
        tee "$OUT/$log.log"
    ;;
train)
    import_root
    mkdir -p "$OUT"
    export ECHOIC_PERSISTENT_STRICT=1
    if [[ -f .gpu-data/corpus/manifest.jsonl ]]; then
        export ECHOIC_TEST_CORPUS="$ROOT/.gpu-data/corpus/manifest.jsonl"
    fi
    "$PYTHON" -m pytest -p no:cacheprovider -p no:benchmark -rA -m gpu ${1:+-k "$*"} tests/test_train.py \
        tests/test_punct_training.py \
        -o junit_family=legacy --junitxml="$OUT/gpu_train.xml" 2>&1 | tee "$OUT/gpu_train.log"
    ;;
bench)
    import_root
    mkdir -p "$OUT"
    name=persistent_rnn
    if [[ $# -gt 0 && $1 != -* ]]; then
        name=$1
        shift
    fi
    "$PYTHON" "bench/$name.py" "$@" 2>&1 | tee "$OUT/bench_$name.log"
    ;;
recipe)
    # `echoic train` of a recipe on the GPU with rnn_impl (default persistent), strict,
    # on the fetched corpus: 40 steps, a validation and a checkpoint.
    import_root
    mkdir -p "$OUT"
    export ECHOIC_PERSISTENT_STRICT=1
    impl=${1:-persistent}
    recipe=${2:-training/recipes/default.toml}
    manifest="$ROOT/.gpu-data/corpus/manifest.jsonl"
    run="$WORK/.gpu-runs/$impl"
    rm -rf "$run"
    "$PYTHON" -m echoic.cli.main train --config "$recipe" --no-progress "out_dir=$run" \
        "data.train_manifest=$manifest" "data.val_manifest=$manifest" max_steps=40 \
        eval_every=40 device=cuda "rnn_impl=$impl" 2>&1 | tee "$OUT/recipe_$impl.log"
    ;;
all | quick)
    # A part that runs over its limit is stopped (with its process group) and reported;
    # the parts after it still run, and every log written so far stays in $OUT.
    # The oracle first (a broken barrier makes every other result meaningless), the table
    # before the long GPU tests so that it is printed even if they run out of time.
    if [[ $part == all ]]; then
        parts=("20 env" "60 tests barrier" "200 bench persistent_rnn --quick" "200 tests gpu"
            "90 train not sharing_each_batch")
    else
        parts=("20 env" "40 tests barrier" "150 tests gpu" "80 train not sharing_each_batch"
            "40 recipe persistent")
    fi
    for limit_and_part in "${parts[@]}"; do
        read -r limit this <<<"$limit_and_part"
        status=0
        timeout --kill-after=5 "$limit" bash "$ROOT/scripts/gpu_check.sh" $this || status=$?
        if [[ $status -ne 0 ]]; then
            echo "gpu_check all: '$this' ended with status $status" \
                "$([[ $status -eq 124 ]] && echo "(over its $limit s)")" >&2
        fi
    done
    ;;
*)
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
    exit 2
    ;;
esac
