"""`echoic serve`: the gRPC transcription server (Recognize, StreamingRecognize, ListModels)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

EXAMPLES = """\
examples:
  # the bundled default model on 127.0.0.1:50051
  echoic serve

  # one exported model, reachable from other machines, metrics on :9090
  echoic serve --model models/echoic-ds2/3 --host 0.0.0.0 --metrics-port 9090

  # a model repository MODEL_REPO/<name>/<version>/, polled every 10 s: copy or
  # `echoic export` a new version in and it takes over without dropping a stream
  echoic serve --model-repo models --poll-seconds 10

  # bigger batches under load (wait up to 5 ms for more streams), at most 500 streams
  echoic serve --model-repo models --max-batch 64 --max-wait-ms 5 --max-streams 500

  # TLS; add --tls-client-ca to require client certificates (mutual TLS)
  echoic serve --model-repo models --tls-cert server.pem --tls-key server.key \\
      --tls-client-ca clients-ca.pem

Check it with grpcurl (reflection is on):
  grpcurl -plaintext 127.0.0.1:50051 list
  grpcurl -plaintext 127.0.0.1:50051 echoic.v1.Transcriber/ListModels
  grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check

SIGTERM or Ctrl-C stops taking new calls and gives open streams --grace-seconds
to finish. The API is protos/echoic/v1/transcriber.proto.
"""

# Modules of the serve extra, and the package that provides each.
_SERVE_MODULES = {
    "onnxruntime": "onnxruntime",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "prometheus_client": "prometheus-client",
}


def register(sub: argparse._SubParsersAction) -> None:
    from echoic.server.config import ServerConfig

    d = ServerConfig()
    p = sub.add_parser(
        "serve",
        help="serve models over gRPC (streaming and batch transcription)",
        description="Serve exported models over gRPC: Recognize (whole audio), "
        "StreamingRecognize\n(bidirectional, interim and final results) and ListModels, "
        "with health checks,\nreflection, Prometheus metrics, hot reload and TLS.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--model", type=Path, metavar="DIR",
        help="a model directory written by `echoic export` (default: the bundled model)",
    )  # fmt: skip
    what.add_argument(
        "--model-repo", type=Path, metavar="DIR",
        help="a model repository DIR/<name>/<version>/, polled for new versions",
    )  # fmt: skip
    p.add_argument(
        "--poll-seconds", type=float, default=d.poll_seconds, metavar="S",
        help=f"seconds between repository scans; 0 = only at start (default {d.poll_seconds:g})",
    )  # fmt: skip
    p.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"gRPC port (default {d.port})")
    p.add_argument(
        "--metrics-port", type=int, metavar="PORT",
        help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (default: off)",
    )  # fmt: skip
    p.add_argument(
        "--metrics-host", default=d.metrics_host,
        help=f"address the metrics endpoint binds to (default {d.metrics_host})",
    )  # fmt: skip
    p.add_argument(
        "--max-batch", type=int, default=d.max_batch, metavar="N",
        help=f"streams per batched model call (default {d.max_batch})",
    )  # fmt: skip
    p.add_argument(
        "--max-wait-ms", type=float, default=d.max_wait_ms, metavar="MS",
        help="ms to wait for a fuller batch; 0 = run whatever is ready at once (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=d.intra_op_threads, metavar="N",
        help="ONNX Runtime threads per operator; 0 = onnxruntime's default (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--gpu", action="store_true",
        help="run on CUDA (needs onnxruntime-gpu: pip install 'echoic[gpu]')",
    )  # fmt: skip
    p.add_argument(
        "--max-streams", type=int, default=d.max_streams, metavar="N",
        help=f"concurrent streams and requests; more get RESOURCE_EXHAUSTED (default "
        f"{d.max_streams})",
    )  # fmt: skip
    p.add_argument(
        "--max-audio-seconds", type=float, default=d.max_audio_seconds, metavar="S",
        help=f"audio per request or stream, s; 0 = no limit (default {d.max_audio_seconds:g})",
    )  # fmt: skip
    p.add_argument(
        "--idle-timeout-seconds", type=float, default=d.idle_timeout_seconds, metavar="S",
        help=f"a stream silent this long gets DEADLINE_EXCEEDED (default "
        f"{d.idle_timeout_seconds:g})",
    )  # fmt: skip
    p.add_argument(
        "--max-message-bytes", type=int, default=d.max_message_bytes, metavar="B",
        help=f"largest request message, bytes (default {d.max_message_bytes})",
    )  # fmt: skip
    p.add_argument(
        "--grace-seconds", type=float, default=d.grace_seconds, metavar="S",
        help=f"on SIGTERM, time open streams get to finish (default {d.grace_seconds:g})",
    )  # fmt: skip
    p.add_argument("--tls-cert", type=Path, metavar="PEM", help="server certificate: serve TLS")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", type=Path, metavar="PEM",
        help="CA of client certificates: require them (mutual TLS)",
    )  # fmt: skip
    p.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"),
        help="server log level (default info)",
    )  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from echoic.cli.main import UserError, missing_extra

    try:
        from echoic.server.app import serve
        from echoic.server.config import ServerConfig, ServerError
    except ModuleNotFoundError as e:
        if e.name in _SERVE_MODULES:
            raise missing_extra("serve", _SERVE_MODULES[e.name]) from e
        raise
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = ServerConfig(
            model_dir=args.model,
            model_repo=args.model_repo,
            poll_seconds=args.poll_seconds,
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            max_batch=args.max_batch,
            max_wait_ms=args.max_wait_ms,
            intra_op_threads=args.threads,
            providers=(
                ("CUDAExecutionProvider", "CPUExecutionProvider")
                if args.gpu
                else ("CPUExecutionProvider",)
            ),
            max_streams=args.max_streams,
            max_audio_seconds=args.max_audio_seconds,
            idle_timeout_seconds=args.idle_timeout_seconds,
            max_message_bytes=args.max_message_bytes,
            grace_seconds=args.grace_seconds,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
        )
        serve(config)
    except ServerError as e:
        raise UserError(str(e)) from e
    except ModuleNotFoundError as e:
        if e.name in _SERVE_MODULES:
            raise missing_extra("serve", _SERVE_MODULES[e.name]) from e
        raise
    return 0
