"""The HTTP door (aiohttp, on the gRPC server's event loop): OpenAI's audio API, health, metrics.

    POST /v1/audio/transcriptions   a file -> its transcript (server/doors/openai_api.py's shapes)
    GET  /v1/models                 the served model names; /v1/models/{model} one of them
    GET  /healthz                   200 while the process runs
    GET  /readyz                    200 while a model is loaded and the server is not draining
                                    (gRPC health says SERVING), else 503
    GET  /metrics                   the server's Prometheus registry
    GET  /                          a browser page (static/index.html): the microphone live
                                    over the realtime WebSocket, a file, txt/srt downloads
    POST /v1/realtime/transcription_sessions, GET /v1/realtime: server/doors/realtime.py

A door, thin as ARCHITECTURE.md asks: a transcription is admitted by the gRPC
service's own `admitted` (the same `--max-streams` count and the same refusal while
draining), its fields checked into `Options` (`server/doors/openai_api.py:options_of`,
through the core's `server/core/options.py:stream_options`, as every door's), and
recognized by `TranscriberService.recognize_whole`, the function gRPC Recognize calls;
so the same audio gives the same transcript on either door. Errors are OpenAI's error
JSON, each refusal's kind answered by this door's own HTTP status and in its own words
(`server/doors/openai_api.py:api_error`, `HTTP_STATUS`, `HTTP_REMEDIES`); nothing answers
with a traceback. Every request is counted by route and status, with its latency.

The upload is read a chunk at a time: over `--max-upload-mb` it is refused with
413 as soon as that many bytes have arrived (at once when its Content-Length or
`Expect: 100-continue` says so), and a client that sends nothing for
`--idle-timeout-seconds`, sends slower than `--min-upload-bytes-per-second` (on average,
once the idle timeout has passed), or has not sent it all within
`--upload-timeout-seconds`, gets 408. The request takes its `--max-streams` slot once
the upload is complete, so a slow upload holds no slot that a ready request could use.
What bounds the memory uploads hold is a cap on the transcription requests in progress,
uploading or recognized: UPLOADS_PER_STREAM x `--max-streams`; a request beyond it gets
429 before its body is read.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import BodyPartReader, ClientError, StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError

from echoic.server.config import ServerConfig
from echoic.server.connections import capped_app_runner, descriptor_share
from echoic.server.core.models import ModelRegistry
from echoic.server.core.types import Options
from echoic.server.doors.openai_api import (
    MAX_FIELD_BYTES,
    ApiError,
    TextDeltas,
    api_error,
    bad,
    model_list,
    options_of,
    render,
    segments_of,
    sse,
    transcription_request,
)
from echoic.server.doors.realtime import RealtimeDoor
from echoic.server.doors.service import RateLimitedWarning, TranscriberService
from echoic.server.metrics import HTTP_TRANSCRIPTIONS, Metrics

log = logging.getLogger("echoic.server")
T = TypeVar("T")

CHUNK = 64 * 1024  # bytes read from an upload at a time
MAX_FIELDS = 32  # form fields besides the file, count
FORM_SLACK = MAX_FIELDS * MAX_FIELD_BYTES  # bytes a form may hold besides the file
UNMATCHED = "unmatched"  # the route label of a path that matches no route
PAGE = Path(__file__).parent / "static" / "index.html"  # the browser page, self-contained
SHUTDOWN_SECONDS = 10.0  # s requests still open when the HTTP server stops get to end
# Transcription requests in progress per --max-streams slot: one being recognized and
# one arriving behind it, so a slot never waits for an upload, while at most this many
# x --max-upload-mb of uploads are held at once.
UPLOADS_PER_STREAM = 2
PACE_CHECK_SECONDS = 1.0  # s between two checks of a waiting upload's pace


class _ProtocolLog(logging.LoggerAdapter):
    """aiohttp's own log (a request it cannot parse, a handler's error it answers): a
    client's mistake (a header line over 8,190 bytes, a request that is not HTTP) is one
    rate-limited warning line, as the gRPC door logs them; a client gone is nothing; the
    rest is aiohttp's error with its traceback, as before."""

    def __init__(self, warn: RateLimitedWarning) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._warn = warn

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(error, ConnectionError):
            return
        if isinstance(error, HttpProcessingError):
            peer = args[0] if args else "?"
            self._warn("HTTP 400 from %s: %s", peer, str(error).strip()[:200])
            return
        super().exception(msg, *args, exc_info=exc_info, **kw)


