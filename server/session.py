"""One request or stream on the server: its config, its audio, its utterances, its results.

A `Session` owns an `AudioInput` (bytes -> samples at the model's rate) and an
`UtteranceStream` (samples -> transcripts), and turns what the stream decodes
into `SpeechRecognitionResult`s: interim results every `interim_interval_ms` of
decoded audio, a final one at each endpoint and at the end of the audio.

Endpointing (as in sherpa-onnx and Riva; the rule is
`model/core/decoding.py:Endpointing`, shared with files transcribed locally),
checked after every model step:
rule 1 ends an utterance after `trailing_silence_ms` of trailing silence (CTC
blanks and spaces after its last word) once it has a word; rule 2 ends it once it
reaches `max_utterance_ms`, at the first step that does not end inside a
character's run of frames (at most MAX_CUT_DELAY later), so that the next
utterance does not write that character again (an utterance of silence alone
ends without a result, so silence never produces empty finals). The stream then
goes on with a fresh
utterance: the CTC decoder restarts, while the acoustic model's recurrent state
and window position carry on, since the audio is one continuous signal (nothing
is dropped or re-padded at the boundary, and no step is spent warming up a new
state).
Word times are seconds from the start of the stream's audio.

Errors a client can fix are `RequestError(code, message)`; the service turns
them into gRPC status codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from echoic.model.core.audio import AudioError
from echoic.model.core.decoding import DecoderConfig, Transcript
from echoic.model.core.text import normalize_text
from echoic.model.runtime.recognizer import Endpointing, Recognizer, Stream
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.server.audio_input import AudioInput, check_format
from echoic.server.formatting import (
    Formatter,
    FormattingUnavailable,
    check_available,
    format_finals,
)
from echoic.server.models import LoadedModel

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


class RequestError(Exception):
    """A request the server refuses: a gRPC status code and a sentence saying what to change."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class Options:
    """A RecognitionConfig, checked and in server units."""

    encoding: str  # "auto", "linear16", "mulaw", "alaw", "wav", "flac" or "ogg"
    sample_rate: int | None  # Hz of the audio sent; None = from the header
    channels: int  # channels of LINEAR16 audio, count
    model: str  # model name; "" = the only one served
    version: str  # model version; "" = the serving one
    words: bool  # fill word times and confidences
    decoder: DecoderConfig | None  # None: the server's default for the model (--decoder)
    trailing_silence: float  # endpointing rule 1, s; 0 = off
    max_utterance: float  # endpointing rule 2, s; 0 = off
    interim: bool = False  # send interim results
    interim_interval: float = 0.0  # least decoded audio between interim results, s
    alternatives: int = 1  # most alternatives in a final result, count
    formatting: Formatter | None = None  # how final transcripts are written; None: raw words


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


class UtteranceStream(Stream):
    """A `Stream` cut into utterances at endpoints: the decoder restarts, the model runs on."""

    def __init__(self, recognizer: Recognizer) -> None:
        super().__init__(recognizer)
        self.utterance_index = 0  # utterances ended so far, count
        self._utterance_start_frame = 0  # output frame where the current utterance starts

    @property
    def utterance_start(self) -> float:
        """Where the current utterance starts in the audio, s."""
        return self._utterance_start_frame * self.recognizer.frame_seconds

    @property
    def utterance_seconds(self) -> float:
        """Audio decoded in the current utterance, s."""
        return self.decoded_seconds - self.utterance_start

    def end_utterance(self) -> Transcript:
        """Finalize the current utterance and start the next at the current position.

        An utterance without words (silence) is dropped: it is not counted, and the
        caller does not report it.
        """
        final = self.restart_decoder()
        self._utterance_start_frame = self.frames_decoded
        if final.words:
            self.utterance_index += 1
        return final


def _alternative(transcript: Transcript, start: float, words: bool):
    alternative = pb.SpeechRecognitionAlternative(
        transcript=transcript.text, confidence=transcript.confidence
    )
    if words:
        alternative.words.extend(
            pb.WordInfo(
                word=w.text, start_time=start + w.start, end_time=start + w.end,
                confidence=w.confidence,
            )
            for w in transcript.words
        )  # fmt: skip
    return alternative


