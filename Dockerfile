# syntax=docker/dockerfile:1
#
# echoic server images. No torch in any of them: they install `echoic[serve,riva]`
# (onnxruntime) or `echoic[gpu,riva]` (onnxruntime-gpu), never the training extra.
#
#   docker build -t echoic .                          # CPU server (the default target)
#   docker build -t echoic:gpu --target gpu .         # CUDA server (onnxruntime-gpu)
#
#   docker run -p 50051:50051 -p 8000:8000 -p 9090:9090 echoic   # the bundled model
#   docker run -p 50051:50051 -v $PWD/models:/models echoic --model-repo /models
#   docker run --gpus all -p 50051:50051 echoic:gpu
#
# Arguments after the image name are added to `echoic serve --host 0.0.0.0
# --port 50051 --http-port 8000 --metrics-port 9090 --metrics-host 0.0.0.0`
# (see `echoic serve --help`).
# HTTP (OpenAI's /v1/audio/transcriptions, /healthz, /readyz, /metrics) is on 8000.
# The gRPC port inside the container stays 50051, where the HEALTHCHECK asks the
# standard grpc.health.v1 service (plaintext: with --tls-cert, set your own HEALTHCHECK).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04

# ---------------------------------------------------------------- build: the wheel
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# What the wheel is made of, and nothing else (.dockerignore keeps the rest out).
COPY pyproject.toml README.md ./
COPY model/ model/
COPY training/ training/
COPY server/ server/
COPY clients/ clients/
COPY cli/ cli/
COPY protos/ protos/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- gpu: CUDA + onnxruntime-gpu
FROM ${CUDA_IMAGE} AS gpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin echoic
ENV VIRTUAL_ENV=/opt/echoic PATH=/opt/echoic/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m venv /opt/echoic \
    && pip install --no-cache-dir "$(ls /wheels/echoic-*.whl)[gpu,riva]"
USER 10001:10001
WORKDIR /home/echoic
EXPOSE 50051 8000 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; r = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=4); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["echoic", "serve", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8000", "--metrics-port", "9090", "--metrics-host", "0.0.0.0", "--device", "cuda"]

# ---------------------------------------------------------------- serve: CPU (default target)
FROM ${PYTHON_IMAGE} AS serve
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin echoic
ENV VIRTUAL_ENV=/opt/echoic PATH=/opt/echoic/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv /opt/echoic \
    && pip install --no-cache-dir "$(ls /wheels/echoic-*.whl)[serve,riva]"
USER 10001:10001
WORKDIR /home/echoic
EXPOSE 50051 8000 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; r = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=4); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["echoic", "serve", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8000", "--metrics-port", "9090", "--metrics-host", "0.0.0.0"]
