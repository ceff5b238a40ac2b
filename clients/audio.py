"""Audio on the client side: files into request payloads and paced chunks.

The server decodes WAV and FLAC itself and resamples whatever rate it gets, so
the client does as little as it can: WAV and FLAC files travel as they are;
anything else libsndfile can read (OGG, MP3, AIFF, ...) is decoded here into a
32-bit float WAV at the file's own rate and channel count, the samples the server
would decode, so a transcript is the same here and there. Streams are sent as
PCM16 chunks of `chunk_ms` each, optionally paced at real time like a microphone.
"""

from __future__ import annotations

import io
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from echoic.protos.v1 import transcriber_pb2 as pb

Encoding = pb.RecognitionConfig.AudioEncoding

ENCODINGS = {
    "auto": Encoding.ENCODING_UNSPECIFIED,
    "linear16": Encoding.LINEAR16,
    "wav": Encoding.WAV,
    "flac": Encoding.FLAC,
    "mulaw": Encoding.MULAW,
    "alaw": Encoding.ALAW,
    "ogg": Encoding.OGG_OPUS,
}


class AudioFileError(ValueError):
    """A file the client cannot read or decode; the message names the file."""


@dataclass(frozen=True)
class Payload:
    """Audio ready for a request: bytes plus what the config must say about them."""

    data: bytes
    encoding: int  # RecognitionConfig.AudioEncoding
    sample_rate: int = 0  # Hz; 0 = from the header (WAV, FLAC)
    channels: int = 0  # count; 0 = from the header, or 1 for LINEAR16


@dataclass(frozen=True)
class Chunk:
    data: bytes  # one request's audio_content
    seconds: float  # audio it holds, s (for real-time pacing)


def encoding_value(encoding: str | int | None) -> int:
    """'auto', 'linear16', 'wav', 'flac' (or the enum value itself) -> the enum value."""
    if encoding is None:
        return Encoding.ENCODING_UNSPECIFIED
    if isinstance(encoding, int):
        Encoding.Name(encoding)  # ValueError for a number that is not an encoding
        return encoding
    try:
        return ENCODINGS[encoding.lower()]
    except KeyError:
        raise ValueError(
            f"unknown encoding {encoding!r} (choose from {', '.join(ENCODINGS)})"
        ) from None


def sniff_container(head: bytes) -> int | None:
    """WAV or FLAC from the first bytes of a file; None for anything else."""
    if head[:4] in (b"RIFF", b"RIFX") and head[8:12] == b"WAVE":
        return Encoding.WAV
    if head[:4] == b"fLaC":
        return Encoding.FLAC
    return None


def _open(path: str | os.PathLike[str]) -> sf.SoundFile:
    try:
        return sf.SoundFile(os.fspath(path))
    except (sf.SoundFileError, RuntimeError) as e:
        reason = (getattr(e, "error_string", None) or str(e)).strip().rstrip(".")
        raise AudioFileError(f"{path}: cannot decode audio ({reason})") from e


def read_file(path: str | os.PathLike[str]) -> bytes:
    """A file's bytes; AudioFileError naming the file when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError as e:
        raise AudioFileError(f"{path}: no such audio file") from e
    except OSError as e:
        raise AudioFileError(f"{path}: cannot read audio file ({e.strerror or e})") from e


def file_payload(path: str | os.PathLike[str]) -> Payload:
    """A whole file as one request's audio: WAV/FLAC as they are; the rest (OGG, MP3,
    AIFF, ...) decoded here into a 32-bit float WAV at the file's own rate and channels:
    the samples the server would have decoded itself, so the transcript is the one
    `echoic transcribe` gives locally (PCM16 would round them, and a lossy file's
    transcript could change)."""
    data = read_file(path)
    container = sniff_container(data[:12])
    if container is not None:
        return Payload(data, container)
    with _open(path) as f:
        samples = f.read(dtype="float32", always_2d=True)  # (N, C), as the server reads
        rate = f.samplerate
    if not len(samples):
        raise AudioFileError(f"{path}: the audio has no samples (0 s long)")
    wav = io.BytesIO()
    sf.write(wav, samples, rate, format="WAV", subtype="FLOAT")
    return Payload(wav.getvalue(), Encoding.WAV)


def samples_payload(samples: np.ndarray, sample_rate: int) -> Payload:
    """Float samples in [-1, 1] or int16, (N,) or (N, C), as PCM16."""
    samples = np.asarray(samples)
    if samples.ndim not in (1, 2):
        raise ValueError(f"samples must have shape (N,) or (N, C), got {samples.shape}")
    if samples.dtype != np.int16:
        scaled = np.round(np.clip(samples.astype(np.float64), -1.0, 1.0) * 32767.0)
        samples = scaled.astype(np.int16)
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    return Payload(samples.astype("<i2").tobytes(), Encoding.LINEAR16, sample_rate, channels)


def pcm_chunks(path: str | os.PathLike[str], chunk_ms: float) -> tuple[Payload, Iterator[Chunk]]:
    """A file decoded to PCM16 chunks of `chunk_ms`; the Payload (no data) says the format."""
    if chunk_ms <= 0:
        raise ValueError(f"chunk_ms must be positive, got {chunk_ms}")
    f = _open(path)
    rate, channels = f.samplerate, f.channels
    frames = max(1, round(rate * chunk_ms / 1000))

    def chunks() -> Iterator[Chunk]:
        with f:
            for block in f.blocks(blocksize=frames, dtype="int16", always_2d=True):
                yield Chunk(block.tobytes(), len(block) / rate)

    return Payload(b"", Encoding.LINEAR16, rate, channels), chunks()


def file_chunks(
    path: str | os.PathLike[str], chunk_ms: float, encoding: str
) -> tuple[Payload, Iterator[Chunk]]:
    """A WAV or FLAC file's bytes as they are, cut into pieces of about `chunk_ms` of audio."""
    data = read_file(path)
    container = sniff_container(data[:12])
    if container != encoding_value(encoding):
        found = Encoding.Name(container).lower() if container else "neither WAV nor FLAC"
        raise AudioFileError(
            f"{path}: encoding {encoding!r} was asked for but the file is {found};"
            " send it decoded as PCM16 (linear16) instead"
        )
    with _open(path) as f:
        seconds = f.frames / f.samplerate if f.samplerate else 0.0
    pieces = max(1, math.ceil(seconds * 1000 / chunk_ms)) if seconds else 1
    step = max(1, math.ceil(len(data) / pieces))

    def chunks() -> Iterator[Chunk]:
        for start in range(0, len(data), step):
            piece = data[start : start + step]
            yield Chunk(piece, seconds * len(piece) / len(data))

    return Payload(b"", container), chunks()


def paced(chunks: Iterable[Chunk], *, clock=time.monotonic, sleep=time.sleep) -> Iterator[Chunk]:
    """Chunks at real time: each is released once the audio it holds has 'happened'.

    Like a microphone, chunk k (ending at t_k seconds into the audio) is released
    at start + t_k, so a stream of T seconds takes T seconds to send.
    """
    start, sent = clock(), 0.0
    for chunk in chunks:
        sent += chunk.seconds
        delay = start + sent - clock()
        if delay > 0:
            sleep(delay)
        yield chunk
