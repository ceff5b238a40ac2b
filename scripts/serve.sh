#!/usr/bin/env bash
# The main job: set up what serving needs (if needed: the serve extras, no system
# packages) and serve the bundled default model from the default model repository
# (docs/deployment.md, "Retrain and redeploy"): `echoic deploy` replaces it live.
#   bash scripts/serve.sh [echoic serve options]
# Ports, each also an `echoic serve` flag (a flag given here wins):
#   ECHOIC_PORT          gRPC (echoic's API and Riva's), default 50051   (--port)
#   ECHOIC_HTTP_PORT     HTTP (OpenAI's API, the browser page), default 8000   (--http-port)
#   ECHOIC_METRICS_PORT  Prometheus metrics, default 9090   (--metrics-port)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh serve
exec .venv/bin/echoic serve --port "${ECHOIC_PORT:-50051}" --http-port "${ECHOIC_HTTP_PORT:-8000}" \
  --metrics-port "${ECHOIC_METRICS_PORT:-9090}" "$@"
