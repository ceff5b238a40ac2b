"""Requests and results: plain Python values in, protobuf messages out, and back.

Shared by `Client` and `AsyncClient`: `recognition_config` builds the config from
keywords, `payload_of` turns any audio source into bytes plus their format, and
`Recognition` is the whole-audio transcript (field names as in an in-process
transcript, so the same record functions serve both).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from echoic.clients.audio import (
    Chunk,
    Payload,
    encoding_value,
    file_chunks,
    file_payload,
    paced,
    pcm_chunks,
    read_file,
    samples_payload,
)
from echoic.protos import DECODER_KINDS
from echoic.protos.v1 import transcriber_pb2 as pb

AudioSource = bytes | str | os.PathLike | np.ndarray

# Audio over this goes through StreamingRecognize instead of one Recognize message,
# so no server's message size limit (gRPC's default is 4 MiB) stops a long file.
MAX_UNARY_AUDIO_BYTES = 4 * 1024 * 1024
STREAM_PIECE_BYTES = 1024 * 1024  # audio per streamed message when a file is too big, bytes


# ------------------------------------------------------------------ requests


def recognition_config(
    *,
    encoding: str | int | None = None,
    sample_rate: int = 0,
    channels: int = 0,
    model: str = "",
    model_version: str = "",
    words: bool = True,
    decoder: str | None = None,
    beam_size: int = 0,
    disable_lm: bool = False,
    max_alternatives: int = 0,
    trailing_silence_ms: int = 0,
    max_utterance_ms: int = 0,
    punctuation: bool = False,
    inverse_normalization: bool = False,
) -> pb.RecognitionConfig:
    """A RecognitionConfig from plain values (see the .proto for each field).

    encoding: 'auto' (WAV/FLAC from the header), 'linear16', 'wav' or 'flac'.
    decoder: 'greedy', 'beam', or None for the server's default (`echoic serve
    --decoder`). trailing_silence_ms / max_utterance_ms turn on endpointing (a stream
    is split into utterances, each with its final result).
    punctuation / inverse_normalization: readable final transcripts (FormattingConfig).
    """
    if decoder is not None and decoder not in DECODER_KINDS:
        names = ", ".join(map(repr, DECODER_KINDS))
        raise ValueError(f"decoder must be {names} or None, got {decoder!r}")
    if decoder is None and (beam_size or disable_lm):
        raise ValueError("beam_size and disable_lm are beam search's: give decoder='beam'")
    config = pb.RecognitionConfig(
        encoding=encoding_value(encoding),
        sample_rate_hertz=sample_rate,
        audio_channel_count=channels,
        model=model,
        model_version=model_version,
        enable_word_time_offsets=words,
        max_alternatives=max_alternatives,
        formatting=pb.FormattingConfig(
            punctuation=punctuation, inverse_normalization=inverse_normalization
        ),
    )
    if decoder is not None:
        config.decoder.CopyFrom(
            pb.DecoderConfig(
                kind=DECODER_KINDS[decoder], beam_size=beam_size, disable_lm=disable_lm
            )
        )
    if trailing_silence_ms or max_utterance_ms:
        config.endpointing.CopyFrom(
            pb.EndpointingConfig(
                trailing_silence_ms=trailing_silence_ms, max_utterance_ms=max_utterance_ms
            )
        )
    return config


def stream_config(
    config: pb.RecognitionConfig | None,
    encoding: str | int | None,
    sample_rate: int,
    channels: int,
    options: dict[str, Any],
) -> pb.RecognitionConfig:
    """A stream's config: the ready `config`, or one built from the keywords (not both)."""
    if config is not None and options:
        raise TypeError(f"give a config or its keywords, not both: {', '.join(options)}")
    if config is not None:
        return config
    return recognition_config(
        encoding=encoding, sample_rate=sample_rate, channels=channels, **options
    )


def payload_of(
    audio: AudioSource, encoding: str | int | None, sample_rate: int, channels: int
) -> Payload:
    """Any accepted audio source -> bytes plus their format."""
    if isinstance(audio, (str, os.PathLike)):
        if encoding is not None or sample_rate:
            return Payload(read_file(audio), encoding_value(encoding), sample_rate, channels)
        return file_payload(audio)
    if isinstance(audio, np.ndarray):
        if not sample_rate:
            raise ValueError("samples need their sample_rate")
        return samples_payload(audio, sample_rate)
    return Payload(bytes(audio), encoding_value(encoding), sample_rate, channels)


def config_request(
    config: pb.RecognitionConfig, *, interim_results: bool, interim_interval_ms: int = 0
) -> pb.StreamingRecognizeRequest:
    """A stream's first message: its config."""
    return pb.StreamingRecognizeRequest(
        streaming_config=pb.StreamingRecognitionConfig(
            config=config,
            interim_results=interim_results,
            interim_interval_ms=interim_interval_ms,
        )
    )


def audio_request(chunk: bytes | Chunk) -> pb.StreamingRecognizeRequest | None:
    """The message carrying one chunk of audio; None for an empty chunk (nothing to send)."""
    data = chunk.data if isinstance(chunk, Chunk) else chunk
    return pb.StreamingRecognizeRequest(audio_content=bytes(data)) if data else None


def streaming_requests(
    config: pb.RecognitionConfig,
    chunks: Iterable[bytes | Chunk],
    *,
    interim_results: bool,
    interim_interval_ms: int = 0,
) -> Iterator[pb.StreamingRecognizeRequest]:
    """The config message, then one message per chunk of audio."""
    yield config_request(
        config, interim_results=interim_results, interim_interval_ms=interim_interval_ms
    )
    for chunk in chunks:
        if (request := audio_request(chunk)) is not None:
            yield request


def final_response(
    responses: Iterable[pb.StreamingRecognizeResponse],
) -> pb.RecognizeResponse:
    """The final results of a whole stream, as the RecognizeResponse for the same audio."""
    out = pb.RecognizeResponse()
    for response in responses:
        out.results.extend(r for r in response.results if r.is_final)
        out.audio_processed_seconds = response.audio_processed_seconds
        out.model.CopyFrom(response.model)
    return out


def recognize_requests(
    payload: Payload, config: dict[str, Any]
) -> tuple[pb.RecognitionConfig, pb.RecognizeRequest | None]:
    """The config for a payload, and one RecognizeRequest unless it is too big for one."""
    cfg = recognition_config(
        encoding=payload.encoding,
        sample_rate=payload.sample_rate,
        channels=payload.channels,
        **config,
    )
    if len(payload.data) > MAX_UNARY_AUDIO_BYTES:
        return cfg, None
    return cfg, pb.RecognizeRequest(config=cfg, audio_content=payload.data)


def pieces(data: bytes) -> Iterator[bytes]:
    return (data[i : i + STREAM_PIECE_BYTES] for i in range(0, len(data), STREAM_PIECE_BYTES))


def open_file_stream(
    path: str | os.PathLike[str],
    *,
    realtime: bool,
    chunk_ms: float,
    encoding: str | None,
    config: dict[str, Any],
) -> tuple[pb.RecognitionConfig, Iterator[Chunk]]:
    """The config and chunks of a file: decoded to PCM16, or WAV/FLAC bytes as they are."""
    if encoding in (None, "linear16"):
        fmt, chunks = pcm_chunks(path, chunk_ms)
    else:
        fmt, chunks = file_chunks(path, chunk_ms, encoding)
    cfg = recognition_config(
        encoding=fmt.encoding, sample_rate=fmt.sample_rate, channels=fmt.channels, **config
    )
    return cfg, paced(chunks) if realtime else chunks


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class Word:
    text: str
    start: float  # s from the start of the audio
    end: float  # s from the start of the audio
    confidence: float  # in [0, 1]


@dataclass(frozen=True)
class Recognition:
    """What `recognize` returns: the transcript of the whole audio, and the raw response.

    Field names match an in-process transcript (text, words, confidence), so the
    same record functions serve both.
    """

    text: str  # every utterance's best transcript, joined by single spaces
    words: tuple[Word, ...]  # with their times (when words were asked for)
    confidence: float  # in [0, 1]: mean word confidence (the server's, for one utterance)
    audio_seconds: float  # length of the audio, s
    model: str  # "name/version" that served it
    response: pb.RecognizeResponse

    @classmethod
    def from_response(cls, response: pb.RecognizeResponse) -> Recognition:
        best = [r.alternatives[0] for r in response.results if r.alternatives]
        words = tuple(
            Word(w.word, w.start_time, w.end_time, w.confidence) for a in best for w in a.words
        )
        if len(best) == 1:
            confidence = best[0].confidence
        elif words:
            confidence = sum(w.confidence for w in words) / len(words)
        else:
            confidence = 0.0
        return cls(
            text=" ".join(a.transcript for a in best if a.transcript),
            words=words,
            confidence=float(confidence),
            audio_seconds=response.audio_processed_seconds,
            model=f"{response.model.name}/{response.model.version}",
            response=response,
        )
