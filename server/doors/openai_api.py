"""The OpenAI audio API's shapes, for the HTTP door (server/doors/http.py): request fields in,
transcripts out, errors in OpenAI's one error shape.

POST /v1/audio/transcriptions (multipart/form-data), OpenAI's field names:

    file                      the audio: WAV, FLAC, OGG (Vorbis/Opus) or MP3, as a file
    model                     an echoic model name; OpenAI's names (OPENAI_MODELS) and ""
                              mean the server's default model
    language                  "en" (or "en-US", ...) or empty; the models speak English only
    prompt, temperature       accepted and ignored: a CTC model has no prompt and no sampling
    response_format           json | text | srt | vtt | verbose_json
    timestamp_granularities[] word | segment, with verbose_json only (default: segment)
    stream                    "true": server-sent events, `transcript.text.delta` as
                              words firm up, then `transcript.text.done` (TextDeltas)
    formatting                echoic's own field: "true" (the default, as OpenAI's text is
                              punctuated and cased) or "false" for the words as spoken, in
                              lower case (docs/formatting.md); with the openai package,
                              `extra_body={"formatting": "false"}`

Formatted text (server/core/formatting.py) has sentence ends, commas, question marks,
capitals and written-form numbers ("$25", "3:30 p.m."); srt and vtt cues then end at
sentence ends too. When the server has no punctuation tagger, the default falls back to
written forms alone (lower case, no marks), and an explicit formatting=true is refused
(400).

and one of echoic's own (OpenAI's clients send it with `extra_body`):

    decoder                   greedy | beam (CTC beam search with the model's word LM);
                              absent: the server's default (`echoic serve --decoder`)

A segment is one utterance (the server cuts the audio at pauses: ENDPOINTING), and
its text is what gRPC Recognize gives for that utterance with the same endpointing.
verbose_json's per-segment numbers that only a Whisper-style decoder has are filled
from what echoic has: `avg_logprob` is the log of the utterance's confidence,
`compression_ratio` the text's zlib ratio (as Whisper computes it), `tokens` empty,
`no_speech_prob` 0 (an utterance exists only where words were heard), `temperature` 0.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from echoic.model.core.decoding import FILE_ENDPOINTING
from echoic.model.core.version import echoic_version
from echoic.model.runtime.formatting import ends_sentence
from echoic.protos import DECODER_KINDS
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.server.core.formatting import FormattingUnavailable, check_available, default_formatter
from echoic.server.core.models import ModelLookupError
from echoic.server.core.options import stream_options
from echoic.server.core.refusals import door_message, refusal_of
from echoic.server.core.types import Options, RefusalKind, Remedy, Result

OPENAI_MODELS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("word", "segment")
DECODERS = DECODER_KINDS  # decoder name -> DecoderConfig.Kind
ENDPOINTING = pb.EndpointingConfig(
    trailing_silence_ms=round(FILE_ENDPOINTING.trailing_silence * 1000),
    max_utterance_ms=round(FILE_ENDPOINTING.max_utterance * 1000),
)  # files' segments, as `echoic transcribe` cuts them: a pause of 0.8 s, none past 30 s
MAX_FIELD_BYTES = 64 * 1024  # a form field other than the file, bytes


class ApiError(Exception):
    """A request the HTTP door refuses: an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message, "type": self.type, "param": self.param,
                "code": self.code,
            }
        }  # fmt: skip


_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}


# This door's table: each kind of refusal as an HTTP status and the error `code` that
# OpenAI's error object (and the realtime WebSocket's `error` event) carries.
HTTP_STATUS: dict[RefusalKind, tuple[int, str]] = {
    RefusalKind.INVALID: (400, "invalid_argument"),
    RefusalKind.TOO_LARGE: (400, "out_of_range"),
    RefusalKind.TIMED_OUT: (408, "deadline_exceeded"),
    RefusalKind.BUSY: (429, "resource_exhausted"),
    RefusalKind.NOT_FOUND: (404, "not_found"),
    RefusalKind.UNAVAILABLE: (503, "unavailable"),
    RefusalKind.UNSUPPORTED: (400, "failed_precondition"),
    RefusalKind.INTERNAL: (500, "internal"),
}

# What an HTTP client can do, with this door's endpoints (a file too long for one request
# cannot be streamed past the same limit: the realtime socket has it too).
HTTP_REMEDIES = {
    Remedy.SPLIT_AUDIO: "split it into shorter files and POST each to /v1/audio/transcriptions",
    Remedy.SEND_WHOLE: "send the recording as a file to POST /v1/audio/transcriptions instead",
}


