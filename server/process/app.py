"""Build, run and stop the gRPC server.

    server, port = await create_server(ServerConfig(model_dir=..., port=0))
    ...                          # talk to 127.0.0.1:port
    await server.stop(grace=5)

`create_server` loads the models, binds the port (0 = any free one), starts the
gRPC server, the HTTP door (server/doors/http.py, `http_port`), the metrics endpoint and
the repository poller, all on the caller's event loop, and returns once it serves.
`serve(config)` is the process around it (`echoic serve`): it runs until SIGTERM
or SIGINT, then stops taking new calls, reports NOT_SERVING to health checks (and
503 at /readyz) and gives the open streams `grace_seconds` to finish. With
`--workers N`, server/process/workers.py runs N such processes on the same ports.

Besides `echoic.v1.Transcriber` the server offers the standard
`grpc.health.v1.Health` service ("" and "echoic.v1.Transcriber") and server
reflection.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from echoic.model.core.version import echoic_version
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.server.config import (
    DECODER_THREADS,
    ServerConfig,
    ServerError,
    busy_port_hint,
    probe_binds,
)
from echoic.server.core.beam_processes import BeamProcesses
from echoic.server.core.formatting import check_tagger, use_tagger
from echoic.server.core.models import ModelRegistry
from echoic.server.doors.service import TranscriberService, add_to_server
from echoic.server.metrics import Metrics

if TYPE_CHECKING:
    from echoic.server.doors.http import HttpDoor

log = logging.getLogger("echoic.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Transcriber"].full_name  # "echoic.v1.Transcriber"


END_SECONDS = 10.0  # s streams still open when the grace ends get to send their final results


class Server:
    """A running echoic server: the gRPC server plus its models, metrics and poller."""

    def __init__(
        self,
        config: ServerConfig,
        grpc_server: grpc.aio.Server,
        registry: ModelRegistry,
        metrics: Metrics,
        health: health_aio.HealthServicer,
        service: TranscriberService,
        executors: tuple[ThreadPoolExecutor, ...],
        beams: BeamProcesses | None = None,
    ) -> None:
        self.config = config
        self.grpc_server = grpc_server
        self.registry = registry
        self.metrics = metrics
        self.health = health
        self.service = service
        self._executors = executors
        self.beam_processes = beams  # --beam-processes' decoder processes; None when off
        self.port = 0  # gRPC port
        self.metrics_port: int | None = None  # Prometheus port, None when off
        self.http: HttpDoor | None = None  # the HTTP door, None when off
        self.http_port: int | None = None  # its port, None when off
        self._stopped = False

    async def stop(self, grace: float | None = None) -> None:
        """Drain, then stop, so that a load balancer can follow: health says NOT_SERVING
        at once while connections are still accepted; new calls get UNAVAILABLE (retry
        elsewhere); open streams get `grace` s (default: config.grace_seconds) to end,
        and those still open then get their final result for the audio received so far
        and end with OK."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.grace_seconds if grace is None else grace
        self.service.draining = True
        await self.health.enter_graceful_shutdown()  # health checks say NOT_SERVING from now
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.service.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.service.active:
            log.info("grace over: ending %d open stream(s) with their results", self.service.active)
            self.service.end_open_streams()
            deadline = loop.time() + END_SECONDS
            while self.service.active and loop.time() < deadline:
                await asyncio.sleep(0.05)
        if self.http is not None:
            await self.http.stop()
        await self.grpc_server.stop(0)
        await self.registry.close()
        self.metrics.stop_http()
        for executor in self._executors:  # a model call or decoding in flight ends first
            await asyncio.to_thread(executor.shutdown)
        if self.beam_processes is not None:
            await asyncio.to_thread(self.beam_processes.close)

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


def _stop_pools(executors: tuple[ThreadPoolExecutor, ...], beams: BeamProcesses | None) -> None:
    """A server that could not start: its threads and decoder processes end."""
    for pool in executors:
        pool.shutdown(wait=False)
    if beams is not None:
        beams.close()


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ServerError(f"{path}: cannot read the {what} ({e.strerror or e})") from e


def _credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None:
        return None
    cert, key = _read(config.tls_cert, "TLS certificate"), _read(config.tls_key, "TLS key")
    client_ca = _read(config.tls_client_ca, "client CA") if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _add_riva(
    service: TranscriberService, registry: ModelRegistry, grpc_server: grpc.aio.Server
) -> str | None:
    """The Riva ASR API beside echoic's, when nvidia-riva-client (the riva extra) is
    installed; returns its service name, or None."""
    try:
        from echoic.server.doors import riva
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("riva"):
            raise
        log.info("the Riva ASR API is off: pip install 'echoic[riva]' to serve it")
        return None
    riva.add_to_server(riva.RivaService(service, registry), grpc_server)
    return riva.SERVICE_NAME


