"""Live transcription over a WebSocket, in OpenAI's Realtime transcription protocol as
NVIDIA Riva's `riva.client.realtime.RealtimeClientASR` speaks it (part of the HTTP door).

    POST /v1/realtime/transcription_sessions   mint a session: its defaults and a
                                               client secret (`client_secret.value`)
    GET  /v1/realtime?intent=transcription     the WebSocket; subprotocol `realtime`,
                                               with `realtime-token.<secret>` beside it

Server -> client: `conversation.created` on connect; `transcription_session.updated`;
`input_audio_buffer.committed`; `conversation.item.input_audio_transcription.delta`
(the words that firmed up, as `transcript.text.delta` does over HTTP) and `.completed`
(one per utterance: `transcript`, `words_info.words` with times in ms,
`is_last_result` on the last one, after `input_audio_buffer.done`); `error`.

Client -> server: `transcription_session.update` (`input_audio_format` "pcm16" =
raw PCM16 at `input_audio_params.sample_rate_hz`/`num_channels`; "g711_ulaw" or
"g711_alaw" = raw G.711 at 8 kHz, as OpenAI's protocol defines them (telephony);
or "none" = the bytes of a file with its header: WAV, FLAC and Ogg stream, MP3 is
decoded at the end;
`input_audio_transcription.model`/`language`; `recognition_config.enable_word_time_offsets`;
`recognition_config.decoder` ("greedy" or "beam"; absent: the server's default, `echoic
serve --decoder`); `enable_automatic_punctuation` (default on where the server has its
tagger) and `enable_verbatim_transcripts` (default off: numbers, money, times in written
form), as Riva's realtime client sends them: they shape `.completed` transcripts, while
deltas stay the words as spoken (joined, the spoken words of all utterances), since they
show progress and `.completed` replaces them;
`endpointing_config.stop_history` = ms of trailing silence that ends an utterance),
then `input_audio_buffer.append` (base64 audio), `.commit` and `.done`.

A socket is one stream of the shared engine: admitted by the gRPC service's count
(`--max-streams`, refused while draining), its audio through `AudioInput` and
`Session` like StreamingRecognize's, so its final transcripts are StreamingRecognize's.
A client mistake (JSON that does not parse, audio before the update, audio after
`.done`, a bad field) is answered with an `error` event, counted in
echoic_realtime_errors_total{code} and logged (rate-limited); the socket stays open.
An error of the stream itself (audio that cannot be decoded, over a limit) is fatal, as
it ends a StreamingRecognize: its `error` event, then the socket closes (1008). So does
a socket silent for --idle-timeout-seconds, or open for --max-stream-seconds.

An update takes only the settings above: other keys are ignored (neither stored nor
echoed), values must be scalars, and a message other than an append is at most
MAX_CONTROL_BYTES; a message over PARSE_ON_LOOP_BYTES is parsed off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
import time
import uuid
from typing import Any

from aiohttp import WSMsgType, web

from echoic.server.config import ServerConfig
from echoic.server.core.formatting import Formatter, format_finals, formatter_of
from echoic.server.core.models import ModelRegistry
from echoic.server.core.options import stream_options
from echoic.server.core.session import Session, open_session
from echoic.server.core.types import Result
from echoic.server.doors.openai_api import (
    DECODERS,
    ENDPOINTING,
    OPENAI_MODELS,
    ApiError,
    TextDeltas,
    api_error,
    default_formatter_available,
)
from echoic.server.doors.service import RateLimitedWarning, TranscriberService
from echoic.server.metrics import HTTP_REALTIME, Metrics

log = logging.getLogger("echoic.server")

SUBPROTOCOL = "realtime"
TOKEN_PREFIX = "realtime-token."
SECRET_SECONDS = 600  # s a minted client secret stays valid for opening a socket
MAX_SECRETS = 10_000  # minted secrets remembered at once, count (the oldest go first)
G711_RATE = 8000  # Hz of g711_ulaw and g711_alaw, fixed by OpenAI's protocol
MAX_CONTROL_BYTES = 64 * 1024  # bytes of a message that is not input_audio_buffer.append
PARSE_ON_LOOP_BYTES = 64 * 1024  # bytes of JSON parsed on the event loop; more in a thread
MAX_INT = 2**31 - 1  # the largest integer setting (they become int32 config fields)
# Settings an update may give that have no default to show: echoed only once given
# (recognition_config.decoder absent means the server's default, `echoic serve --decoder`).
_UNSET_KEYS = {"recognition_config": {"decoder"}}
_ENCODINGS = {  # input_audio_format -> the encoding it is (`Options.encoding`)
    "pcm16": "linear16",
    "g711_ulaw": "mulaw",
    "g711_alaw": "alaw",
    "none": "auto",
}


class ClientMistake(Exception):
    """Something a client sent wrong on the socket: an `error` event, and the socket goes on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class StreamFailed(Exception):
    """The stream's audio failed (`cause`): an `error` event, then the socket closes."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"event_id": f"event_{uuid.uuid4().hex}", "type": kind, **fields}


class RealtimeDoor:
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
        self._secrets: dict[str, float] = {}  # client secret -> when it expires (time.time())
        self._warn = RateLimitedWarning(10.0)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/realtime/transcription_sessions", self.mint)
        router.add_get("/v1/realtime", self.socket)

    # ------------------------------------------------------------------ minting

    def _defaults(self) -> dict[str, Any]:
        """A session's settings before any update (what the mint answers)."""
        return {
            "object": "realtime.transcription_session",
            "modalities": ["text"],
            "input_audio_format": "pcm16",
            "input_audio_params": {"sample_rate_hz": 16000, "num_channels": 1},
            "input_audio_transcription": {"model": "", "language": "en-US", "prompt": ""},
            "recognition_config": {
                "max_alternatives": 1,
                "enable_word_time_offsets": False,
                # Final transcripts are written as people write them when this server
                # can (docs/formatting.md); the deltas stay the words as spoken.
                "enable_automatic_punctuation": default_formatter_available(),
                "enable_verbatim_transcripts": False,
            },  # fmt: skip
            "endpointing_config": {"stop_history": ENDPOINTING.trailing_silence_ms},
        }

    async def mint(self, request: web.Request) -> web.Response:
        now = time.time()
        for secret in [s for s, expires in self._secrets.items() if expires < now]:
            del self._secrets[secret]
        while len(self._secrets) >= MAX_SECRETS:
            del self._secrets[next(iter(self._secrets))]
        secret = secrets.token_urlsafe(24)
        self._secrets[secret] = now + SECRET_SECONDS
        session = {
            "id": f"sess_{uuid.uuid4().hex}", **self._defaults(),
            "client_secret": {"value": secret, "expires_at": int(now + SECRET_SECONDS)},
        }  # fmt: skip
        return web.json_response(session)

    def _check_token(self, request: web.Request) -> None:
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        tokens = [p[len(TOKEN_PREFIX) :] for p in offered if p.startswith(TOKEN_PREFIX)]
        for token in tokens:
            if self._secrets.get(token, 0.0) < time.time():
                raise ApiError(
                    401,
                    "the realtime-token is not one this server minted, or it has expired: "
                    "POST /v1/realtime/transcription_sessions for a new client secret",
                    code="invalid_client_secret",
                )  # fmt: skip

    # ------------------------------------------------------------------ the socket

    async def socket(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("intent", "transcription") != "transcription":
            raise ApiError(
                400, "this server transcribes only: connect with ?intent=transcription",
                param="intent",
            )  # fmt: skip
        self._check_token(request)
        with self._service.admitted(HTTP_REALTIME):
            ws = web.WebSocketResponse(
                protocols=(SUBPROTOCOL,), max_msg_size=self._config.max_message_bytes
            )
            await ws.prepare(request)
            await RealtimeSession(self, ws, request.remote or "").run()
            return ws

    def mistake(self, code: str, message: str, peer: str) -> dict[str, Any]:
        self._metrics.realtime_errors.labels(code).inc()
        self._warn("realtime error %s from %s: %s", code, peer, message)
        return _event("error", error={"type": "invalid_request_error", "code": code,
                                      "message": message, "param": None})  # fmt: skip


class RealtimeSession:
    """One WebSocket: its settings, its stream, the events it has sent."""

    def __init__(self, door: RealtimeDoor, ws: web.WebSocketResponse, peer: str) -> None:
        self.door = door
        self.ws = ws
        self.peer = peer
        self.settings = door._defaults()
        self.session: Session | None = None
        self._opened: contextlib.AsyncExitStack | None = None  # closes `session` (open_session)
        self.deltas = TextDeltas()
        self.formatter: Formatter | None = None  # how `.completed` transcripts are written
        self.done = False  # input_audio_buffer.done has been handled

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(event))

    async def run(self) -> None:
        config = self.door._config
        model = None
        conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "realtime.conversation"}
        await self.send(_event("conversation.created", conversation=conversation))
        ending = asyncio.ensure_future(self.door._service.ending())
        limit = config.max_stream_seconds
        closes_at = time.monotonic() + limit if limit else None  # --max-stream-seconds
        try:
            while True:
                idle = config.idle_timeout_seconds
                wait = idle if closes_at is None else min(idle, closes_at - time.monotonic())
                receive = asyncio.ensure_future(self.ws.receive())
                done, _ = await asyncio.wait(
                    (receive, ending), timeout=max(wait, 0.0), return_when=asyncio.FIRST_COMPLETED
                )
                if receive not in done:
                    receive.cancel()
                    if ending in done:  # the shutdown's grace is over: end with the results
                        await self._end_now()
                        return
                    if closes_at is not None and time.monotonic() >= closes_at:
                        await self._close_with(self.door.mistake(
                            "max_stream_seconds",
                            f"the socket was open for this server's limit of {limit:g} s "
                            "(--max-stream-seconds): open a new socket for more audio",
                            self.peer,
                        ))  # fmt: skip
                        return
                    raise TimeoutError
                message = receive.result()
                if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    return
                if message.type == WSMsgType.ERROR:
                    return
                try:
                    if message.type != WSMsgType.TEXT:
                        raise ClientMistake(
                            "invalid_event", "send events as JSON text messages, not binary"
                        )
                    event = await self._parse(message.data)
                    model = await self.handle(event, model)
                except ClientMistake as e:
                    await self.send(self.door.mistake(e.code, str(e), self.peer))
                except StreamFailed as e:  # as a StreamingRecognize ends: the socket closes
                    await self._close_with(self._error_event(e.cause))
                    return
                except Exception as e:  # noqa: BLE001 - an error event, never a traceback
                    await self.send(self._error_event(e))
        except ConnectionError:
            return  # the client went away
        except TimeoutError:
            idle = config.idle_timeout_seconds
            await self._close_with(self.door.mistake(
                "idle_timeout", f"nothing arrived for {idle:g} s: the socket is closed", self.peer
            ))  # fmt: skip
        finally:
            ending.cancel()
            if self._opened is not None:  # a FLAC or Ogg decoder's threads end with the socket
                await self._opened.aclose()

    def _error_event(self, e: Exception) -> dict[str, Any]:
        error = api_error(e)
        if error.status == 500:
            log.exception("realtime session failed")
        code = error.code or "invalid_request_error"
        return self.door.mistake(code, error.message, self.peer)

    async def _close_with(self, event: dict[str, Any]) -> None:
        """A fatal error: its event, then the socket closes (1008, policy violation)."""
        await self.send(event)
        await self.ws.close(code=1008, message=event["error"]["code"].encode()[:120])

    async def _parse(self, text: str) -> dict[str, Any]:
        """The event a text message holds; a big one is parsed off the event loop, and only
        an audio append may be bigger than MAX_CONTROL_BYTES."""
        if len(text) <= PARSE_ON_LOOP_BYTES:
            return _parse(text)
        event = await self.door._service.off_loop(_parse, text)
        if event["type"] != "input_audio_buffer.append" and len(text) > MAX_CONTROL_BYTES:
            raise ClientMistake(
                "message_too_large",
                f"a {event['type']} message of {len(text)} bytes: only "
                f"input_audio_buffer.append may be over {MAX_CONTROL_BYTES} bytes",
            )
        return event

    async def _end_now(self) -> None:
        """The server is stopping: the audio so far gets its final results (the last with
        is_last_result), and the socket closes with 1001 (going away)."""
        if self.session is not None and not self.done:
            self.done = True
            await self.door._service.finish_stream(self.session)
            await self._send_results(await self.session.advance(), last=True)
        await self.ws.close(code=1001, message=b"the server is shutting down")

    async def handle(self, event: dict[str, Any], model: Any) -> Any:
        """One client event; returns the model the socket's session is on."""
        kind = event.get("type")
        if kind == "transcription_session.update":
            if self.session is not None and (self.session.samples or self.session.audio.bytes_in):
                raise ClientMistake(
                    "session_already_started",
                    "the audio has begun: settings change only before the first "
                    "input_audio_buffer.append (open a new socket for other settings)",
                )
            if self.done:
                raise self._finished()
            update = event.get("session")
            if not isinstance(update, dict):
                raise ClientMistake(
                    "invalid_event", "transcription_session.update needs a session object"
                )
            model = await self._configure(update, model)
            await self.send(_event("transcription_session.updated", session=self.settings))
        elif kind == "input_audio_buffer.append":
            if self.done:
                raise self._finished()
            if self.session is None:
                raise ClientMistake(
                    "session_not_configured",
                    "audio before transcription_session.update: send the update (audio format, "
                    "rate) first, then input_audio_buffer.append",
                )
            audio = event.get("audio")
            try:
                data = base64.b64decode(audio or "", validate=True)
            except (binascii.Error, TypeError, ValueError):
                raise ClientMistake("invalid_audio", "`audio` must be base64 audio bytes") from None
            try:
                self.door._service.feed_stream(self.session, data)
                results = await self.session.advance()
            except Exception as e:  # noqa: BLE001 - the stream is over, whatever failed
                raise StreamFailed(e) from e
            await self._send_results(results, last=False)
        elif kind == "input_audio_buffer.commit":
            await self.send(_event("input_audio_buffer.committed", item_id=self._item_id()))
        elif kind == "input_audio_buffer.done":
            if self.done:
                raise self._finished()
            if self.session is None:
                raise ClientMistake(
                    "session_not_configured",
                    "input_audio_buffer.done before transcription_session.update and any audio",
                )
            self.done = True
            try:
                await self.door._service.finish_stream(self.session)
                ended = time.perf_counter()
                results = await self.session.advance()
            except Exception as e:  # noqa: BLE001 - the stream is over, whatever failed
                raise StreamFailed(e) from e
            await self._send_results(results, last=True)
            latency = time.perf_counter() - ended
            self.door._metrics.final_latency.labels(HTTP_REALTIME).observe(latency)
        elif kind in ("input_audio_buffer.clear", "session.update"):
            raise ClientMistake("unsupported_event", f"{kind} is not supported by this server")
        else:
            raise ClientMistake(
                "invalid_event",
                f"unknown event type {kind!r}: send transcription_session.update, "
                "input_audio_buffer.append, input_audio_buffer.commit or input_audio_buffer.done",
            )
        return model

    def _finished(self) -> ClientMistake:
        return ClientMistake(
            "session_done",
            "this session's audio has ended (input_audio_buffer.done): open a new socket "
            "for another session",
        )

    def _item_id(self) -> str:
        index = self.session.stream.utterance_index if self.session and self.session.stream else 0
        return f"item_{index}"

    async def _configure(self, update: dict[str, Any], model: Any) -> Any:
        settings = json.loads(json.dumps(self.settings))  # a deep copy
        # Only the settings this server reads are taken (others, such as a client's
        # turn_detection, are ignored: never stored, never echoed); each must be a scalar.
        if "input_audio_format" in update:
            settings["input_audio_format"] = _scalar(update, "input_audio_format")
        for section in ("input_audio_params", "input_audio_transcription", "recognition_config",
                        "endpointing_config"):  # fmt: skip
            given = update.get(section)
            if isinstance(given, dict):
                accepted = settings[section].keys() | _UNSET_KEYS.get(section, set())
                for key in accepted & given.keys():
                    settings[section][key] = _scalar(given, key, section)
        if settings["recognition_config"].get("decoder") is None:  # null: back to the default
            settings["recognition_config"].pop("decoder", None)
        fmt = settings["input_audio_format"]
        if not isinstance(fmt, str) or fmt not in _ENCODINGS:
            raise ClientMistake(
                "invalid_audio_format",
                f"input_audio_format {fmt!r} is not served: use pcm16 (raw PCM16 at "
                "input_audio_params.sample_rate_hz), g711_ulaw or g711_alaw (raw G.711 at "
                "8 kHz), or none (a WAV, FLAC, Ogg or MP3 file's bytes)",
            )
        params = settings["input_audio_params"]
        if fmt.startswith("g711"):
            given = update.get("input_audio_params")
            asked = given.get("sample_rate_hz") if isinstance(given, dict) else None
            if asked is not None and str(asked) != str(G711_RATE):
                raise ClientMistake(
                    "invalid_value",
                    f"{fmt} is 8 kHz audio, as OpenAI's protocol defines it, not {asked!r} Hz: "
                    f"leave input_audio_params.sample_rate_hz out, or send {G711_RATE}",
                )
            params["sample_rate_hz"] = G711_RATE  # the session echoed back says so
        asr = settings["input_audio_transcription"]
        language = str(asr.get("language") or "en").lower()
        if language != "en" and not language.startswith("en-"):
            raise ClientMistake(
                "unsupported_language",
                f"language {language!r} is not served: these models transcribe English",
            )
        name = str(asr.get("model") or "")
        silence = settings["endpointing_config"].get(
            "stop_history", ENDPOINTING.trailing_silence_ms
        )
        try:
            rate, channels = (
                int(params.get("sample_rate_hz") or 0),
                int(params.get("num_channels") or 1),
            )
            silence = int(silence)
        except (TypeError, ValueError, OverflowError):
            raise ClientMistake(
                "invalid_value", "sample_rate_hz, num_channels and stop_history are integers"
            ) from None
        if not all(0 <= n <= MAX_INT for n in (rate, channels, silence)):
            raise ClientMistake(
                "invalid_value",
                f"sample_rate_hz, num_channels and stop_history are integers in 0-{MAX_INT}",
            )
        recognition = settings["recognition_config"]
        words = bool(recognition.get("enable_word_time_offsets"))
        decoder = recognition.get("decoder")
        if decoder is not None and decoder not in DECODERS:
            raise ClientMistake(
                "invalid_value",
                f"recognition_config.decoder {str(decoder)[:40]!r} is not one of "
                f"{', '.join(DECODERS)} (leave it out for the server's default)",
            )
        raw = fmt != "none"  # no header: the rate and channels come from the session
        service, registry = self.door._service, self.door._registry
        opts = stream_options(
            max_beam=self.door._config.max_beam_size,
            encoding=_ENCODINGS[fmt],
            sample_rate=(rate or None) if raw else None,
            channels=(channels or 1) if raw else 1,
            model="" if name in OPENAI_MODELS else name,
            words=words,
            decoder=decoder,
            trailing_silence_ms=silence,
            max_utterance_ms=ENDPOINTING.max_utterance_ms,
            interim=True,
        )
        # Formatted here rather than by the Session: the deltas need the spoken words of
        # every result, the final's included; `.completed` gets the written form.
        formatter = formatter_of(
            bool(recognition.get("enable_automatic_punctuation")),
            not recognition.get("enable_verbatim_transcripts"),
        )
        chosen = registry.resolve(opts.model, opts.version)
        if not chosen.streamable:
            raise ClientMistake("model_not_streamable", f"model {chosen.name!r} cannot stream")
        opened = contextlib.AsyncExitStack()
        self.session = await opened.enter_async_context(
            open_session(registry, opts, service._config, name="audio", live=True)
        )
        if self._opened is not None:  # the settings' earlier session: closed, released
            await self._opened.aclose()
        self._opened = opened
        asr["model"] = chosen.name
        self.settings = settings
        self.formatter = formatter
        return chosen

    async def _send_results(self, results: list[Result], *, last: bool) -> None:
        finals = [r for r in results if r.is_final]
        for r in results:
            index = f"item_{r.utterance_index}"
            for delta in self.deltas.add([r]):
                await self.send(_event(
                    "conversation.item.input_audio_transcription.delta",
                    item_id=index, content_index=0, delta=delta,
                ))  # fmt: skip
            if r.is_final:
                best = (await self._formatted(r)).alternatives[0]
                await self.send(_event(
                    "conversation.item.input_audio_transcription.completed",
                    item_id=index, content_index=0, transcript=best.text,
                    is_last_result=last and r is finals[-1],
                    words_info={"words": [
                        {"word": w.text, "start_time": round(w.start * 1000),
                         "end_time": round(w.end * 1000), "confidence": w.confidence,
                         "speaker_tag": 0}
                        for w in best.words
                    ]},
                ))  # fmt: skip
        if last and not finals:  # the audio ended in silence after the last utterance
            await self.send(_event(
                "conversation.item.input_audio_transcription.completed",
                item_id=self._item_id(), content_index=0, transcript="", is_last_result=True,
                words_info={"words": []},
            ))  # fmt: skip

    async def _formatted(self, r: Result) -> Result:
        """The final `r` in written form (the deltas keep the spoken words); a long one in a
        worker thread (`format_finals`)."""
        if self.formatter is None:
            return r
        return (await format_finals([r], self.formatter))[0]


def _scalar(given: dict[str, Any], key: str, section: str = "") -> Any:
    """`given[key]`, a setting: a string, number, boolean or null."""
    value = given[key]
    if value is not None and not isinstance(value, (str, int, float, bool)):
        name = f"{section}.{key}" if section else key
        raise ClientMistake("invalid_value", f"{name} must be a string, number or boolean")
    return value


def _parse(text: str) -> dict[str, Any]:
    try:
        event = json.loads(text)
    except ValueError as e:
        raise ClientMistake("invalid_json", f"the message is not JSON ({e})") from None
    except RecursionError:
        raise ClientMistake("invalid_json", "the message's JSON is nested too deeply") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise ClientMistake("invalid_event", "an event is a JSON object with a string `type`")
    return event
