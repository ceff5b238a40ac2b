"""One request or stream on the server: its config, its audio, its utterances, its results.

A `Session` owns an `AudioInput` (bytes -> samples at the model's rate) and a
runtime `Stream` (samples -> utterances, made with the request's endpointing and
decoder settings: `model/runtime/recognizer.py`, where endpointing lives), and
turns what each step gives (`Stepped`, one await of the dispatcher per step) into
`SpeechRecognitionResult`s: interim results every `interim_interval_ms` of
decoded audio, a final one at each endpoint and at the end of the audio.

Endpointing (the rule is `model/core/decoding.py:Endpointing`, shared with
files transcribed locally): rule 1 ends an utterance after `trailing_silence_ms`
of trailing silence (CTC blanks and spaces after its last word) once it has a
word; rule 2 ends it once it reaches `max_utterance_ms`, at the first step that
does not end inside a character's run of frames (at most MAX_CUT_DELAY later).
Word times are seconds from the start of the stream's audio.

Errors a client can fix are `RequestError(code, message)`, a `server/core.py:Refusal`
whose kind follows its gRPC status code; the service turns them into gRPC status
codes, the HTTP door into HTTP statuses. `open_session` is the one place a request
or stream is opened on a model version and closed again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import numpy as np

from echoic.model.core.audio import AudioError
from echoic.model.core.decoding import DecoderConfig
from echoic.model.core.text import normalize_text
from echoic.model.runtime.recognizer import Endpointing, Recognizer, Utterance
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.server.audio_input import AudioInput, check_format
from echoic.server.config import ServerConfig
from echoic.server.core import Options, Refusal, RefusalKind, Result
from echoic.server.formatting import (
    Formatter,
    FormattingUnavailable,
    check_available,
    format_finals,
)
from echoic.server.models import LoadedModel, ModelRegistry

_ENCODINGS = {
    pb.RecognitionConfig.ENCODING_UNSPECIFIED: "auto",
    pb.RecognitionConfig.LINEAR16: "linear16",
    pb.RecognitionConfig.WAV: "wav",
    pb.RecognitionConfig.FLAC: "flac",
    pb.RecognitionConfig.MULAW: "mulaw",
    pb.RecognitionConfig.ALAW: "alaw",
    pb.RecognitionConfig.OGG_OPUS: "ogg",
}


MAX_NAME = 256  # characters of a model name or version in a request (they name directories)


# The gRPC status of each kind of refusal (echoic's and Riva's doors; the HTTP door maps
# these statuses on to HTTP's).
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


class RequestError(Refusal):
    """A request the server refuses, said in gRPC's words: a status code (its kind follows
    from it) and a sentence saying what to change."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(_KIND_OF_STATUS.get(code, RefusalKind.INTERNAL), message)
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


MAX_BOOSTED_WORDS = 1000  # words in all of a request's decoder.boosts, count
MAX_BOOSTED_CHARS = 50  # characters of one boosted word
DEFAULT_BOOST = 5.0  # nats, for a WordBoost whose boost is 0


def check_phrase_count(phrases: int, where: str) -> None:
    """Every boosted phrase counts, even one that normalises to no word ("!"), and is
    counted before any is read: a request with millions of them is refused at once."""
    if phrases > MAX_BOOSTED_WORDS:
        raise invalid(f"{where}: {phrases} phrases; at most {MAX_BOOSTED_WORDS} in all")


def _boosts(d: pb.DecoderConfig) -> tuple[tuple[str, float], ...]:
    """decoder.boosts as (word, nats), words normalised as transcripts are; the largest
    boost wins for a word given twice."""
    words: dict[str, float] = {}
    given = 0
    check_phrase_count(sum(len(entry.words) for entry in d.boosts), "decoder.boosts")
    for entry in d.boosts:
        nats = entry.boost or DEFAULT_BOOST
        if not -100.0 <= nats <= 100.0:
            raise invalid(f"decoder.boosts boost must be -100 to 100 nats, got {nats:g}")
        for phrase in entry.words:
            if len(phrase) > MAX_BOOSTED_CHARS * 8:
                raise invalid(
                    f"decoder.boosts: a phrase of {len(phrase)} characters; boost words or"
                    f" short phrases (at most {MAX_BOOSTED_CHARS * 8} characters)"
                )
            for word in normalize_text(phrase).split():
                given += 1
                if given > MAX_BOOSTED_WORDS:
                    raise invalid(f"decoder.boosts: at most {MAX_BOOSTED_WORDS} words in all")
                if len(word) > MAX_BOOSTED_CHARS:
                    raise invalid(
                        f"decoder.boosts: {word[:20]!r}... is over {MAX_BOOSTED_CHARS} characters"
                    )
                words[word] = max(words.get(word, nats), nats)
    if len(words) > MAX_BOOSTED_WORDS:
        raise invalid(f"decoder.boosts: at most {MAX_BOOSTED_WORDS} words")
    return tuple(sorted(words.items()))