def _enable_reflection(grpc_server: grpc.aio.Server, riva: str | None) -> None:
    """Server reflection as both grpc.reflection.v1 (what grpcurl, grpc-js and Postman ask
    first) and v1alpha. The two protocols are the same messages under two package names,
    so one servicer (grpcio-reflection's, which ships only v1alpha) answers both."""
    from grpc_reflection.v1alpha import reflection_pb2

    names = (
        SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        REFLECTION_V1,
        reflection.SERVICE_NAME,
        *([riva] if riva else []),
    )
    servicer = reflection.aio.ReflectionServicer(names)
    for service in (REFLECTION_V1, reflection.SERVICE_NAME):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
        grpc_server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )


def _ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The HTTP door's TLS: gRPC's certificate, key and client CA."""
    if config.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
        if config.tls_client_ca is not None:
            context.load_verify_locations(config.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise ServerError(f"cannot serve HTTP over TLS with {config.tls_cert}: {e}") from e
    return context


def _http_door() -> type[HttpDoor]:
    try:
        from echoic.server.doors.http import HttpDoor
    except ImportError as e:
        if e.name != "aiohttp":
            raise
        raise ServerError(
            "the HTTP door needs aiohttp: pip install 'echoic[serve]' (or turn HTTP off with "
            "--http-port 0)"
        ) from e
    return HttpDoor


def _check_ports_free(config: ServerConfig) -> None:
    """A port another program holds is an error before any model loads (seconds), with the
    flag to change; the real bind below still decides (a port taken in between)."""
    ports = [(config.host, config.port, "cannot listen on", "--port")]
    if config.http_port:
        ports.append((config.host, config.http_port, "cannot serve HTTP on", "--http-port"))
    if config.metrics_port:
        ports.append((config.metrics_host, config.metrics_port, "cannot serve metrics on",
                      "--metrics-port"))  # fmt: skip
    for host, port, error, flag in ports:
        if port == 0:
            continue
        try:
            for *_, e in probe_binds(host, port):
                # Other errors: the real bind below says what is wrong with the address.
                if e is not None and e.errno == errno.EADDRINUSE:
                    raise ServerError(
                        f"{error} {host}:{port}: {e.strerror}{busy_port_hint(flag)}"
                    ) from e
        except socket.gaierror:
            continue  # the bind below says what is wrong with the address


def _load_tagger(path: Path | None) -> None:
    """The punctuation tagger, loaded now so the first formatted result does not wait, and
    whether it could be recorded for every request to read; one line in the log when it
    cannot be (the server serves on, without punctuation)."""
    use_tagger(path)
    error = check_tagger()
    if error is not None:
        log.warning("%s; requests for punctuation will be refused", error)


async def create_server(config: ServerConfig) -> tuple[Server, int]:
    """Load the models and start serving; returns the running server and its gRPC port."""
    credentials = _credentials(config)  # unreadable certificates fail before any model loads
    if not config.reuse_port:  # a --workers worker's ports are held by its supervisor
        _check_ports_free(config)
    await asyncio.to_thread(_load_tagger, config.punctuation_model)
    door = _http_door() if config.http_port else None
    ssl_context = _ssl_context(config) if door is not None else None
    metrics = Metrics()
    # Model calls run here, one at a time per model version; a few versions can overlap.
    executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="echoic-engine")
    # Beam searches run here, bounded, beside the batches rather than inside them; with
    # decoder processes (--beam-processes) these threads only wait on them, one each.
    threads = max(DECODER_THREADS, config.beam_decoder_processes)
    decoders = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="echoic-decode")
    # Whole files and buffered streams are decoded here: see TranscriberService.
    audio = ThreadPoolExecutor(max_workers=config.decode_threads, thread_name_prefix="echoic-audio")
    executors = (executor, decoders, audio)
    beams = registry = None
    try:
        if config.beam_decoder_processes and not config.engine_process:  # else the engines'
            beams = await asyncio.to_thread(BeamProcesses, config.beam_decoder_processes)
        registry = ModelRegistry(config, metrics, executor, decoders, beams)
        await registry.start()
    except BaseException:
        if registry is not None:
            await registry.close()
        await asyncio.to_thread(_stop_pools, executors, beams)
        raise
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # A busy port is an error, not a second server beside it; only a worker of
        # `--workers` shares its port, which its supervisor holds (server/process/workers.py).
        ("grpc.so_reuseport", int(config.reuse_port)),
    ]
    if config.max_connection_age_seconds:
        # GOAWAY after this age: clients reconnect (and rebalance over the replicas there
        # are now); the streams open on the old connection get as long as a stream may last.
        age_ms = int(config.max_connection_age_seconds * 1000)
        grace_ms = int((config.max_stream_seconds or 24 * 3600) * 1000)
        options += [("grpc.max_connection_age_ms", age_ms),
                    ("grpc.max_connection_age_grace_ms", grace_ms)]  # fmt: skip
    grpc_server = grpc.aio.server(options=options)
    service = TranscriberService(config, registry, metrics, audio)
    add_to_server(service, grpc_server)
    riva = _add_riva(service, registry, grpc_server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, grpc_server)
    if config.reflection:
        _enable_reflection(grpc_server, riva)
    server = Server(config, grpc_server, registry, metrics, health, service, executors, beams)
    address = f"{config.host}:{config.port}"
    try:
        if credentials is None:
            port = grpc_server.add_insecure_port(address)
        else:
            port = grpc_server.add_secure_port(address, credentials)
        if config.metrics_port is not None:
            server.metrics_port = metrics.start_http(
                config.metrics_host, config.metrics_port, config.idle_timeout_seconds
            )
        if door is not None:
            http_address = f"{config.host}:{config.http_port}"
            server.http = door(config, service, registry, metrics)
            server.http_port = await server.http.start(
                config.host, config.http_port, ssl_context, reuse_port=config.reuse_port
            )
    except BaseException as e:
        await registry.close()
        metrics.stop_http()
        await asyncio.to_thread(_stop_pools, executors, beams)
        if isinstance(e, RuntimeError):  # grpc's "Failed to bind to address ..."
            raise ServerError(f"cannot listen on {address}: {e}") from e
        if isinstance(e, OSError) and server.http is not None:
            raise ServerError(f"cannot serve HTTP on {http_address}: {e}") from e
        if isinstance(e, OSError):
            raise ServerError(
                f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {e}"
            ) from e
        raise
    server.port = port
    await grpc_server.start()
    for name in ("", SERVICE_NAME, *([riva] if riva else [])):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    if credentials is None and not _loopback(config.host):
        log.warning(
            "serving plaintext gRPC%s on %s, reachable from other machines: audio and "
            "transcripts cross the network unencrypted (--tls-cert/--tls-key, or a TLS proxy "
            "in front)",
            " and HTTP" if server.http_port is not None else "", config.host,
        )  # fmt: skip
    log.info(
        "echoic %s listening on %s:%d (%s)%s%s", echoic_version(), config.host, port,
        "TLS" if config.tls_cert else "plaintext",
        f", HTTP on :{server.http_port}" if server.http_port is not None else "",
        f", metrics on :{server.metrics_port}" if server.metrics_port is not None else "",
    )  # fmt: skip
    return server, port


def _loopback(host: str) -> bool:
    """Whether `host` (as given to --host) is reachable only from this machine."""
    import ipaddress

    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: assume it resolves to a reachable address


async def _serve(config: ServerConfig, on_ready: Callable[[Server], None] | None) -> None:
    server, _port = await create_server(config)
    loop = asyncio.get_running_loop()
    stopping: asyncio.Task | None = None

    def on_signal(signum: int) -> None:
        nonlocal stopping
        if stopping is None:
            log.info(
                "%s: draining open streams for up to %g s",
                signal.Signals(signum).name, config.grace_seconds,
            )  # fmt: skip
            stopping = loop.create_task(server.stop())

    def on_hangup() -> None:
        if stopping is not None:
            return  # shutting down: nothing new loads
        if server.registry.repo is None:
            log.info("SIGHUP: no model repository to rescan (serving one --model directory)")
            return
        log.info("SIGHUP: rescanning the model repository %s", server.registry.repo)
        server.registry.rescan()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    if on_ready is not None:  # serving, and the signals are handled from here on
        on_ready(server)
    await server.wait_for_termination()
    if stopping is not None:
        await stopping
    log.info("stopped")


def serve(config: ServerConfig, on_ready: Callable[[Server], None] | None = None) -> None:
    """Run a server until SIGTERM or SIGINT, then drain it (what `echoic serve` runs);
    `on_ready(server)` is called once it serves. This is one server process: with
    `--workers N`, `echoic serve` runs `server/process/workers.py:supervise` instead, whose workers
    each run this (the process level imports the server, never the other way round)."""
    if config.workers > 1:
        raise ValueError(
            f"workers={config.workers}: app.serve runs one server process; "
            "server/process/workers.py:supervise runs several"
        )
    asyncio.run(_serve(config, on_ready))
