#!/usr/bin/env bash
# The main job: set up (if needed) and serve the bundled default model over gRPC, from the
# default model repository (README, "Retrain and redeploy"): `echoic deploy` replaces it live.
#   bash scripts/serve.sh [echoic serve options]     # gRPC on :50051, metrics on :9090
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/echoic serve --port "${ECHOIC_PORT:-50051}" --metrics-port "${ECHOIC_METRICS_PORT:-9090}" "$@"
