"""The options a stream or request is opened with, from plain values, checked: the one
place every door's settings become `server/core/types.py:Options`.

Each door reads its own messages (echoic's and Riva's `RecognitionConfig` in
`server/doors/grpc_api.py:parse_config`, OpenAI's form fields in
`server/doors/openai_api.py:options_of`, the realtime WebSocket's settings in
`server/doors/realtime.py:RealtimeSession._configure`) and hands the values here, so a
model name, an audio format, a decoder or a formatting request is checked the same
way whichever door it came through. A value that will not do is a Refusal (INVALID;
UNSUPPORTED for formatting this server cannot do) whose message names echoic's config
field, as `server/core/audio_input.py:check_format`'s do: the fields every door's settings
map to, and the ones docs/ARCHITECTURE.md and the clients use.
"""

from __future__ import annotations

from echoic.model.core.audio import AudioError
from echoic.model.core.decoding import DecoderConfig
from echoic.server.core.audio_input import check_format
from echoic.server.core.formatting import formatter_of
from echoic.server.core.types import Options, invalid

MAX_NAME = 256  # characters of a model name or version in a request (they name directories)
DECODERS = ("greedy", "beam")  # decoder names; None: the server's default (--decoder)


def stream_options(
    *,
    max_beam: int,
    encoding: str = "auto",
    sample_rate: int | None = None,
    channels: int = 1,
    model: str = "",
    version: str = "",
    words: bool = False,
    decoder: str | None = None,
    beam_size: int = 0,
    use_lm: bool = True,
    boost: tuple[tuple[str, float], ...] = (),
    trailing_silence_ms: int = 0,
    max_utterance_ms: int = 0,
    interim: bool = False,
    interim_interval_ms: int = 0,
    alternatives: int = 0,
    punctuation: bool = False,
    inverse: bool = False,
) -> Options:
    """Checked `Options`; a Refusal saying what is wrong.

    max_beam: the largest beam_size this server allows (`ServerConfig.max_beam_size`).
    encoding, sample_rate (Hz; None: from the header), channels: the audio
    (`check_format`). decoder: one of DECODERS, None for the server's default; beam_size
    (0: the default), use_lm and boost ((word, nats), normalised) for "beam". The
    endpointing and interim interval in ms (0: off), as every door's settings give them.
    alternatives: most alternatives in a final result (0: one). punctuation, inverse:
    how final transcripts are written (`formatter_of`)."""
    for field, value in (("model", model), ("model_version", version)):
        if len(value) > MAX_NAME:
            raise invalid(f"{field} is {len(value)} characters long; at most {MAX_NAME}")
    try:
        check_format(encoding, sample_rate, channels)
    except AudioError as e:
        raise invalid(str(e)) from None
    if decoder is not None and decoder not in DECODERS:
        raise invalid(f"unknown decoder {decoder[:40]!r}: use {' or '.join(DECODERS)}")
    default_beam = DecoderConfig.beam_size
    if not 0 <= beam_size <= max_beam:
        raise invalid(
            f"beam_size must be 0 (the default, {min(default_beam, max_beam)}) to {max_beam} "
            f"(this server's --max-beam-size), got {beam_size}"
        )
    if boost and decoder != "beam":
        raise invalid("decoder.boosts need decoder.kind BEAM (greedy decoding cannot boost)")
    for field, number in (
        ("endpointing.trailing_silence_ms", trailing_silence_ms),
        ("endpointing.max_utterance_ms", max_utterance_ms),
        ("interim_interval_ms", interim_interval_ms),
        ("max_alternatives", alternatives),
    ):
        if number < 0:
            raise invalid(f"{field} must be >= 0, got {number}")
    chosen = None if decoder is None else DecoderConfig()  # None: the server's default
    if decoder == "beam":
        size = beam_size or min(default_beam, max_beam)
        chosen = DecoderConfig("beam", size, use_lm=use_lm, boost=boost)
    return Options(
        encoding=encoding,
        sample_rate=sample_rate,
        channels=channels,
        model=model,
        version=version,
        words=words,
        decoder=chosen,
        trailing_silence=trailing_silence_ms / 1000.0,
        max_utterance=max_utterance_ms / 1000.0,
        interim=interim,
        interim_interval=interim_interval_ms / 1000.0,
        alternatives=max(1, alternatives),
        formatting=formatter_of(punctuation, inverse),
    )
