"""The synchronous client: `Client(target).recognize(...)`, `.stream(...)`, `.list_models()`.

    from echoic.clients import Client

    with Client("localhost:50051") as client:  # or several: "10.0.0.5:50051,10.0.0.6:50051"
        print(client.recognize("talk.wav").text)
        for response in client.stream_file("talk.wav", realtime=True):
            for result in response.results:
                print(result.is_final, result.alternatives[0].transcript)

Unary calls (`recognize`, `list_models`) are retried on UNAVAILABLE (server not
up yet, restarting or draining) with jittered exponential backoff, within the
call's overall timeout. A stream is not retried once it has started (its audio
is gone), but it waits up to `connect_timeout` for the server to be reachable.
Server errors arrive as `ClientError` with the gRPC status code and the
server's message.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from echoic.clients.audio import Chunk
from echoic.clients.messages import (
    AudioSource,
    Recognition,
    final_response,
    open_file_stream,
    payload_of,
    pieces,
    recognize_requests,
    stream_config,
    streaming_requests,
)
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc

T = TypeVar("T")

MAX_RECEIVE_BYTES = 64 * 1024 * 1024  # largest response accepted, bytes


class ClientError(Exception):
    """A call that failed: `code` is the gRPC status (None for local errors)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, target: str) -> ClientError:
        code = error.code() if hasattr(error, "code") else None
        details = (error.details() if hasattr(error, "details") else None) or str(error)
        if code == grpc.StatusCode.UNAVAILABLE:
            details = f"server {target} is unavailable ({details})"
        return cls(details, code)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of unary calls: attempts in all, and the backoff between them."""

    attempts: int = 5  # tries in all, count (1 = no retry)
    initial_backoff: float = 0.25  # s before the first retry
    max_backoff: float = 4.0  # s, the longest wait between two tries
    multiplier: float = 2.0  # backoff growth per retry
    codes: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, not {self.attempts}")

    def backoff(self, retry: int) -> float:
        """Seconds before retry number `retry` (0-based), with +-20 % jitter."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier**retry)
        return base * random.uniform(0.8, 1.2)


