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
endpoint (`start_http`, `MetricsHttp`: bounded connections, each with an idle timeout, on
a thread and loop of its own) answers GET /metrics and nothing else (404); the HTTP door
serves the same registry at its own /metrics (`exposition`). With `echoic serve
--workers N` each worker has its own, and the supervisor's --metrics-port shows them all
with a `worker` label (server/process/workers.py).

HTTP routes are the route templates (`/v1/audio/transcriptions`), and a path that
matches none is counted as `unmatched`, so a scan cannot grow the label set.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

HTTP_TRANSCRIPTIONS = "HTTPTranscriptions"  # the HTTP door's transcriptions, as a method label
HTTP_REALTIME = "HTTPRealtime"  # its realtime WebSockets, as a method label
IDLE_SECONDS = 30.0  # s a metrics connection with no request in progress stays open
# Open connections to the metrics port, count: Prometheus keeps one per scraper, and a
# few scrapers (two Prometheus replicas, a person with curl) need no more; each costs a
# descriptor, of the process's 1,024 by default.
MAX_CONNECTIONS = 64


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

    def start_http(self, host: str, port: int, idle_seconds: float = IDLE_SECONDS) -> int:
        """Serve GET /metrics on host:port (0 = any free port) in a thread; returns the port."""
        self._http = serve_http(host, port, self.exposition, idle_seconds=idle_seconds)
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None


class _ScrapeLog(logging.LoggerAdapter):
    """aiohttp's log for the metrics port: a request it cannot parse, or a client gone, is
    one debug line (no traceback: nobody but a scraper has business here, and a scan
    must not fill the log); anything else is aiohttp's error with its traceback."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(error, (ConnectionError, HttpProcessingError)):
            self.logger.debug("metrics port: %s", str(error).strip()[:200])
            return
        super().exception(msg, *args, exc_info=exc_info, **kw)


class MetricsHttp:
    """GET /metrics answered by `exposition(accept header)` -> (body, content type); any
    other path is 404, any other method 405. `serve_http` starts one.

    aiohttp on an event loop of its own, in one thread: an open connection costs a socket,
    never a thread (prometheus_client's server spent a thread on each, with no timeout:
    1,000 idle connections, 1,000 threads). A connection with no request in progress (idle,
    or still sending its headers) is closed after `idle_seconds`; beyond `MAX_CONNECTIONS`
    the oldest such connection is closed to make room, so that neither idle sockets nor a
    scan can use up the process's descriptors or lock a scraper out. `exposition` runs in
    one thread of its own (scrapes wait for each other, never for the loop), and a loop
    of its own means a scrape is answered even while the server's event loop is stalled.
    """

    def __init__(
        self, host: str, port: int, exposition: Callable[[str], tuple[bytes, str]],
        idle_seconds: float,
    ) -> None:  # fmt: skip
        import asyncio
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self._exposition = exposition
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="echoic-metrics-scrape")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="echoic-metrics", daemon=True
        )
        self._thread.start()
        self._runner: Any = None
        try:
            started = asyncio.run_coroutine_threadsafe(self._start(host, port, idle_seconds),
                                                       self._loop)  # fmt: skip
            self.server_port: int = started.result()
        except BaseException:
            self.stop()
            raise

    async def _start(self, host: str, port: int, idle_seconds: float) -> int:
        from aiohttp import web

        from echoic.server.connections import capped_server

        server = capped_server(
            self._answer, limit=MAX_CONNECTIONS, access_log=None, logger=_ScrapeLog(),
            keepalive_timeout=idle_seconds,
        )  # fmt: skip
        runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host.strip("[]"), port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        return runner.addresses[0][1]

    async def _answer(self, request: Any) -> Any:
        import asyncio

        from aiohttp import web

        if request.method != "GET":
            return web.Response(status=405, text="GET /metrics\n", headers={"Allow": "GET"})
        if request.path != "/metrics":
            return web.Response(status=404, text="not found: try /metrics\n")
        body, content_type = await asyncio.get_running_loop().run_in_executor(
            self._pool, self._exposition, request.headers.get("Accept", "")
        )
        return web.Response(body=body, headers={"Content-Type": content_type})

    def stop(self) -> None:
        import asyncio

        if self._runner is not None:
            runner, self._runner = self._runner, None
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(timeout=10)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()
        self._pool.shutdown()  # a scrape in progress ends first


def serve_http(
    host: str, port: int, exposition: Callable[[str], tuple[bytes, str]],
    idle_seconds: float = IDLE_SECONDS,
) -> MetricsHttp:  # fmt: skip
    """Serve GET /metrics on host:port (0 = any free port) in a thread; `idle_seconds`:
    how long a connection with no request in progress stays open."""
    return MetricsHttp(host, port, exposition, idle_seconds)
