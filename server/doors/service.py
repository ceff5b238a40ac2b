"""The `echoic.v1.Transcriber` service: Recognize, StreamingRecognize, ListModels.

Each call is admitted (or refused with RESOURCE_EXHAUSTED at once when
`max_streams` calls are open, and with UNAVAILABLE while the server drains for
shutdown), pinned to the model version it resolved to for its whole life, and
counted by method and status code. A message that does not parse reaches the
rpc as `Malformed` and is answered INVALID_ARGUMENT. Errors a client can fix
become INVALID_ARGUMENT, OUT_OF_RANGE or DEADLINE_EXCEEDED with a sentence
saying what to change; anything else is INTERNAL and logged with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from echoic.model.core.audio import AudioTooLong, DecodeTooSlow
from echoic.model.core.version import echoic_version
from echoic.model.runtime.repository import version_key
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc
from echoic.server.config import ServerConfig
from echoic.server.core.models import LoadedModel, ModelRegistry
from echoic.server.core.refusals import door_message, refusal_of
from echoic.server.core.session import Session, open_session
from echoic.server.core.types import Options, Refusal, RefusalKind, Remedy, Result, invalid
from echoic.server.doors.grpc_api import parse_config, result_proto
from echoic.server.metrics import Metrics

log = logging.getLogger("echoic.server")
T = TypeVar("T")
# s of a whole file's audio fed to its stream at a time (`_recognize_windows`): its features
# and their STFT take about 0.7 MB a second of audio, so 30 s is some 20 MB a request,
# and 120 awaits an hour
WHOLE_WINDOW_SECONDS = 30.0
_STATES = {"loaded": pb.ModelInfo.LOADED, "draining": pb.ModelInfo.DRAINING}


@dataclass
class Whole:
    """What recognizing a whole file gives: final results (the core's, each door writes
    its own messages from them), its length and who answered."""

    results: list[Result]
    seconds: float  # audio received, s
    model: LoadedModel


# The gRPC status of each kind of refusal: this door's table (echoic's service and Riva's,
# server/doors/riva.py), as the HTTP door has its own (server/doors/openai_api.py:HTTP_STATUS).
GRPC_STATUS = {
    RefusalKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    RefusalKind.TOO_LARGE: grpc.StatusCode.OUT_OF_RANGE,
    RefusalKind.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    RefusalKind.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    RefusalKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    RefusalKind.UNSUPPORTED: grpc.StatusCode.FAILED_PRECONDITION,
    RefusalKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
_KIND_OF_STATUS = {code: kind for kind, code in GRPC_STATUS.items()}

# What a gRPC client can do, in its own calls (echoic's and Riva's rpcs have these names).
GRPC_REMEDIES = {
    Remedy.SPLIT_AUDIO: "split it, or stream it with StreamingRecognize",
    Remedy.SEND_WHOLE: "send the whole audio with Recognize instead",
}


class RequestError(Refusal):
    """A refusal in gRPC's words, for the gRPC door's own checks (the stream's messages,
    its idle time): a status code, its kind following from it, and a sentence saying what
    to change. Below the door, refusals are `Refusal(kind, message)`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(_KIND_OF_STATUS.get(code, RefusalKind.INTERNAL), message)
        self.code = code


class ClientGone(Exception):
    """The client cancelled the call or went away; its resources are freed."""


class MalformedRequest(RequestError):
    """A message that did not parse: INVALID_ARGUMENT, and a rate-limited log line."""


class Malformed:
    """A request message that did not parse, in place of the message: the rpc answers it
    with INVALID_ARGUMENT (grpc itself would answer UNKNOWN or INTERNAL, and log a
    traceback)."""

    def __init__(self, kind: str, error: DecodeError, api: str) -> None:
        self.kind, self.error, self.api = kind, error, api

    def problem(self) -> MalformedRequest:
        return MalformedRequest(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid {self.kind} message ({_reason(self.error)}): "
            f"build it with stubs generated from {self.api}",
        )


