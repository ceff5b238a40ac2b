"""Prometheus metrics of one server instance (its own registry, so several can run in a process).

Names are in base units (seconds, counts) with the prefix `echoic_`:

    echoic_requests_total{method, code}             finished RPCs by gRPC status code
    echoic_active_streams{method}                   open StreamingRecognize / Recognize calls
    echoic_audio_seconds_total{model, version}      audio received and decoded, s
    echoic_batch_size{model, version}               streams per ONNX Runtime call (histogram)
    echoic_queue_wait_seconds{model, version}       ready window -> its batch starts (histogram)
    echoic_compute_seconds{model, version}          one batched model call + decoding (histogram)
    echoic_final_result_latency_seconds{method}     end of audio -> final result sent (histogram)
    echoic_real_time_factor{model, version}         compute s per s of audio in a batch (histogram)
    echoic_model_versions_loaded{model, version, state}   1 per loaded version
    echoic_http_requests_total{route, status}       finished HTTP requests by route and status
    echoic_http_request_duration_seconds{route}     HTTP request in -> response out (histogram)
    echoic_realtime_errors_total{code}              error events sent on realtime WebSockets

plus the standard process_* (CPU, memory, open files) and python_* collectors. The
endpoint (`start_http`) answers GET /metrics and nothing else (404); the HTTP door
serves the same registry at its own /metrics (`exposition`). With `echoic serve
--workers N` each worker has its own, and the supervisor's --metrics-port shows them all
with a `worker` label (server/workers.py).

HTTP routes are the route templates (`/v1/audio/transcriptions`), and a path that
matches none is counted as `unmatched`, so a scan cannot grow the label set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HTTP_TRANSCRIPTIONS = "HTTPTranscriptions"  # the HTTP door's transcriptions, as a method label
HTTP_REALTIME = "HTTPRealtime"  # its realtime WebSockets, as a method label


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            PlatformCollector,
            ProcessCollector,
        )

        self._http: MetricsHttp | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        model = ("model", "version")
        # Latency, s: from a fraction of a millisecond to the half minute of a stalled server.
        fast = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0)  # fmt: skip
        self.requests = Counter(
            "echoic_requests", "Finished RPCs by method and gRPC status code.",
            ("method", "code"), registry=r,
        )  # fmt: skip
        self.active_streams = Gauge(
            "echoic_active_streams", "Open StreamingRecognize and Recognize calls.",
            ("method",), registry=r,
        )  # fmt: skip
        self.audio_seconds = Counter(
            "echoic_audio_seconds", "Audio received and decoded, seconds.", model, registry=r
        )
        self.batch_size = Histogram(
            "echoic_batch_size", "Streams per batched ONNX Runtime call.", model,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "echoic_queue_wait_seconds", "Time a ready window waits for its batch, seconds.",
            model, buckets=fast, registry=r,
        )  # fmt: skip
        self.compute = Histogram(
            "echoic_compute_seconds", "One batched model call and its decoding, seconds.",
            model, buckets=fast, registry=r,
        )  # fmt: skip
        self.final_latency = Histogram(
            "echoic_final_result_latency_seconds",
            "End of audio (client half-close or request) to final result sent, seconds.",
            ("method",), buckets=fast, registry=r,
        )  # fmt: skip
        self.real_time_factor = Histogram(
            "echoic_real_time_factor", "Compute seconds per second of audio in a batch.", model,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=r,
        )  # fmt: skip
        self.model_loaded = Gauge(
            "echoic_model_versions_loaded", "Loaded model versions (1 each), by state.",
            ("model", "version", "state"), registry=r,
        )  # fmt: skip
        self.http_requests = Counter(
            "echoic_http_requests", "Finished HTTP requests by route and status.",
            ("route", "status"), registry=r,
        )  # fmt: skip
        self.http_latency = Histogram(
            "echoic_http_request_duration_seconds",
            "HTTP request received to response sent, seconds, by route.",
            ("route",), buckets=fast, registry=r,
        )  # fmt: skip
        self.realtime_errors = Counter(
            "echoic_realtime_errors", "Error events sent on realtime WebSockets, by code.",
            ("code",), registry=r,
        )  # fmt: skip
        for method in ("Recognize", "StreamingRecognize", HTTP_TRANSCRIPTIONS, HTTP_REALTIME):
            self.active_streams.labels(method).set(0)

    def set_model_state(self, name: str, version: str, state: str | None) -> None:
        """Record a version as 'loaded' or 'draining', or (None) gone."""
        for s in ("loaded", "draining"):
            try:
                self.model_loaded.remove(name, version, s)
            except KeyError:
                pass
        if state is not None:
            self.model_loaded.labels(name, version, state).set(1)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The registry in the format an Accept header asks for: (body, content type)."""
        from prometheus_client.exposition import choose_encoder

        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type

    def start_http(self, host: str, port: int) -> int:
        """Serve GET /metrics on host:port (0 = any free port) in a thread; returns the port."""
        self._http = serve_http(host, port, self.exposition)
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None


class MetricsHttp:
    """GET /metrics answered by `exposition(accept header)` -> (body, content type), in a
    thread; anything else is 404. `serve_http` starts one."""

    def __init__(self, httpd: Any, thread: Any) -> None:
        self._httpd, self._thread = httpd, thread
        self.server_port: int = httpd.server_port

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_http(host: str, port: int, exposition: Callable[[str], tuple[bytes, str]]) -> MetricsHttp:
    """Serve GET /metrics on host:port (0 = any free port) in a thread."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlsplit

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if urlsplit(self.path).path != "/metrics":
                self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics\n")
                return
            body, content_type = exposition(self.headers.get("Accept", ""))
            self._send(200, content_type, body)

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass  # a scrape every few seconds is not news

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = Server((host.strip("[]"), port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    return MetricsHttp(httpd, thread)
