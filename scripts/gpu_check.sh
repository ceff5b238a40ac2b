#!/usr/bin/env bash
# The persistent-kernel checks that need a CUDA GPU, on a machine that has no network
# and no echoic installed: a Python with torch and triton is enough.
#
#   bash scripts/gpu_check.sh fetch         on a machine with network, before: the wheels
#                                           that a torch-only image lacks -> .gpu-wheels/
#   bash scripts/gpu_check.sh env           on the GPU machine: GPU, versions, the imports
#   bash scripts/gpu_check.sh tests [EXPR]  pytest -m gpu tests/test_persistent_rnn.py and
#                                           the sm_90 fit table (EXPR: a -k filter)
#   bash scripts/gpu_check.sh bench [ARGS]  python bench/persistent_rnn.py ARGS
#
# Each part writes its log (and the tests a JUnit XML) to $OUT when set, else .gpu-out/.
# echoic is imported from .gpu-path/, where echoic.<part> links to this checkout's
# folders (what pyproject's package-dir does for an install), so nothing is installed
# but the fetched wheels, and only when an import fails. Compiled kernels are cached in
# .gpu-cache/ so that later calls on the same machine skip the compiles.
#
# Environment: PYTHON (default python3), PYVER for fetch (default 3.12, the GPU image's),
# GPU_CHECK_WORK: where .gpu-path, .gpu-site and .gpu-cache go (default: the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$ROOT/.gpu-out}
WORK=${GPU_CHECK_WORK:-$ROOT}
part=${1:-}
shift || true

wheels=(soundfile soxr cffi pycparser jiwer rapidfuzz)  # what echoic.training needs beyond torch

import_root() {
    mkdir -p "$WORK/.gpu-path/echoic"
    local name
    for name in model training server clients cli protos; do
        ln -sfn "$ROOT/$name" "$WORK/.gpu-path/echoic/$name"
    done
    # echoic and tests/ first, the fetched wheels (once installed) last
    export PYTHONPATH="$WORK/.gpu-path:$ROOT${PYTHONPATH:+:$PYTHONPATH}:$WORK/.gpu-site"
    export TRITON_CACHE_DIR="$WORK/.gpu-cache"
    if ! "$PYTHON" -c "import soundfile, soxr, jiwer" 2>/dev/null; then
        if [[ ! -d .gpu-wheels ]]; then
            echo "gpu_check: soundfile, soxr or jiwer is missing and there is no .gpu-wheels/:" \
                "run 'bash scripts/gpu_check.sh fetch' where there is network, and carry" \
                ".gpu-wheels to this machine" >&2
            exit 2
        fi
        "$PYTHON" -m pip install -q --no-index --no-deps --find-links .gpu-wheels \
            --target "$WORK/.gpu-site" "${wheels[@]}"
    fi
}

case "$part" in
fetch)
    rm -rf .gpu-wheels
    "${PIP:-pip}" download -q -d .gpu-wheels --only-binary=:all: --no-deps \
        --python-version "${PYVER:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 "${wheels[@]}"
    ls .gpu-wheels
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
from echoic.model.persistent import function, launch  # noqa: F401
from echoic.training.train import load_recipe  # noqa: F401

print("echoic imports: ok, from", function.__file__)
EOF
    } 2>&1 | tee "$OUT/env.log"
    ;;
tests)
    import_root
    mkdir -p "$OUT"
    select="gpu or sm90"
    [[ $# -gt 0 ]] && select="($select) and ($*)"
    "$PYTHON" -m pytest -p no:cacheprovider -rA -m "gpu or slow" -k "$select" \
        tests/test_persistent_rnn.py -o junit_family=legacy --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
bench)
    import_root
    mkdir -p "$OUT"
    "$PYTHON" bench/persistent_rnn.py "$@" 2>&1 | tee "$OUT/bench_persistent_rnn.log"
    ;;
*)
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
