"""The recognition core's own types, in no door's words: what a stream is opened with,
what it gives, and why a request is refused.

Every door (echoic's gRPC service, Riva's, the OpenAI HTTP API, the realtime
WebSocket) translates its messages into these and back: its own parsing into
`Options`, its own messages built from `Result`s, and its own table from a
`Refusal`'s kind to a gRPC status or an HTTP status. This module imports no grpc,
protobuf or aiohttp (`tests/test_boundaries.py` holds it to that), so the core
below the doors can be run and tested without any of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from echoic.model.core.decoding import DecoderConfig, Transcript
from echoic.model.runtime.formatting import Formatter
from echoic.model.runtime.recognizer import Utterance


@dataclass(frozen=True)
class Options:
    """What a stream or request is opened with: checked, in server units."""

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


class RefusalKind(enum.Enum):
    """Why a request is refused, as the core sees it; each door maps these to its statuses."""

    INVALID = "invalid"  # the request is wrong: the message says what to change
    TOO_LARGE = "too_large"  # over a limit of audio or bytes
    TIMED_OUT = "timed_out"  # idle, open too long, or its audio too slow to decode
    BUSY = "busy"  # at the server's limit of streams: retry later
    NOT_FOUND = "not_found"  # no such model or version
    UNAVAILABLE = "unavailable"  # shutting down, or a part the stream needs went away
    UNSUPPORTED = "unsupported"  # not available on this server (an extra not installed)
    INTERNAL = "internal"  # the server's own fault


class Remedy(enum.Enum):
    """What a client can do about a refusal, where only its door can say it: in the door's
    own calls and endpoints (a gRPC client streams with StreamingRecognize, an HTTP one
    posts files). The refusal's message says what is wrong; each door adds its sentence for
    the remedy (`server/core/refusals.py:door_message`)."""

    SPLIT_AUDIO = "split_audio"  # a whole file over the server's length limit: send it in parts
    SEND_WHOLE = "send_whole"  # live audio for a model that cannot stream: send the file whole


class Refusal(Exception):
    """A request the server refuses: a kind, a sentence a person can act on, and where the
    action depends on the door, a `remedy` that the door words."""

    def __init__(self, kind: RefusalKind, message: str, *, remedy: Remedy | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.remedy = remedy


def invalid(message: str, *, remedy: Remedy | None = None) -> Refusal:
    """The request is wrong: `message` says what to change."""
    return Refusal(RefusalKind.INVALID, message, remedy=remedy)


@dataclass(frozen=True)
class Word:
    text: str
    start: float  # s from the start of the stream's audio
    end: float  # s from the start of the stream's audio
    confidence: float


@dataclass(frozen=True)
class Alternative:
    text: str
    confidence: float
    words: tuple[Word, ...]  # empty unless the stream asked for words


@dataclass(frozen=True)
class Result:
    """One result of a stream: an utterance's transcript so far (interim) or final, with
    its alternatives (final beam-search results only; the best first)."""

    alternatives: tuple[Alternative, ...]
    is_final: bool
    stability: float  # the share of the best transcript's words that will not change
    stable_words: int  # the best transcript's leading words that will not change, count
    utterance_index: int
    start: float  # the utterance's start in the audio, s
    end: float  # how far its audio reaches, s

    @classmethod
    def of(cls, utterance: Utterance, *, final: bool, words: bool, end: float) -> Result:
        """An utterance as a result, its word times counted from the audio's start; `end`
        (s) where the audio it covers ends."""
        best = utterance.transcript
        n = len(best.words)
        stable = n if final else min(best.stable_words, n)
        others = best.alternatives if final else ()
        return cls(
            alternatives=tuple(_alternative(t, utterance.start, words) for t in (best, *others)),
            is_final=final,
            stability=1.0 if final else (stable / n if n else 0.0),
            stable_words=stable,
            utterance_index=utterance.index,
            start=utterance.start,
            end=end,
        )


def _alternative(transcript: Transcript, start: float, words: bool) -> Alternative:
    return Alternative(
        transcript.text,
        transcript.confidence,
        tuple(Word(w.text, start + w.start, start + w.end, w.confidence) for w in transcript.words)
        if words
        else (),
    )