def api_error(e: Exception) -> ApiError:
    """The HTTP error an exception from below the door becomes."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ModelLookupError):
        return ApiError(404, e.http, param="model", code="model_not_found")
    refusal = refusal_of(e)
    status, code = HTTP_STATUS[refusal.kind]
    return ApiError(status, door_message(refusal, HTTP_REMEDIES), code=code)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class TranscriptionRequest:
    """The form fields of one transcription request, checked."""

    model: str  # echoic model name; "" = the server's default
    response_format: str  # one of RESPONSE_FORMATS
    words: bool  # verbose_json lists words with their times
    segments: bool  # verbose_json lists segments
    stream: bool  # answer as server-sent events
    decoder: str = ""  # "greedy" or "beam"; "" = the server's default
    formatting: bool = True  # readable text; False: the words as spoken
    punctuation: bool = True  # with formatting: marks and capitals (False: no tagger here)


def transcription_request(fields: Mapping[str, list[str]]) -> TranscriptionRequest:
    """The checked request that multipart form `fields` (name -> values) describe."""

    def one(name: str, default: str = "") -> str:
        values = fields.get(name, [])
        if len(values) > 1:
            raise bad(f"{name} was given {len(values)} times: give it once", name)
        return values[0].strip() if values else default

    model = one("model")
    if model in OPENAI_MODELS:
        model = ""
    language = one("language").lower()
    if language and language != "en" and not language.startswith("en-"):
        raise bad(
            f"language {language!r} is not served: these models transcribe English; "
            "send language=en or leave it out",
            "language", "unsupported_language",
        )  # fmt: skip
    temperature = one("temperature", "0")
    try:
        if not 0.0 <= float(temperature) <= 1.0:
            raise ValueError
    except ValueError:
        raise bad(
            f"temperature must be a number from 0 to 1, got {temperature!r} (it is ignored: "
            "a CTC model does not sample)",
            "temperature",
        ) from None
    response_format = one("response_format", "json")
    if response_format not in RESPONSE_FORMATS:
        raise bad(
            f"response_format {response_format!r} is not one of {', '.join(RESPONSE_FORMATS)}",
            "response_format",
        )
    granularities = fields.get("timestamp_granularities[]", []) + fields.get(
        "timestamp_granularities", []
    )
    for g in granularities:
        if g not in GRANULARITIES:
            raise bad(
                f"timestamp_granularities[] {g!r} is not one of {', '.join(GRANULARITIES)}",
                "timestamp_granularities[]",
            )
    if granularities and response_format != "verbose_json":
        raise bad(
            "timestamp_granularities[] needs response_format=verbose_json",
            "timestamp_granularities[]",
        )
    stream = one("stream", "false").lower()
    if stream not in ("true", "false"):
        raise bad(f"stream must be true or false, got {stream!r}", "stream")
    decoder = one("decoder").lower()
    if decoder and decoder not in DECODERS:
        raise bad(
            f"decoder {decoder[:40]!r} is not one of {', '.join(DECODERS)} (leave it out for "
            "the server's default)",
            "decoder", "unknown_decoder",
        )  # fmt: skip
    formatting = one("formatting", "").lower()
    if formatting not in ("", "true", "false"):
        raise bad(f"formatting must be true or false, got {formatting!r}", "formatting")
    if formatting == "true":
        try:
            check_available(default_formatter())
        except FormattingUnavailable as e:
            raise bad(str(e), "formatting", "formatting_unavailable") from None
    punctuation = True
    if not formatting:  # the default: all of it, or written forms alone without a tagger
        formatting, punctuation = "true", default_formatter_available()
    return TranscriptionRequest(
        model=model,
        response_format=response_format,
        words="word" in granularities,
        segments="segment" in granularities or not granularities,
        stream=stream == "true",
        decoder=decoder,
        formatting=formatting == "true",
        punctuation=punctuation,
    )


def default_formatter_available() -> bool:
    """Whether this server can punctuate; if not, the door's default is written forms alone."""
    try:
        check_available(default_formatter())
    except FormattingUnavailable:
        return False
    return True


def options_of(request: TranscriptionRequest, *, max_beam: int, interim: bool) -> Options:
    """What this request asks for, checked (`server/core/options.py:stream_options`): word
    times, endpointing `ENDPOINTING` for segments, formatting unless `formatting=false`.
    max_beam: the server's --max-beam-size; interim: interim results (stream=true)."""
    return stream_options(
        max_beam=max_beam,
        model=request.model,
        words=True,
        decoder=request.decoder or None,
        trailing_silence_ms=ENDPOINTING.trailing_silence_ms,
        max_utterance_ms=ENDPOINTING.max_utterance_ms,
        interim=interim,
        punctuation=request.formatting and request.punctuation,
        inverse=request.formatting,
    )


def recognition_config(request: TranscriptionRequest) -> pb.RecognitionConfig:
    """The gRPC config that asks Recognize for what this request asks (`options_of`'s
    Options, through `server/doors/grpc_api.py:parse_config`): for a gRPC client that wants
    this door's transcripts (bench/http_vs_grpc.py)."""
    config = pb.RecognitionConfig(
        model=request.model,
        enable_word_time_offsets=True,
        endpointing=ENDPOINTING,
        formatting=pb.FormattingConfig(
            punctuation=request.formatting and request.punctuation,
            inverse_normalization=request.formatting,
        ),
    )
    if request.decoder:
        config.decoder.kind = DECODERS[request.decoder]
    return config


# ---------------------------------------------------------------------- responses


