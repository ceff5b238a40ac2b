"""ServerConfig: everything `echoic serve` can be told, with units."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class ServerError(Exception):
    """A server that cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class ServerConfig:
    # What to serve: one model directory, or a repository MODEL_REPO/<name>/<version>/.
    model_dir: Path | None = None  # a directory written by `echoic export`
    model_repo: Path | None = None  # polled for new versions (hot reload)
    poll_seconds: float = 5.0  # s between two scans of model_repo; 0 = scan only at start

    # Where to listen.
    host: str = "127.0.0.1"  # address to bind gRPC to ("[::]" or "0.0.0.0": every interface)
    port: int = 50051  # gRPC port; 0 = any free port (create_server returns it)
    metrics_port: int | None = None  # Prometheus /metrics port; None = off, 0 = any free port
    metrics_host: str = "127.0.0.1"  # address to bind the metrics endpoint to

    # Batch dispatch (one dispatcher per loaded model version).
    max_batch: int = 32  # streams per ONNX Runtime call, count
    max_wait_ms: float = 0.0  # ms a dispatcher waits for a fuller batch; 0 = run at once
    intra_op_threads: int = 0  # threads inside one ONNX operator, count; 0 = onnxruntime's
    providers: tuple[str, ...] = ("CPUExecutionProvider",)  # ONNX Runtime execution providers

    # Limits.
    max_streams: int = 256  # concurrent StreamingRecognize + Recognize calls, count
    max_audio_seconds: float = 3600.0  # audio per request or stream, s; 0 = no limit
    idle_timeout_seconds: float = 30.0  # s a stream may send nothing before DEADLINE_EXCEEDED
    max_message_bytes: int = 32 * 1024 * 1024  # largest request message, bytes
    grace_seconds: float = 30.0  # s open streams get to finish on shutdown (SIGTERM)

    # TLS: a certificate and key serve TLS; a client CA as well requires client certificates.
    tls_cert: Path | None = None  # PEM server certificate (chain)
    tls_key: Path | None = None  # PEM private key of tls_cert
    tls_client_ca: Path | None = None  # PEM CA bundle that client certificates must chain to

    def __post_init__(self) -> None:
        checks = [
            (self.model_dir is None or self.model_repo is None, "give a model or a model repo"),
            (self.poll_seconds >= 0, "poll_seconds must be >= 0"),
            (0 <= self.port <= 65535, "port must be in 0-65535"),
            (self.metrics_port is None or 0 <= self.metrics_port <= 65535, "bad metrics_port"),
            (self.max_batch >= 1, "max_batch must be >= 1"),
            (self.max_wait_ms >= 0, "max_wait_ms must be >= 0"),
            (self.max_streams >= 1, "max_streams must be >= 1"),
            (self.max_audio_seconds >= 0, "max_audio_seconds must be >= 0"),
            (self.idle_timeout_seconds > 0, "idle_timeout_seconds must be > 0"),
            (self.max_message_bytes >= 1024, "max_message_bytes must be >= 1024"),
            (self.grace_seconds >= 0, "grace_seconds must be >= 0"),
            ((self.tls_cert is None) == (self.tls_key is None), "TLS needs both cert and key"),
            (self.tls_client_ca is None or self.tls_cert is not None, "mTLS needs a server cert"),
        ]
        for ok, message in checks:
            if not ok:
                raise ServerError(message)
