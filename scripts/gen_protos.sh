#!/usr/bin/env bash
# Regenerate the Python stubs of protos/echoic/v1/*.proto into protos/v1/
# (imported as echoic.protos.v1.*), with the pinned grpcio-tools (the dev extra):
#   bash scripts/gen_protos.sh            # rewrite the checked-in stubs
#   bash scripts/gen_protos.sh OUT_DIR    # write them to OUT_DIR instead (the staleness test)
# The output depends only on the .proto files and the grpcio-tools version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
out=${1:-protos/v1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Paths relative to protos/ so the descriptors are named echoic/v1/<file>.proto.
PY=$(command -v "$PY")
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
(cd protos && "$PY" -m grpc_tools.protoc -I . \
  --python_out="$work" --pyi_out="$work" --grpc_python_out="$work" echoic/v1/*.proto)

mkdir -p "$out"
for f in "$work"/echoic/v1/*.py "$work"/echoic/v1/*.pyi; do
  # protoc names the stubs' own package after the .proto path (echoic.v1); they live
  # in echoic.protos.v1, so point the cross-imports there.
  sed -e 's/^from echoic\.v1 import /from echoic.protos.v1 import /' "$f" >"$out/$(basename "$f")"
done
[ -f "$out/__init__.py" ] || printf '"""Generated stubs of protos/echoic/v1 (scripts/gen_protos.sh)."""\n' >"$out/__init__.py"