class Tries:
    """The tries of one unary call under a RetryPolicy and an overall timeout.

    The retry loop's decisions, written once: which errors are retried, how many
    tries, the backoff, and the deadline that bounds tries and waits together.
    `Client` runs the loop with time.sleep, `AsyncClient` with asyncio.sleep:

        tries = Tries(policy, timeout)
        while True:
            try:
                return call(request, timeout=tries.time_left())
            except grpc.RpcError as e:
                if (wait := tries.wait_after(e.code())) is None:
                    raise ClientError.from_rpc(e, target) from e
                time.sleep(wait)
    """

    def __init__(
        self,
        policy: RetryPolicy,
        timeout: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy, self._clock = policy, clock
        self.deadline = None if timeout is None else clock() + timeout  # clock s; None = none
        self.failed = 0  # tries that failed so far, count

    def time_left(self) -> float | None:
        """Seconds the next try may take (None = no limit)."""
        return None if self.deadline is None else max(0.0, self.deadline - self._clock())

    def wait_after(self, code: grpc.StatusCode | None) -> float | None:
        """After a try failed with `code`: seconds to wait before the next, None = give up."""
        wait = self.policy.backoff(self.failed)
        self.failed += 1
        if (
            self.failed >= self.policy.attempts
            or code not in self.policy.codes
            or (self.deadline is not None and self._clock() + wait >= self.deadline)
        ):
            return None
        return wait


# ------------------------------------------------------------------ channel


def _read_pem(path: str | os.PathLike[str] | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ClientError(f"cannot read the {what} {path} ({e.strerror or e})") from e


def channel_credentials(
    tls_ca: str | os.PathLike[str] | None,
    tls_cert: str | os.PathLike[str] | None,
    tls_key: str | os.PathLike[str] | None,
) -> grpc.ChannelCredentials:
    if (tls_cert is None) != (tls_key is None):
        raise ClientError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(tls_ca, "CA certificate"),
        private_key=_read_pem(tls_key, "client key"),
        certificate_chain=_read_pem(tls_cert, "client certificate"),
    )


# Calls spread over every address the target resolves to (round robin: each new call, and
# each stream, goes to the next ready and healthy server), and unary calls that find a
# server gone or draining (UNAVAILABLE) are retried by gRPC on another one before the
# client's own retry.
SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    # A server that starts draining turns NOT_SERVING here and gets no new calls.
    "healthCheckConfig": {"serviceName": "echoic.v1.Transcriber"},
    "methodConfig": [{
        "name": [{"service": "echoic.v1.Transcriber", "method": "Recognize"},
                 {"service": "echoic.v1.Transcriber", "method": "ListModels"}],
        "retryPolicy": {
            "maxAttempts": 4, "initialBackoff": "0.05s", "maxBackoff": "1s",
            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
})  # fmt: skip


def resolve_target(target: str) -> str:
    """A gRPC target for `target`: "host:port", a gRPC URI ("dns:///name:port",
    "ipv4:a:p,b:p"), or several "host:port" separated by commas (IP addresses or
    localhost), which become one "ipv4:"/"ipv6:" target balanced round robin."""
    if "," not in target or ":///" in target or target.startswith(("ipv4:", "ipv6:")):
        return target
    import ipaddress

    addresses = []
    for part in (p.strip() for p in target.split(",")):
        host, sep, port = part.rpartition(":")
        host = host.strip("[]")
        host = "127.0.0.1" if host == "localhost" else host
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ClientError(
                f"{part!r} in {target!r}: list servers by IP address (or localhost), or give "
                "one name that resolves to all of them: dns:///NAME:PORT"
            ) from None
        if not sep or not port.isdigit():
            raise ClientError(f"{part!r} in {target!r}: give HOST:PORT")
        addresses.append((ip.version, f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"))
    versions = {v for v, _ in addresses}
    if len(versions) > 1:
        raise ClientError(f"{target!r}: list IPv4 or IPv6 addresses, not both")
    return f"ipv{versions.pop()}:" + ",".join(a for _, a in addresses)


def channel_options(
    tls_server_name: str | None = None, own_connection: bool = False
) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", -1),  # the server enforces its own limit
        # Reconnect soon after a server comes (back) up; grpc's default waits >= 1 s.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.service_config", SERVICE_CONFIG),
        ("grpc.enable_retries", 1),
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    if own_connection:  # grpc otherwise shares one per target among a process's channels
        options.append(("grpc.use_local_subchannel_pool", 1))
    return options


def open_channel(
    channels: Any,
    target: str,
    *,
    tls: bool,
    tls_ca: str | os.PathLike[str] | None,
    tls_cert: str | os.PathLike[str] | None,
    tls_key: str | os.PathLike[str] | None,
    tls_server_name: str | None,
    own_connection: bool = False,
) -> Any:
    """A channel from `channels` (the grpc or grpc.aio module): TLS when any TLS option is
    set; `target` as `resolve_target` takes it (one server or several)."""
    target = resolve_target(target)
    options = channel_options(tls_server_name, own_connection)
    if tls or tls_ca or tls_cert or tls_key:
        creds = channel_credentials(tls_ca, tls_cert, tls_key)
        return channels.secure_channel(target, creds, options=options)
    return channels.insecure_channel(target, options=options)


# ------------------------------------------------------------------ client


class ResponseStream:
    """The responses of one StreamingRecognize call; iterate, or `cancel()` it."""

    def __init__(self, call: Any, target: str) -> None:
        self._call, self._target = call, target

    def __iter__(self) -> Iterator[pb.StreamingRecognizeResponse]:
        return self

    def __next__(self) -> pb.StreamingRecognizeResponse:
        try:
            return next(self._call)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e, self._target) from e

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Connection:
    """What `Client` and `AsyncClient` share: the target, the timeouts, the retry
    policy and a channel opened with the `channel_module` of the subclass."""

    channel_module: Any = grpc  # grpc, or grpc.aio

    def __init__(
        self,
        target: str,
        *,
        tls: bool = False,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = 120.0,
        connect_timeout: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen
        own_connection: bool = False,
    ) -> None:
        self.target, self.timeout, self.connect_timeout, self.retry = (
            target, timeout, connect_timeout, retry,
        )  # fmt: skip
        self._channel = open_channel(
            self.channel_module, target, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
            tls_key=tls_key, tls_server_name=tls_server_name, own_connection=own_connection,
        )  # fmt: skip
        self._stub = pb_grpc.TranscriberStub(self._channel)


class Client(Connection):
    """A connection to one echoic server; thread-safe, share one per process.

    target: "host:port". TLS when any of tls_ca (CA to verify the server; None =
    the system's roots with tls=True), tls_cert and tls_key (mutual TLS) is given.
    timeout: s per unary call, retries included (None = no limit).
    connect_timeout: s a stream waits for the server to be reachable.
    own_connection: a TCP connection of this client's own; otherwise grpc shares one among
    the process's clients of the same target. A server's `--workers` share its port by
    connection, so several clients each with their own reach several workers.
    """

    # ---- unary ---------------------------------------------------------------------

    def _unary(self, call: Callable[..., T], request: Any, timeout: float | None) -> T:
        tries = Tries(self.retry, self.timeout if timeout is None else timeout)
        while True:
            try:
                return call(request, timeout=tries.time_left())
            except grpc.RpcError as e:
                if (wait := tries.wait_after(e.code())) is None:
                    raise ClientError.from_rpc(e, self.target) from e
                time.sleep(wait)

    def recognize(
        self,
        audio: AudioSource,
        *,
        encoding: str | int | None = None,
        sample_rate: int = 0,
        channels: int = 0,
        timeout: float | None = None,
        **config: Any,
    ) -> Recognition:
        """Transcribe whole audio: a file path, encoded bytes, or samples (with sample_rate).

        A path to WAV or FLAC is sent as it is, other files decoded here to PCM16;
        bytes are sent as they are (encoding 'auto' detects WAV/FLAC; 'linear16'
        needs sample_rate). `config`: the keywords of `recognition_config` (model,
        model_version, words, decoder, beam_size, ...).
        """
        payload = payload_of(audio, encoding, sample_rate, channels)
        cfg, request = recognize_requests(payload, config)
        if request is not None:
            response = self._unary(self._stub.Recognize, request, timeout)
        else:
            # Too big for one message: the same audio through a stream, retried whole.
            def by_stream(requests: list, timeout: float | None) -> pb.RecognizeResponse:
                call = self._stub.StreamingRecognize(iter(requests), timeout=timeout)
                return final_response(call)

            messages = list(streaming_requests(cfg, pieces(payload.data), interim_results=False))
            response = self._unary(by_stream, messages, timeout)
        return Recognition.from_response(response)

    def list_models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        """The model versions the server has loaded."""
        response = self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return list(response.models)

    # ---- streaming -----------------------------------------------------------------

    def wait_until_reachable(self, timeout: float | None = None) -> None:
        """Block until the channel connects; ClientError(UNAVAILABLE) after `timeout` s."""
        timeout = self.connect_timeout if timeout is None else timeout
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise ClientError(
                f"server {self.target} is unavailable (not reachable within {timeout:g} s)",
                grpc.StatusCode.UNAVAILABLE,
            ) from None

    def stream(
        self,
        chunks: Iterable[bytes | Chunk],
        *,
        encoding: str | int | None = "linear16",
        sample_rate: int = 0,
        channels: int = 0,
        interim_results: bool = True,
        interim_interval_ms: int = 0,
        config: pb.RecognitionConfig | None = None,
        **options: Any,
    ) -> ResponseStream:
        """Stream audio as it comes; iterate the result for interim and final results.

        chunks: audio pieces (raw PCM16 by default: give sample_rate and, for
        several channels, channels). Pacing is up to the iterable: it is consumed
        as the server takes it. `options`: the keywords of `recognition_config`;
        or a ready `config`.
        """
        config = stream_config(config, encoding, sample_rate, channels, options)
        self.wait_until_reachable()
        requests = streaming_requests(
            config, chunks, interim_results=interim_results, interim_interval_ms=interim_interval_ms
        )
        return ResponseStream(self._stub.StreamingRecognize(requests), self.target)

    def stream_file(
        self,
        path: str | os.PathLike[str],
        *,
        realtime: bool = True,
        chunk_ms: float = 100.0,
        encoding: str | None = None,
        interim_results: bool = True,
        interim_interval_ms: int = 0,
        **options: Any,
    ) -> ResponseStream:
        """Stream a file: decoded to PCM16 (or, with encoding 'wav'/'flac', its bytes as
        they are) in chunks of `chunk_ms`, at real time unless `realtime=False`."""
        config, chunks = open_file_stream(
            path, realtime=realtime, chunk_ms=chunk_ms, encoding=encoding, config=options
        )
        return self.stream(
            chunks,
            config=config,
            interim_results=interim_results,
            interim_interval_ms=interim_interval_ms,
        )

    # ---- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
