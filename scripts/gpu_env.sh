# Sourced by scripts/gpu_check.sh and scripts/gpu_train.sh (with ROOT, WORK and PYTHON
# set): the wheels that a torch-only GPU image lacks, and the import set-up that runs
# echoic from the checkout there with nothing installed but those wheels.

wheels=(soundfile soxr cffi pycparser jiwer rapidfuzz)  # what echoic.training needs beyond torch

# Download the wheels into .gpu-wheels/ for the GPU machine's Python (PYVER, default 3.12,
# the GPU image's): here, where there is network.
fetch_wheels() {
    rm -rf .gpu-wheels
    "$PYTHON" -m pip download -q -d .gpu-wheels --only-binary=:all: --no-deps \
        --python-version "${PYVER:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 "${wheels[@]}"
    ls .gpu-wheels
}

# checkout_bytes: what a device call carries of the checkout beside the paths it names,
# the files git does not ignore, in bytes (scripts/gpu_train.sh and gpu_punct.sh's pack).
checkout_bytes() {
    ( (git ls-files -z --cached --others --exclude-standard \
        | du -cb --files0-from=- 2>/dev/null || true) | tail -1 | cut -f1)
}

# PYTHONPATH to echoic in this checkout (through .gpu-path/echoic/<part> links, what
# pyproject's package-dir does for an install), and the wheels installed into .gpu-site/
# when an import fails (GPU_IMPORTS, default those of the wheels; empty for a part that
# needs none of them: the punctuation tagger's training, scripts/gpu_punct.sh).
import_root() {
    mkdir -p "$WORK/.gpu-path/echoic"
    local name
    for name in model training server clients cli protos; do
        ln -sfn "$ROOT/$name" "$WORK/.gpu-path/echoic/$name"
    done
    # echoic and tests/ first, the fetched wheels (once installed) last
    export PYTHONPATH="$WORK/.gpu-path:$ROOT${PYTHONPATH:+:$PYTHONPATH}:$WORK/.gpu-site"
    export TRITON_CACHE_DIR="$WORK/.gpu-cache"
    local imports=${GPU_IMPORTS-soundfile, soxr, jiwer}
    if [[ -n $imports ]] && ! "$PYTHON" -c "import $imports" 2>/dev/null; then
        if [[ ! -d .gpu-wheels ]]; then
            echo "gpu: soundfile, soxr or jiwer is missing and there is no .gpu-wheels/:" \
                "run 'bash scripts/gpu_check.sh fetch' (or gpu_train.sh pack) where there" \
                "is network, and carry .gpu-wheels to this machine" >&2
            exit 2
        fi
        "$PYTHON" -m pip install -q --no-index --no-deps --find-links .gpu-wheels \
            --target "$WORK/.gpu-site" "${wheels[@]}" || {
            echo "gpu: .gpu-wheels/ does not fit this Python" \
                "($("$PYTHON" -V)): fetch again with PYVER=<its X.Y>" >&2
            exit 2
        }
    fi
}