class HttpDoor:
    """The HTTP server of one echoic server; `start` binds it, `stop` closes it."""

    def __init__(
        self,
        config: ServerConfig,
        service: TranscriberService,
        registry: ModelRegistry,
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._service = service
        self._registry = registry
        self._metrics = metrics
        self._runner: web.BaseRunner | None = None
        self._warn = RateLimitedWarning(10.0)
        self.upload_limit = int(config.max_upload_mb * 2**20)  # bytes of the file
        self.max_uploads = UPLOADS_PER_STREAM * config.max_streams  # requests in progress
        self._uploads = 0  # transcription requests in progress (from before their body)
        self._started = time.time()

    # ------------------------------------------------------------------ lifecycle

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._account])
        app.router.add_post(
            "/v1/audio/transcriptions", self.transcriptions, expect_handler=self._expect
        )
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/", self.page)
        RealtimeDoor(self._config, self._service, self._registry, self._metrics).add_routes(
            app.router
        )
        return app

    async def start(
        self, host: str, port: int, ssl_context: Any = None, *, reuse_port: bool = False
    ) -> int:
        """Listen on host:port (TLS with `ssl_context`; SO_REUSEPORT with `reuse_port`, for
        a worker of `echoic serve --workers`); returns the port."""
        limit = self._config.max_http_connections or descriptor_share()
        runner = capped_app_runner(
            self.application(), limit=limit, access_log=None, shutdown_timeout=SHUTDOWN_SECONDS,
            logger=_ProtocolLog(self._warn),
            # A connection with no request in progress (idle between requests, never sent
            # one, or still sending its headers) is closed after the idle timeout; aiohttp's
            # default holds it an hour, and a thousand such sockets exhaust the descriptors;
            # past the limit the oldest of them is closed at once (server/connections.py).
            keepalive_timeout=self._config.idle_timeout_seconds,
        )  # fmt: skip
        await runner.setup()
        site = web.TCPSite(
            runner, host.strip("[]"), port, ssl_context=ssl_context, reuse_port=reuse_port
        )
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        return runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ------------------------------------------------------------------ accounting

    def _route(self, request: web.Request) -> str:
        resource = request.match_info.route.resource
        return resource.canonical if resource is not None else UNMATCHED

    def _count(self, request: web.Request, status: int, started: float) -> None:
        route = self._route(request)
        self._metrics.http_requests.labels(route, str(status)).inc()
        self._metrics.http_latency.labels(route).observe(time.perf_counter() - started)

    def _refuse(self, request: web.Request, e: ApiError) -> web.Response:
        """OpenAI's error JSON for `e`, with one (rate-limited) log line."""
        if e.status >= 500 and e.status != 503:
            log.error("HTTP %s %s: %s", request.method, request.path, e.message)
        else:
            self._warn(
                "HTTP %d %s %s from %s: %s",
                e.status, request.method, request.path, request.remote, e.message,
            )  # fmt: skip
        return web.json_response(e.body(), status=e.status)

    @web.middleware
    async def _account(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        started = time.perf_counter()
        response: web.StreamResponse | None = None
        try:
            response = await handler(request)
        except ApiError as e:
            response = self._refuse(request, e)
        except web.HTTPException as e:  # aiohttp's own: no such route, wrong method
            response = self._refuse(request, ApiError(e.status, f"{e.reason}: {request.path}"))
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away: counted 499 below, nobody to answer
        except Exception as e:  # noqa: BLE001 - every error becomes OpenAI's error JSON
            error = api_error(e)
            if error.status == 500:
                log.exception("HTTP %s %s failed", request.method, request.path)
            response = self._refuse(request, error)
        finally:
            # None: the client went away before an answer (499, nginx's number for it)
            self._count(request, 499 if response is None else response.status, started)
        return response

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue`: refuse a declared oversize upload before it is sent."""
        if (request.content_length or 0) > self.upload_limit + FORM_SLACK:
            response = self._refuse(request, self._too_large())
            self._count(request, response.status, time.perf_counter())
            return response
        if request.headers.get("Expect", "").lower() != "100-continue":
            return None  # aiohttp answers other expectations itself
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own bytes are still to come
        return None

    # ------------------------------------------------------------------ routes

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        self._service.refuse_if_draining()
        if self._uploads >= self.max_uploads:
            raise ApiError(
                429,
                f"the server is at its limit of {self.max_uploads} transcription requests in "
                f"progress ({UPLOADS_PER_STREAM} x --max-streams, uploads included): retry "
                "later with backoff, or use another replica",
                code="too_many_uploads",
            )  # fmt: skip
        self._uploads += 1
        try:
            return await self._transcribe(request)
        finally:
            self._uploads -= 1

    async def _transcribe(self, request: web.Request) -> web.StreamResponse:
        fields, audio = await self._read_form(request)
        with self._service.admitted(HTTP_TRANSCRIPTIONS):
            if audio is None:
                raise bad(
                    "the form has no file field: send the audio as a file named `file` "
                    "(curl -F file=@audio.wav)",
                    "file", "missing_file",
                )  # fmt: skip
            if not audio:
                raise bad("the uploaded file is empty (0 bytes)", "file", "empty_file")
            asked = transcription_request(fields)
            opts = options_of(asked, max_beam=self._config.max_beam_size, interim=asked.stream)
            if asked.stream:
                return await self._events(request, opts, bytes(audio))
            whole = await self._service.recognize_whole(
                opts, bytes(audio), HTTP_TRANSCRIPTIONS, name="file"
            )
        body, content_type = render(asked, segments_of(whole.results), whole.seconds)
        headers = {"X-Echoic-Model": f"{whole.model.name}/{whole.model.version}"}
        if isinstance(body, str):
            return web.Response(text=body, content_type=content_type, headers=headers)
        return web.json_response(body, headers=headers)

    async def _events(
        self, request: web.Request, opts: Options, audio: bytes
    ) -> web.StreamResponse:
        """stream=true: `transcript.text.delta` events as words firm up, then
        `transcript.text.done`. Errors before the first event (undecodable audio, limits)
        are plain error responses; later ones end the stream with an `error` event."""
        results = self._service.recognize_paced(opts, audio, HTTP_TRANSCRIPTIONS, name="file")
        async with aclosing(results):
            step = await anext(results)  # the audio is decoded by now
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            deltas = TextDeltas(finals_only=opts.formatting is not None)
            try:
                while True:
                    for delta in deltas.add(step):
                        await response.write(sse({"type": "transcript.text.delta", "delta": delta}))
                    try:
                        step = await anext(results)
                    except StopAsyncIteration:
                        break
                await response.write(sse({"type": "transcript.text.done", "text": deltas.text}))
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - the status line is sent: an event says it
                error = api_error(e)
                if error.status == 500:
                    log.exception("HTTP %s %s failed", request.method, request.path)
                await response.write(sse({"type": "error", **error.body()}))
            await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(model_list(sorted(self._registry.serving), self._created()))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self._registry.serving:
            raise ApiError(
                404, f"model {name!r} is not served here: GET /v1/models lists what is",
                param="model", code="model_not_found",
            )  # fmt: skip
        return web.json_response(model_list([name], self._created())["data"][0])

    def _created(self) -> int:
        """The OpenAI model object's `created`: when this server started, s since the epoch."""
        return int(self._started)

    async def page(self, request: web.Request) -> web.Response:
        """The browser page: live transcription from the microphone, a file, downloads."""
        return web.Response(body=PAGE.read_bytes(), content_type="text/html", charset="utf-8")

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self._service.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self._registry.serving:
            return web.json_response({"status": "no model loaded"}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        body, content_type = self._metrics.exposition(request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    # ------------------------------------------------------------------ the upload

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"the file is over this server's limit of {self._config.max_upload_mb:g} MiB "
            "(--max-upload-mb): split the audio, or stream it",
            param="file", code="file_too_large",
        )  # fmt: skip

    async def _read_form(
        self, request: web.Request
    ) -> tuple[dict[str, list[str]], bytearray | None]:
        """The form's fields (name -> values) and the file's bytes (None: no file field)."""
        if request.content_type != "multipart/form-data":
            raise ApiError(
                415,
                "send the request as multipart/form-data with the audio in a file field named "
                f"`file` (curl -F file=@audio.wav), not {request.content_type or 'no type'}",
                code="unsupported_media_type",
            )  # fmt: skip
        if (request.content_length or 0) > self.upload_limit + FORM_SLACK:
            raise self._too_large()
        fields: dict[str, list[str]] = {}
        audio: bytearray | None = None
        started = asyncio.get_running_loop().time()  # loop time
        bound = partial(self._idle_bound, started=started, content=request.content)
        try:
            reader = await request.multipart()
            while (part := await bound(reader.next())) is not None:
                if not isinstance(part, BodyPartReader) or not part.name:
                    raise bad("a form part has no name, or is itself multipart: not a form")
                if part.name == "file":
                    if audio is not None:
                        raise bad("the form has two file fields: send one file", "file")
                    audio = await self._read_part(part, self.upload_limit, bound)
                    continue
                if sum(map(len, fields.values())) >= MAX_FIELDS:
                    raise bad(f"the form has more than {MAX_FIELDS} fields")
                value = await self._read_part(part, MAX_FIELD_BYTES, bound)
                try:
                    fields.setdefault(part.name, []).append(value.decode())
                except UnicodeDecodeError:
                    raise bad(f"form field {part.name} is not UTF-8 text", part.name) from None
        except (ValueError, AssertionError, ConnectionError, ClientError, HttpProcessingError) as e:
            raise bad(
                f"the multipart body is malformed or was cut short ({e or type(e).__name__}): "
                "send a complete multipart/form-data request"
            ) from None
        return fields, audio

    async def _read_part(
        self, part: BodyPartReader, limit: int, bound: Callable[[Awaitable[T]], Awaitable[T]]
    ) -> bytearray:
        data = bytearray()
        while chunk := await bound(part.read_chunk(CHUNK)):
            data += chunk
            if len(data) > limit:
                if part.name == "file":
                    raise self._too_large()
                raise bad(f"form field {part.name} is over {limit} bytes", part.name)
        return data

    async def _idle_bound(self, read: Awaitable[T], *, started: float, content: StreamReader) -> T:
        """`read`, or 408 when the client sends nothing for the idle timeout, sends slower
        than --min-upload-bytes-per-second (on average since `started`, the loop's time at
        the headers, once the idle timeout has passed), or is not done by the upload
        timeout. A read may wait for more than one chunk (a multipart boundary, a long
        preamble): bytes still arriving (`content`'s count) are not idle."""
        config = self._config
        idle, limit = config.idle_timeout_seconds, config.upload_timeout_seconds
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(read)
        seen, heard = content.total_bytes, loop.time()
        try:
            while True:
                now = loop.time()
                if content.total_bytes > self.upload_limit + FORM_SLACK:
                    # a body without Content-Length: a preamble or part headers, skipped
                    # unread, count against the limit as the file does
                    raise self._too_large()
                self._check_pace(content.total_bytes, now - started)
                # awake at least every PACE_CHECK_SECONDS while the read waits, for the pace
                wake = min(heard + idle, started + limit, now + PACE_CHECK_SECONDS)
                done, _ = await asyncio.wait({task}, timeout=max(wake - now, 0.0))
                if task in done:
                    return task.result()
                now = loop.time()
                if now >= started + limit:
                    message = (f"the upload was not complete within {limit:g} s "
                               "(--upload-timeout-seconds): send the request at once")  # fmt: skip
                    raise ApiError(408, message, code="request_timeout")
                if content.total_bytes != seen:
                    seen, heard = content.total_bytes, now
                elif now >= heard + idle:
                    raise ApiError(
                        408,
                        f"the upload sent nothing for {idle:g} s: send the request at once",
                        code="request_timeout",
                    )
        finally:
            task.cancel()  # nothing if it is done; a read left waiting ends with the request

    def _check_pace(self, received: int, elapsed: float) -> None:
        """408 when `received` bytes in `elapsed` s since the headers is behind
        --min-upload-bytes-per-second, the first --idle-timeout-seconds given free: a client
        that trickles a byte at a time must not hold its place for the whole upload timeout."""
        pace = self._config.min_upload_bytes_per_second
        grace = self._config.idle_timeout_seconds
        if pace and received < (elapsed - grace) * pace:
            raise ApiError(
                408,
                f"the upload is arriving at {received / elapsed:.0f} bytes/s, under this "
                f"server's minimum of {pace:g} bytes/s (--min-upload-bytes-per-second): send "
                "the request at once, over a faster link",
                code="request_timeout",
            )  # fmt: skip