class RateLimitedWarning:
    """At most one log line per `seconds`, saying how many were left out since."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._next = 0.0  # time.monotonic() from which the next line may be written
        self._skipped = 0  # lines left out since the last one written

    def __call__(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._skipped += 1
            return
        if self._skipped:
            message += f" (and {self._skipped} more since the last such line)"
        log.warning(message, *args)
        self._next, self._skipped = now + self.seconds, 0


def _reason(error: DecodeError) -> str:
    text = str(error)
    return text.rsplit(": ", 1)[-1][:200] if ": " in text else "truncated or corrupt"


def lenient(message: type, api: str = "echoic/v1/transcriber.proto") -> Callable[[bytes], Any]:
    """A deserializer that hands the rpc a `Malformed` instead of raising; `api` names
    where correct stubs come from."""

    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as e:
            return Malformed(message.DESCRIPTOR.name, e, api)

    return parse


def add_to_server(service: TranscriberService, server: grpc.aio.Server) -> None:
    """Register `service` as echoic.v1.Transcriber, with messages that do not parse handed
    to it (as `Malformed`) rather than failed inside grpc."""
    handlers = {
        "Recognize": grpc.unary_unary_rpc_method_handler(
            service.Recognize,
            request_deserializer=lenient(pb.RecognizeRequest),
            response_serializer=pb.RecognizeResponse.SerializeToString,
        ),
        "StreamingRecognize": grpc.stream_stream_rpc_method_handler(
            service.StreamingRecognize,
            request_deserializer=lenient(pb.StreamingRecognizeRequest),
            response_serializer=pb.StreamingRecognizeResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels,
            request_deserializer=lenient(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
    }
    name = pb.DESCRIPTOR.services_by_name["Transcriber"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


class TranscriberService(pb_grpc.TranscriberServicer):
    def __init__(
        self,
        config: ServerConfig,
        registry: ModelRegistry,
        metrics: Metrics,
        audio_pool: Executor,
    ) -> None:
        self._config = config
        self._registry = registry
        self._metrics = metrics
        # Whole files and buffered streams are decoded here (--decode-threads), not in the
        # loop's default executor, which everything else shares: slow or hostile audio
        # waits for other audio, never holds up the rest of the server.
        self._audio_pool = audio_pool
        self.active = 0  # admitted StreamingRecognize and Recognize calls, count
        self.draining = False  # shutting down: new calls get UNAVAILABLE
        self._ending = asyncio.Event()  # set: open streams end now, with their final results
        self._warn_malformed = RateLimitedWarning(10.0)

    async def ending(self) -> None:
        """Returns once open streams are to end with their final results (the end of a
        shutdown's grace period): for doors with streams of their own to end."""
        await self._ending.wait()

    def end_open_streams(self) -> None:
        """Every open stream stops reading, sends its final results for the audio it has,
        and ends with OK (the end of a shutdown's grace period)."""
        self._ending.set()

    # ------------------------------------------------------------------ rpcs

    async def Recognize(
        self, request: pb.RecognizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecognizeResponse:
        return await self._guard("Recognize", context, lambda: self._recognize(request))

    async def StreamingRecognize(self, request_iterator: Any, context: grpc.aio.ServicerContext):
        await self._guard("StreamingRecognize", context, lambda: self._stream(context))

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return await self._guard(
            "ListModels", context, lambda: self._list_models(request), admit=False
        )

    # ------------------------------------------------------------------ other doors

    async def recognize_for(
        self,
        method: str,
        translate: Callable[[], pb.RecognizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> pb.RecognizeResponse:
        """Recognize for a door whose request `translate` turns into echoic's (the Riva
        API; its errors are answered as echoic's): the same admission, limits and path;
        `method` labels its metrics."""
        return await self._guard(method, context, lambda: self._recognize(translate()))

    async def stream_for(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """StreamingRecognize for a door whose `context` reads and writes echoic's messages
        (translating its own); as `recognize_for`."""
        await self._guard(method, context, lambda: self._stream(context))

    # ------------------------------------------------------------------ bodies

    async def _recognize(self, request: pb.RecognizeRequest) -> pb.RecognizeResponse:
        if isinstance(request, Malformed):
            raise request.problem()
        opts = parse_config(request.config, max_beam=self._config.max_beam_size)
        if not request.audio_content:
            raise invalid("audio_content is empty: send the whole audio in the request")
        whole = await self.recognize_whole(opts, request.audio_content, "Recognize")
        return pb.RecognizeResponse(
            results=[result_proto(r) for r in whole.results],
            audio_processed_seconds=whole.seconds,
            model=_ref(whole.model),
        )

    async def recognize_whole(
        self, opts: Options, audio: bytes, method: str, *, name: str = "audio_content"
    ) -> Whole:
        """All of `audio` (a file's bytes) recognized as Recognize does, for any door:
        the model resolved from `opts`, the final results, the audio's length.
        `method` labels the final-result latency metric; `name` is the audio's name in
        error messages."""
        async with open_session(
            self._registry, opts, self._config, name=name, whole=True
        ) as session:
            if session.stream is None:  # a model that cannot stream: the utterance whole
                await self.off_loop(self._decode_whole, session, audio)
                results = []
            else:
                results = await self._recognize_windows(session, audio)
            ended = time.perf_counter()
            results += await session.advance()
            self._metrics.final_latency.labels(method).observe(time.perf_counter() - ended)
            return Whole(results, session.seconds, session.model)

    async def _recognize_windows(self, session: Session, audio: bytes) -> list[Result]:
        """A whole file through its stream WHOLE_WINDOW_SECONDS at a time, each window
        decoded and its features computed in the audio pool, and its steps run, before the
        next is decoded. So the samples, the features (and the STFT's complex intermediates,
        16 bytes a bin) are a window's, not the file's: a 12.6-minute WAV took the server
        from 138 MB to 997 MB when they were the file's, a 60-minute Ogg to 4.2 GB
        (bench/whole_file_memory.py). The stream and its results are the same as the file
        fed at once."""
        window = int(WHOLE_WINDOW_SECONDS * session.model.card.sample_rate)
        windows = self._windows(session, audio, window)
        results: list[Result] = []
        while await self.off_loop(self._accept_window, session, windows):
            results += await session.advance()
        await self.off_loop(partial(session.finish, features_now=True))
        return results

    def _accept_window(self, session: Session, windows: Iterator[np.ndarray]) -> bool:
        """In the audio pool: a whole file's next window decoded and accepted, with its
        features, so that the batch it joins is not held up by them; False at the end."""
        samples = next(windows, None)
        if samples is None:
            return False
        self._accept(session, samples)
        session.stream.compute_features()
        return True

    def _windows(self, session: Session, audio: bytes, window: int) -> Iterator[np.ndarray]:
        """A whole file's samples `window` at a time (the last one shorter), each decoded
        when it is asked for (`AudioInput.whole_blocks`), with Recognize's refusals. Each
        window's decoding may run in another thread of the audio pool, one after another.
        A request that ends early drops the generator, which closes its decoder: not
        closed here, since a cancelled request's last window may still be decoding."""
        with _whole_audio_refusals():
            parts: list[np.ndarray] = []  # blocks not yet in a window, joined once one is full
            held = 0
            for block in session.audio.whole_blocks(audio):
                parts.append(block)
                held += len(block)
                if held >= window:
                    joined = np.concatenate(parts)
                    full = len(joined) // window * window
                    for start in range(0, full, window):
                        yield joined[start : start + window]
                    parts, held = [joined[full:]], len(joined) - full
            if held:
                yield np.concatenate(parts)

    async def recognize_paced(
        self,
        opts: Options,
        audio: bytes,
        method: str,
        *,
        name: str = "audio_content",
        step_seconds: float = 0.5,
    ) -> AsyncIterator[list[Result]]:
        """All of `audio` (a file's bytes) as a live stream, for a door that shows results
        as they firm up: decoded a window at a time (in the audio pool, as Recognize's),
        each window fed `step_seconds` at a time through the batched streaming path; yields
        each step's results (interim ones as `opts` asks), the last with the final result.
        The finals are Recognize's (the same stream). A model that streams only by
        overlapped chunks (an imported one) runs the file whole, as Recognize does: no
        interim results, and the final one is Recognize's."""
        async with open_session(
            self._registry, opts, self._config, name=name, whole=None
        ) as session:
            step = max(1, int(step_seconds * session.model.card.sample_rate))
            if session.model.streams_exactly:
                # whole steps to a window, so the steps are those of the samples fed at once
                window = step * max(1, round(WHOLE_WINDOW_SECONDS / step_seconds))
                windows = self._windows(session, audio, window)
            else:  # run whole
                self._accept(session, await self.off_loop(self._decode_all, session, audio))
                windows = iter(())
            while (samples := await self.off_loop(next, windows, None)) is not None:
                for start in range(0, len(samples), step):
                    self._accept(session, samples[start : start + step])
                    yield await session.advance()
            session.finish()
            ended = time.perf_counter()
            yield await session.advance()
            self._metrics.final_latency.labels(method).observe(time.perf_counter() - ended)

    def _decode_whole(self, session: Session, data: bytes) -> None:
        """In a worker thread: decode all the audio, feed it and finish the stream (a model
        that cannot stream: the utterance's samples are all needed at once)."""
        self._accept(session, self._decode_all(session, data))
        session.finish(features_now=True)  # here, in this worker thread, not in the batch

    def _decode_all(self, session: Session, data: bytes) -> np.ndarray:
        with _whole_audio_refusals():
            return session.audio.decode_whole(data)

    async def off_loop(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` on a client's bytes (decoding, parsing), in the audio pool."""
        return await asyncio.get_running_loop().run_in_executor(self._audio_pool, call, *args)

    async def _stream(self, context: grpc.aio.ServicerContext) -> None:
        ending = asyncio.ensure_future(self._ending.wait())  # done: end with final results
        try:
            await self._stream_until(context, ending)
        finally:
            ending.cancel()

    async def _stream_until(self, context: grpc.aio.ServicerContext, ending: asyncio.Future):
        limit = self._config.max_stream_seconds
        closes_at = time.monotonic() + limit if limit else None  # the stream's wall-time limit
        first = await self._read(context, closes_at, ending)
        if first is grpc.aio.EOF and ending.done():
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                "the server is shutting down: retry the stream on another replica",
            )
        if first is grpc.aio.EOF:
            raise invalid(
                "the stream ended before its config: send a StreamingRecognizeRequest with "
                "streaming_config first, then audio_content"
            )
        if first.WhichOneof("streaming_request") != "streaming_config":
            raise invalid(
                "the first StreamingRecognizeRequest must carry streaming_config, not audio: "
                "send the config first, then audio_content"
            )
        sc = first.streaming_config
        opts = parse_config(
            sc.config,
            max_beam=self._config.max_beam_size,
            interim=sc.interim_results,
            interval_ms=sc.interim_interval_ms,
        )
        async with open_session(
            self._registry, opts, self._config, name="audio_content", live=True
        ) as session:
            ref = _ref(session.model)
            while True:
                message = await self._read(context, closes_at, ending)
                if message is grpc.aio.EOF:
                    if context.cancelled():
                        raise ClientGone
                    await self.finish_stream(session)
                    ended = time.perf_counter()
                else:
                    kind = message.WhichOneof("streaming_request")
                    if kind == "streaming_config":
                        raise invalid(
                            "streaming_config was sent twice: send it only in the first "
                            "message, then only audio_content"
                        )
                    self.feed_stream(session, message.audio_content)
                for result in await session.advance():
                    response = pb.StreamingRecognizeResponse(
                        results=[result_proto(result)],
                        audio_processed_seconds=session.decoded_seconds,
                        model=ref,
                    )
                    try:
                        await context.write(response)
                    except Exception as e:  # noqa: BLE001 - grpc raises its internal error type
                        # A call that cannot be written to is over: cancelled, past its
                        # deadline or disconnected (a cancel can reach us as a plain EOF).
                        raise ClientGone from e
                if message is grpc.aio.EOF:
                    latency = time.perf_counter() - ended
                    self._metrics.final_latency.labels("StreamingRecognize").observe(latency)
                    return

    def feed_stream(self, session: Session, data: bytes) -> None:
        """A live stream's next bytes, decoded and accepted under the stream limits (any
        door): OUT_OF_RANGE past --max-audio-seconds, or past max_message_bytes of
        audio buffered until its end (MP3) or not yet decoded (FLAC, Ogg)."""
        self._accept(session, self._stream_audio(partial(session.audio.feed, data)))
        self._check_stream_limits(session)

    async def finish_stream(self, session: Session) -> None:
        """A live stream's audio has ended: the rest decoded (buffered audio: off the
        loop, in a worker thread) and the stream finished."""
        finish = partial(self._stream_audio, session.audio.finish)
        self._accept(session, await self.off_loop(finish))
        session.finish()

    @staticmethod
    def _stream_audio(read: Callable[[], np.ndarray]) -> np.ndarray:
        """A stream's next samples from its AudioInput; over the length limit is OUT_OF_RANGE."""
        try:
            return read()
        except AudioTooLong as e:
            raise Refusal(
                RefusalKind.TOO_LARGE,
                f"the stream went over this server's limit of {e.limit:g} s of audio: "
                "close it and open a new stream for the rest",
            ) from None
        except DecodeTooSlow as e:
            raise _too_slow(e) from None

    def _check_stream_limits(self, session: Session) -> None:
        waiting = session.audio.undecoded_bytes
        if waiting > self._config.max_message_bytes:
            raise Refusal(
                RefusalKind.TOO_LARGE,
                f"{waiting} bytes of audio are buffered (MP3 is decoded at the end), or of "
                f"FLAC or Ogg not yet decoded, over this server's "
                f"{self._config.max_message_bytes} bytes: stream FLAC or Ogg at the pace of "
                "its audio, or WAV or LINEAR16",
            )

    def _accept(self, session: Session, samples: np.ndarray) -> None:
        session.accept(samples)
        if len(samples):
            m = session.model
            seconds = len(samples) / m.card.sample_rate
            self._metrics.audio_seconds.labels(m.name, m.version).inc(seconds)

    async def _read(
        self, context: grpc.aio.ServicerContext, closes_at: float | None, ending: asyncio.Future
    ) -> Any:
        """The stream's next message, or EOF once `ending` (the server's end of open streams)
        is done; DEADLINE_EXCEEDED when it sends nothing for the idle timeout, or when its
        wall time (`closes_at`, time.monotonic()) runs out."""
        idle = self._config.idle_timeout_seconds
        timeout = idle if closes_at is None else min(idle, closes_at - time.monotonic())
        if ending.done():
            return grpc.aio.EOF  # the server is stopping: end as if the audio had ended
        # One timer per message, which `ending` moves to now: a read costs no task of its own
        # (asyncio.wait on a read task and `ending` cost twice the time, per audio message).
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(timeout, 0.0)) as deadline:

                def now(_: asyncio.Future) -> None:
                    # already run when the read ended in the same turn: nothing to move
                    with contextlib.suppress(RuntimeError):
                        deadline.reschedule(loop.time())

                ending.add_done_callback(now)
                try:
                    message = await context.read()
                finally:
                    ending.remove_done_callback(now)
        except TimeoutError:
            if ending.done():
                return grpc.aio.EOF
            if closes_at is not None and time.monotonic() >= closes_at:
                raise RequestError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the stream was open for this server's limit of "
                    f"{self._config.max_stream_seconds:g} s (--max-stream-seconds): send audio "
                    "at least as fast as real time, and open a new stream for more",
                ) from None
            raise RequestError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the stream sent nothing for {idle:g} s: send audio at least that often "
                "(silence included), or half-close the stream when the audio ends",
            ) from None
        if isinstance(message, Malformed):
            raise message.problem()
        return message

    async def _list_models(self, request: pb.ListModelsRequest) -> pb.ListModelsResponse:
        if isinstance(request, Malformed):
            raise request.problem()
        models = sorted(self._registry.loaded, key=lambda m: (m.name, version_key(m.version)))
        expose = self._config.expose_paths
        return pb.ListModelsResponse(
            models=[_info(m, expose_path=expose) for m in models], server_version=echoic_version()
        )

    # ------------------------------------------------------------------ errors and accounting

    async def _guard(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        body: Callable[[], Awaitable[T]],
        *,
        admit: bool = True,
    ) -> T:
        code = grpc.StatusCode.OK
        try:
            self.refuse_if_draining()
            with self.admitted(method) if admit else nullcontext():
                return await body()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except ClientGone:
            code = grpc.StatusCode.CANCELLED
            return None  # nobody is listening for a status
        except Exception as e:  # noqa: BLE001 - every error becomes a status code here
            code, message = status_of(e)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            elif isinstance(e, MalformedRequest):
                self._warn_malformed("%s from %s: %s", method, context.peer(), message)
            await context.abort(code, message)
            raise  # not reached: abort() raises
        finally:
            self._metrics.requests.labels(method, code.name).inc()

    # ------------------------------------------------------------------ admission, for every door

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise Refusal(
                RefusalKind.UNAVAILABLE,
                "the server is shutting down: retry the call on another replica",
            )

    @contextmanager
    def admitted(self, method: str) -> Iterator[None]:
        """One call counted against `max_streams` (and in echoic_active_streams{method})
        while it runs: UNAVAILABLE while draining, RESOURCE_EXHAUSTED at the limit."""
        self.refuse_if_draining()
        if self.active >= self._config.max_streams:
            raise Refusal(
                RefusalKind.BUSY,
                f"the server is at its limit of {self._config.max_streams} concurrent "
                "streams and requests: retry later with backoff, or use another replica",
            )
        self.active += 1
        self._metrics.active_streams.labels(method).inc()
        try:
            yield
        finally:
            self.active -= 1
            self._metrics.active_streams.labels(method).dec()


@contextmanager
def _whole_audio_refusals() -> Iterator[None]:
    """A whole file's audio errors in Recognize's words: too long is INVALID_ARGUMENT (split
    it, or stream it), too slow to decode DEADLINE_EXCEEDED."""
    try:
        yield
    except AudioTooLong as e:
        raise invalid(
            f"the audio is {e.length} but this server accepts at most {e.limit:g} s per request",
            remedy=Remedy.SPLIT_AUDIO,
        ) from None
    except DecodeTooSlow as e:
        raise _too_slow(e) from None


def _too_slow(e: DecodeTooSlow) -> Refusal:
    return Refusal(
        RefusalKind.TIMED_OUT,
        f"decoding the audio took over this server's limit of {e.limit:g} s "
        "(--decode-timeout-seconds): send shorter audio, or WAV or FLAC, which decode fastest",
    )


def status_of(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code an error becomes at the gRPC doors, and its message in their words
    (cut to server/core/refusals.py's MAX_DETAILS)."""
    refusal = refusal_of(e)
    code = refusal.code if isinstance(refusal, RequestError) else GRPC_STATUS[refusal.kind]
    return code, door_message(refusal, GRPC_REMEDIES)


def _ref(model: LoadedModel) -> pb.ModelRef:
    return pb.ModelRef(name=model.name, version=model.version)


def _chunk_seconds(model: LoadedModel) -> tuple[float, float]:
    """(chunk, lookahead) of a streaming step, s: stream.onnx's, or overlapped chunks'."""
    frame = model.card.output_frame_ms / 1000.0
    if model.streams_exactly:
        return model.card.chunk_frames * frame, model.card.context_frames * frame
    if model.streamable:
        chunk, _, right = model.greedy.chunking.frames(model.card)
        return chunk * frame, right * frame
    return 0.0, 0.0


def _info(model: LoadedModel, *, expose_path: bool) -> pb.ModelInfo:
    """What ListModels tells of a version; its directory only when the server is told to."""
    card = model.card
    frame = card.output_frame_ms / 1000.0
    return pb.ModelInfo(
        name=model.name,
        version=model.version,
        state=_STATES[model.state],
        sample_rate_hertz=card.sample_rate,
        streamable=model.streamable,
        vocabulary_size=len(card.vocabulary),
        frame_seconds=frame,
        chunk_seconds=_chunk_seconds(model)[0],
        lookahead_seconds=_chunk_seconds(model)[1],
        has_language_model=model.has_lm,
        active_streams=model.active,
        path=str(model.path) if expose_path else "",
        rnn_type=card.rnn_type,
        bidirectional=card.bidirectional,
        parameters=card.parameters,
    )
