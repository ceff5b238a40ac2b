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
"""

from __future__ import annotations

from typing import Any


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self._http: tuple[Any, Any] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        model = ("model", "version")
        fast = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
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
        for method in ("Recognize", "StreamingRecognize"):
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

    def start_http(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0 = any free port) in a thread; returns the port."""
        from prometheus_client import start_http_server

        self._http = start_http_server(port, addr=host, registry=self.registry)
        return self._http[0].server_port

    def stop_http(self) -> None:
        if self._http is not None:
            httpd, thread = self._http
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)
            self._http = None