def result_proto(
    transcript: Transcript,
    *,
    final: bool,
    index: int,
    start: float,
    end: float,
    words: bool,
) -> pb.SpeechRecognitionResult:
    """A result whose word times are shifted by `start` (s) to count from the audio's start.

    A final transcript's `alternatives` (beam search, `max_alternatives` > 1) follow it.
    """
    n = len(transcript.words)
    stable = n if final else min(transcript.stable_words, n)
    others = transcript.alternatives if final else ()
    return pb.SpeechRecognitionResult(
        alternatives=[_alternative(t, start, words) for t in (transcript, *others)],
        is_final=final,
        stability=1.0 if final else (stable / n if n else 0.0),
        stable_words=stable,
        utterance_index=index,
        utterance_start_time=start,
        utterance_end_time=end,
    )


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
        self.stream = UtteranceStream(recognizer) if streams else None
        if self.stream is not None:
            self.stream.n_best = options.alternatives
            # A beam search is decoded in the decoder pool, not in the shared batch.
            self.stream.deferred_decoding = recognizer.decoder_config.kind == "beam"
        self._offline: list[np.ndarray] = []  # samples, for a model that cannot stream
        self.samples = 0  # samples at the model's rate accepted, count
        self._last_interim = 0.0  # decoded audio at the last interim result, s
        self.finished = False  # the audio has ended
        self.done = False  # the last final result has been produced

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
        """Decode every ready window (through the dispatcher); the results to send now,
        final ones formatted as the options ask (server/formatting.py)."""
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
            await self.model.step(stream)
            if stream.has_undecoded or (stream.deferred_decoding and stream.is_final):
                await self.model.decode(stream)
            if stream.is_final:
                break
            if self._endpoint():
                start, index = stream.utterance_start, stream.utterance_index
                end = stream.decoded_seconds
                if stream.deferred_decoding:  # the beam search's end, in the decoder pool
                    final = await self.model.decode(stream, stream.end_utterance)
                else:
                    final = stream.end_utterance()
                if final.words:
                    out.append(self._result(final, True, index, start, end))
                self._last_interim = stream.decoded_seconds
            elif opts.interim and (
                stream.decoded_seconds - self._last_interim >= opts.interim_interval
            ):
                self._last_interim = stream.decoded_seconds
                out.append(self._result(stream.result(), False))
        if stream.is_final and not self.done:
            self.done = True
            final = stream.result()
            if stream.utterance_index == 0 or final.words:
                out.append(self._result(final, True))
        return out

    def _endpoint(self) -> bool:
        stream, opts = self.stream, self.options
        rule = Endpointing(opts.trailing_silence, opts.max_utterance)  # files' rule too
        words = stream.result().words
        return rule.due(words, stream.utterance_seconds, stream.recognizer.frame_seconds)

    def _result(
        self,
        transcript: Transcript,
        final: bool,
        index: int | None = None,
        start: float | None = None,
        end: float | None = None,
    ) -> pb.SpeechRecognitionResult:
        stream = self.stream
        return result_proto(
            transcript,
            final=final,
            index=stream.utterance_index if index is None else index,
            start=stream.utterance_start if start is None else start,
            end=self.decoded_seconds if end is None else min(end, self.seconds),
            words=self.options.words,
        )

    async def _advance_offline(self) -> list[pb.SpeechRecognitionResult]:
        """A model without stream.onnx: the whole utterance once the audio has ended."""
        if self.done or not self.finished:
            return []
        audio = np.concatenate(self._offline) if self._offline else np.zeros(0, np.float32)
        log_probs = await self.model.log_probs(audio)
        transcript = await self.model.decode_whole(
            self._recognizer, log_probs, self.options.alternatives
        )
        self.done = True
        return [
            result_proto(
                transcript, final=True, index=0, start=0.0, end=self.seconds,
                words=self.options.words,
            )
        ]  # fmt: skip