@dataclass
class Word:
    word: str
    start: float  # s from the start of the audio
    end: float  # s


@dataclass
class Segment:
    id: int
    start: float  # s from the start of the audio
    end: float  # s
    text: str
    confidence: float  # 0-1
    words: list[Word] = field(default_factory=list)


def segments_of(results: list[Result]) -> list[Segment]:
    """One segment per final result with words (an utterance), in order."""
    out = []
    for r in results:
        best = r.alternatives[0] if r.alternatives else None
        if not r.is_final or best is None or not best.text:
            continue
        words = [Word(w.text, round(w.start, 3), round(w.end, 3)) for w in best.words]
        out.append(
            Segment(
                id=len(out), start=round(r.start, 3), end=round(r.end, 3), text=best.text,
                confidence=best.confidence, words=words,
            )
        )  # fmt: skip
    return out


def text_of(segments: list[Segment]) -> str:
    return " ".join(s.text for s in segments)


def render(
    request: TranscriptionRequest, segments: list[Segment], duration: float
) -> tuple[Any, str]:
    """The response body for `request.response_format`: (a JSON value or text, content type)."""
    kind = request.response_format
    if kind == "json":
        return {"text": text_of(segments)}, "application/json"
    if kind == "text":
        return text_of(segments) + "\n", "text/plain"
    if kind == "srt":
        return srt(segments), "application/x-subrip"
    if kind == "vtt":
        return vtt(segments), "text/vtt"
    body: dict[str, Any] = {
        "task": "transcribe", "language": "english", "duration": duration,
        "text": text_of(segments),
    }  # fmt: skip
    if request.segments:
        body["segments"] = [_verbose_segment(s) for s in segments]
    if request.words:
        body["words"] = [asdict(w) for s in segments for w in s.words]
    return body, "application/json"


def _verbose_segment(s: Segment) -> dict[str, Any]:
    raw = s.text.encode()
    return {
        "id": s.id, "seek": 0, "start": s.start, "end": s.end, "text": s.text, "tokens": [],
        "temperature": 0.0, "avg_logprob": math.log(max(s.confidence, 1e-10)),
        "compression_ratio": len(raw) / len(zlib.compress(raw)), "no_speech_prob": 0.0,
    }  # fmt: skip


def _clock(seconds: float, separator: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"


def cues(segments: list[Segment]) -> list[Segment]:
    """Subtitle cues: each segment cut after its sentence ends (formatted text has them),
    each piece timed by its own words; a segment with one sentence, or none marked, is
    one cue."""
    out = []
    for s in segments:
        pieces: list[list[Word]] = [[]]
        for w in s.words:
            pieces[-1].append(w)
            if ends_sentence(w.word):
                pieces.append([])
        pieces = [p for p in pieces if p]
        if len(pieces) < 2:
            out.append(s)
            continue
        out.extend(
            Segment(id=s.id, start=p[0].start, end=p[-1].end,
                    text=" ".join(w.word for w in p), confidence=s.confidence, words=p)
            for p in pieces
        )  # fmt: skip
    return out


def srt(segments: list[Segment]) -> str:
    return "".join(
        f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n\n"
        for i, s in enumerate(cues(segments), 1)
    )


def vtt(segments: list[Segment]) -> str:
    cues_text = "".join(
        f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n\n" for s in cues(segments)
    )
    return "WEBVTT\n\n" + cues_text


class TextDeltas:
    """`stream=true`: the transcript as deltas, from a live stream's results. A delta is
    the words that firmed up since the last one: an interim result's stable words (for
    greedy decoding, words a space has closed, which later results never change) and a
    final result's rest. Joined, the deltas are the final text. With `finals_only`
    (formatted text: its words are not the interim results' spoken words) a delta is
    each utterance's formatted text, once it is final."""

    def __init__(self, finals_only: bool = False) -> None:
        self.finals: list[str] = []  # final transcripts of the utterances so far
        self._sent = 0  # words of the current utterance already sent
        self._finals_only = finals_only

    @property
    def text(self) -> str:
        return " ".join(t for t in self.finals if t)

    def add(self, results: list[Result]) -> list[str]:
        """The deltas these results add (in order; none when nothing firmed up)."""
        out = []
        for r in results:
            transcript = r.alternatives[0].text if r.alternatives else ""
            if not r.is_final and self._finals_only:
                continue
            words = transcript.split()
            firm = words if r.is_final else words[: r.stable_words]
            if len(firm) > self._sent:
                lead = " " if self.text or self._sent else ""
                out.append(lead + " ".join(firm[self._sent :]))
                self._sent = len(firm)
            if r.is_final:
                self.finals.append(transcript)
                self._sent = 0
        return out


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event carrying `event` as JSON (OpenAI's streams: data lines only)."""
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def model_list(names: list[str], created: int) -> dict[str, Any]:
    """GET /v1/models: the served model names (OpenAI's list of model objects), and
    echoic's version (a field OpenAI's clients ignore)."""
    return {
        "object": "list",
        "server_version": echoic_version(),
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "echoic"}
            for name in names
        ],
    }
