"""echoic's gRPC messages in the core's terms, for the doors that speak them: a
`RecognitionConfig` read into `Options` (`parse_config`: its enums and boosts here, its
values checked by `server/core/options.py:stream_options` as every door's; Riva's door
translates Riva's config into echoic's) and a core `Result` as a
`SpeechRecognitionResult` (`result_proto`). The messages' field names appear in the
refusals said here, since a client of these messages can act on them. Protobuf only:
the gRPC status of each refusal is the gRPC door's (`server/doors/service.py:GRPC_STATUS`).
"""

from __future__ import annotations

from echoic.model.core.text import normalize_text
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.server.core.options import stream_options
from echoic.server.core.types import Options, Result, invalid

_ENCODINGS = {
    pb.RecognitionConfig.ENCODING_UNSPECIFIED: "auto",
    pb.RecognitionConfig.LINEAR16: "linear16",
    pb.RecognitionConfig.WAV: "wav",
    pb.RecognitionConfig.FLAC: "flac",
    pb.RecognitionConfig.MULAW: "mulaw",
    pb.RecognitionConfig.ALAW: "alaw",
    pb.RecognitionConfig.OGG_OPUS: "ogg",
}
_DECODERS = {pb.DecoderConfig.GREEDY: "greedy", pb.DecoderConfig.BEAM: "beam"}


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


def parse_config(
    config: pb.RecognitionConfig,
    *,
    max_beam: int,
    interim: bool = False,
    interval_ms: int = 0,
) -> Options:
    """Options from a RecognitionConfig; a Refusal (INVALID) saying what is wrong: the
    message's own enums and boosts here, the values' checks in
    `server/core/options.py:stream_options`, as every door's. `max_beam`: the largest
    beam_size this server allows (`ServerConfig.max_beam_size`)."""
    if config.encoding not in _ENCODINGS:
        raise invalid(
            f"unsupported encoding {config.encoding}: use LINEAR16 (raw PCM16), MULAW, ALAW, "
            "WAV, FLAC or OGG_OPUS"
        )
    d = config.decoder
    if d.kind not in _DECODERS:
        raise invalid(f"unknown decoder kind {d.kind}: use GREEDY or BEAM")
    e = config.endpointing
    return stream_options(
        max_beam=max_beam,
        encoding=_ENCODINGS[config.encoding],
        sample_rate=config.sample_rate_hertz or None,
        channels=config.audio_channel_count or 1,
        model=config.model,
        version=config.model_version,
        words=config.enable_word_time_offsets,
        # no decoder message: the server's default
        decoder=_DECODERS[d.kind] if config.HasField("decoder") else None,
        beam_size=d.beam_size,
        use_lm=not d.disable_lm,
        boost=_boosts(d),
        trailing_silence_ms=e.trailing_silence_ms,
        max_utterance_ms=e.max_utterance_ms,
        interim=interim,
        interim_interval_ms=interval_ms,
        alternatives=config.max_alternatives,
        punctuation=config.formatting.punctuation,
        inverse=config.formatting.inverse_normalization,
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