def formatter_of(punctuation: bool, inverse: bool) -> Formatter | None:
    """The formatter a request asks for (None: none); RequestError(FAILED_PRECONDITION)
    when this install cannot punctuate."""
    if not (punctuation or inverse):
        return None
    formatter = Formatter(punctuation=punctuation, inverse=inverse)
    try:
        check_available(formatter)
    except FormattingUnavailable as e:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
    return formatter


def parse_config(
    config: pb.RecognitionConfig,
    *,
    max_beam: int,
    interim: bool = False,
    interval_ms: int = 0,
) -> Options:
    """Options from a RecognitionConfig; RequestError(INVALID_ARGUMENT) saying what is wrong.
    `max_beam`: the largest beam_size this server allows (`ServerConfig.max_beam_size`)."""
    if config.encoding not in _ENCODINGS:
        raise invalid(
            f"unsupported encoding {config.encoding}: use LINEAR16 (raw PCM16), MULAW, ALAW, "
            "WAV, FLAC or OGG_OPUS"
        )
    for field, value in (("model", config.model), ("model_version", config.model_version)):
        if len(value) > MAX_NAME:
            raise invalid(f"{field} is {len(value)} characters long; at most {MAX_NAME}")
    encoding = _ENCODINGS[config.encoding]
    rate = config.sample_rate_hertz or None
    channels = config.audio_channel_count or 1
    try:
        check_format(encoding, rate, channels)
    except AudioError as e:
        raise invalid(str(e)) from None
    d = config.decoder
    named = config.HasField("decoder")  # no decoder message: the server's default
    if d.kind not in (pb.DecoderConfig.GREEDY, pb.DecoderConfig.BEAM):
        raise invalid(f"unknown decoder kind {d.kind}: use GREEDY or BEAM")
    default_beam = DecoderConfig.beam_size
    if not 0 <= d.beam_size <= max_beam:
        raise invalid(
            f"beam_size must be 0 (the default, {min(default_beam, max_beam)}) to {max_beam} "
            f"(this server's --max-beam-size), got {d.beam_size}"
        )
    boost = _boosts(d)
    if boost and d.kind != pb.DecoderConfig.BEAM:
        raise invalid("decoder.boosts need decoder.kind BEAM (greedy decoding cannot boost)")
    decoder = (
        DecoderConfig(
            "beam",
            d.beam_size or min(default_beam, max_beam),
            use_lm=not d.disable_lm,
            boost=boost,
        )  # fmt: skip
        if d.kind == pb.DecoderConfig.BEAM
        else DecoderConfig()
        if named
        else None
    )
    e = config.endpointing
    for field, value in (
        ("endpointing.trailing_silence_ms", e.trailing_silence_ms),
        ("endpointing.max_utterance_ms", e.max_utterance_ms),
        ("interim_interval_ms", interval_ms),
        ("max_alternatives", config.max_alternatives),
    ):
        if value < 0:
            raise invalid(f"{field} must be >= 0, got {value}")
    return Options(
        encoding=encoding,
        sample_rate=rate,
        channels=channels,
        model=config.model,
        version=config.model_version,
        words=config.enable_word_time_offsets,
        decoder=decoder,
        trailing_silence=e.trailing_silence_ms / 1000.0,
        max_utterance=e.max_utterance_ms / 1000.0,
        interim=interim,
        interim_interval=interval_ms / 1000.0,
        alternatives=max(1, config.max_alternatives),
        formatting=formatter_of(
            config.formatting.punctuation, config.formatting.inverse_normalization
        ),
    )


def result_proto(result: Result) -> pb.SpeechRecognitionResult:
    """A core `Result` as echoic's message."""
    return pb.SpeechRecognitionResult(
        alternatives=[
            pb.SpeechRecognitionAlternative(
                transcript=a.text,
                confidence=a.confidence,
                words=[
                    pb.WordInfo(
                        word=w.text, start_time=w.start, end_time=w.end, confidence=w.confidence
                    )
                    for w in a.words
                ],
            )
            for a in result.alternatives
        ],
        is_final=result.is_final,
        stability=result.stability,
        stable_words=result.stable_words,
        utterance_index=result.utterance_index,
        utterance_start_time=result.start,
        utterance_end_time=result.end,
    )


@asynccontextmanager
async def open_session(
    registry: ModelRegistry,
    opts: Options,
    config: ServerConfig,
    *,
    name: str,
    live: bool = False,
    whole: bool | None = False,
) -> AsyncIterator[Session]:
    """The one place a request or stream is opened, for every door: the model version
    resolved from `opts` and held for the session's life (a draining version unloads once
    its last session closes), the recognizer for its decoder, a `Session` with the
    server's audio limits; closed and released however it ends. live: a stream whose
    audio comes as it is spoken, refused for a model that cannot stream. whole: all the
    audio comes at once (Recognize); None: whole only for a model that streams by
    overlapped chunks (a paced file: `TranscriberService.recognize_paced`)."""
    model = registry.resolve(opts.model, opts.version)
    if live and not model.streamable:
        raise invalid(
            f"model {model.name!r} version {model.version!r} cannot stream (a full-context "
            "model without stream.onnx, and for an imported one, echoic serve --chunk-ms 0):"
            " send the whole audio with Recognize instead"
        )
    registry.acquire(model)
    session = None
    try:
        recognizer = await model.recognizer(opts.decoder)
        session = Session(
            model, recognizer, opts, name=name, max_seconds=config.max_audio_seconds,
            time_limit=config.decode_timeout_seconds,
            whole=not model.streams_exactly if whole is None else whole,
        )  # fmt: skip
        yield session
    finally:
        if session is not None:
            session.close()
        registry.release(model)


class Session:
    """The audio and transcripts of one request or stream on one model version."""

    def __init__(
        self,
        model: LoadedModel,
        recognizer: Recognizer,
        options: Options,
        name: str,
        *,
        max_seconds: float = 0.0,
        time_limit: float = 0.0,
        whole: bool = False,
    ) -> None:
        """max_seconds, time_limit: the audio's limits (`AudioInput`'s). whole: all the audio
        comes at once (Recognize); a model that streams only by overlapped chunks then runs
        it whole instead, with the whole utterance as context."""
        self.model = model
        self.options = options
        self.audio = AudioInput(
            options.encoding,
            model.card.sample_rate,
            sample_rate=options.sample_rate,
            channels=options.channels,
            name=name,
            max_seconds=max_seconds,
            time_limit=time_limit,
        )
        self._recognizer = recognizer
        streams = model.streamable and (model.streams_exactly or not whole)
        # A beam search is decoded in the decoder pool, not in the shared batch (the
        # recognizer's default for its decoder).
        self.stream = (
            recognizer.stream(
                endpointing=Endpointing(options.trailing_silence, options.max_utterance),
                n_best=options.alternatives,
            )
            if streams
            else None
        )
        self._offline: list[np.ndarray] = []  # samples, for a model that cannot stream
        self.samples = 0  # samples at the model's rate accepted, count
        self._last_interim = 0.0  # decoded audio at the last interim result, s
        self.finished = False  # the audio has ended
        self.done = False  # the last final result has been produced

    def close(self) -> None:
        """Let go of the audio decoder (a FLAC or Ogg decoder's threads end with the session)
        and of the stream (an engine process's state for it)."""
        self.audio.close()
        if self.stream is not None:
            self.stream.close()

    @property
    def seconds(self) -> float:
        """Audio received, s."""
        return self.samples / self.model.card.sample_rate

    @property
    def decoded_seconds(self) -> float:
        """Audio decoded so far, s (all of it once the audio has ended and been decoded)."""
        if self.stream is None or self.stream.is_final:
            return self.seconds if self.done else 0.0
        return min(self.stream.decoded_seconds, self.seconds)

    def accept(self, samples: np.ndarray) -> None:
        self.samples += len(samples)
        if self.stream is not None:
            self.stream.accept_audio(samples)
        elif len(samples):
            self._offline.append(samples)

    def finish(self, *, features_now: bool = False) -> None:
        """The audio has ended (`Stream.finish`; features_now: see there)."""
        self.finished = True
        if self.stream is not None:
            self.stream.finish(features_now=features_now)

    async def advance(self) -> list[pb.SpeechRecognitionResult]:
        """Run every ready step (through the dispatcher, one await each); the results to
        send now, final ones formatted as the options ask (server/formatting.py)."""
        out = await self._advance()
        formatter = self.options.formatting
        if formatter is None or not any(r.is_final for r in out):
            return out
        return await format_finals(out, formatter)

    async def _advance(self) -> list[pb.SpeechRecognitionResult]:
        if self.stream is None:
            return await self._advance_offline()
        out: list[pb.SpeechRecognitionResult] = []
        stream, opts = self.stream, self.options
        while stream.is_ready():
            stepped = await self.model.dispatcher.step(stream)
            out += (self._result(u, True) for u in stepped.finals)
            if stepped.endpoint:
                self._last_interim = stepped.decoded_seconds
            elif (
                stepped.partial is not None
                and opts.interim
                and stepped.decoded_seconds - self._last_interim >= opts.interim_interval
            ):
                self._last_interim = stepped.decoded_seconds
                out.append(self._result(stepped.partial, False))
            if stream.is_final:
                break
        if stream.is_final and not self.done:
            self.done = True
            # Whole audio whose features were computed at finish (`features_now`) may
            # leave no step to run: its last utterance is settled here.
            out += (self._result(u, True) for u in stream.settle().finals)
        return out

    def _result(self, utterance: Utterance, final: bool) -> pb.SpeechRecognitionResult:
        end = min(utterance.end, self.seconds)
        return result_proto(Result.of(utterance, final=final, words=self.options.words, end=end))

    async def _advance_offline(self) -> list[pb.SpeechRecognitionResult]:
        """A model without stream.onnx: the whole utterance once the audio has ended."""
        if self.done or not self.finished:
            return []
        audio = np.concatenate(self._offline) if self._offline else np.zeros(0, np.float32)
        dispatcher = self.model.dispatcher
        log_probs = await dispatcher.offline(audio)
        transcript = await dispatcher.decode_whole(
            self._recognizer, log_probs, self.options.alternatives
        )
        self.done = True
        return [self._result(Utterance(transcript, 0, 0.0, self.seconds), True)]
