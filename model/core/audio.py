"""Audio in: decode bytes or files to float32 mono at the model's sample rate.

Every path into the model (training manifests, `echoic transcribe`, the gRPC
server) goes through `decode_audio`, so a file decodes to the same bits wherever
it is read. Containers (WAV, FLAC, OGG, ...) are recognised by their header via
libsndfile; raw little-endian PCM16 ("linear16") carries no header, so its rate
and channel count come from the caller. Channels are averaged to mono and the
result is resampled with soxr when the rates differ.

Errors are `AudioError` (a `ValueError`) with a message that names the input and
says what to change; the server maps them to INVALID_ARGUMENT as they are.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

MIN_RATE = 8000  # Hz, lowest sample rate accepted (narrowband telephony)
MAX_RATE = 192000  # Hz, highest sample rate accepted
MAX_CHANNELS = 255  # channels of any audio accepted, count
ENCODINGS = ("auto", "wav", "flac", "ogg", "linear16", "mulaw", "alaw")
# Raw encodings: no header, so the caller gives the rate and channel count.
RAW_ENCODINGS = ("linear16", "mulaw", "alaw")

# libsndfile format names each explicit encoding accepts.
_CONTAINER_FORMATS = {
    "wav": ("WAV", "WAVEX", "RF64", "W64"),
    "flac": ("FLAC",),
    "ogg": ("OGG",),  # Ogg Opus (browsers' MediaRecorder, phones) and Ogg Vorbis
}
_G711_SUBTYPES = {"mulaw": "ULAW", "alaw": "ALAW"}
_g711_tables: dict[str, np.ndarray] = {}


def g711_table(law: str) -> np.ndarray:
    """The 256 float32 values of G.711 mu-law ("mulaw") or A-law ("alaw") bytes, as
    libsndfile decodes them, so raw bytes, WAV files and streams decode to the same bits."""
    if law not in _g711_tables:
        every_byte = io.BytesIO(bytes(range(256)))
        table, _ = sf.read(
            every_byte, dtype="float32", format="RAW", subtype=_G711_SUBTYPES[law],
            samplerate=8000, channels=1,
        )  # fmt: skip
        _g711_tables[law] = table
    return _g711_tables[law]


class AudioError(ValueError):
    """Audio that cannot be decoded or used; the message names the input and the fix."""


class AudioTooLong(AudioError):
    """Audio longer than the caller's limit, found from its header or while decoding it,
    before the rest is decoded."""

    def __init__(self, name: str, seconds: float, limit: float, *, exact: bool) -> None:
        self.seconds = seconds  # the length, or how much was decoded before it stopped, s
        self.limit = limit  # the limit it went over, s
        self.exact = exact  # `seconds` is the whole length (from a header)
        super().__init__(f"{name}: the audio is {self.length}, over the limit of {limit:g} s")

    @property
    def length(self) -> str:
        """ "12.3 s long", or "longer than 12.3 s" when it stopped decoding there."""
        return f"{self.seconds:.1f} s long" if self.exact else f"longer than {self.seconds:.1f} s"


class DecodeTooSlow(AudioError):
    """Decoding took longer than the caller's time limit; it stopped there."""

    def __init__(self, name: str, limit: float) -> None:
        self.limit = limit  # s
        super().__init__(f"{name}: decoding the audio took over {limit:g} s")


def check_length(frames: int, rate: int, limit: float, name: str, *, exact: bool) -> None:
    """AudioTooLong when `frames` at `rate` Hz are more than `limit` s (0 = no limit)."""
    if limit and frames > limit * rate:
        raise AudioTooLong(name, frames / rate, limit, exact=exact)


def check_rate(rate: int, name: str, what: str = "sample rate") -> None:
    """AudioError naming `name` unless `rate` is a whole number of Hz we accept."""
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)):
        raise AudioError(f"{name}: {what} must be an integer number of Hz, got {rate!r}")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioError(
            f"{name}: unsupported {what} {rate} Hz (supported: {MIN_RATE}-{MAX_RATE} Hz, "
            "e.g. 8000, 16000, 22050, 44100 or 48000)"
        )


def check_header_rate(declared: int | None, rate: int, name: str) -> None:
    """AudioError when the caller declared a rate that a file's header contradicts."""
    if declared is not None and declared != rate:
        raise AudioError(
            f"{name}: sample rate {declared} Hz was given but the header says {rate} Hz; "
            "leave the rate unset (sample_rate_hertz 0) for WAV/FLAC or send the matching rate"
        )


def check_channels(channels: int, name: str, what: str = "channels") -> None:
    """AudioError naming `name` unless `channels` is a channel count we accept."""
    if isinstance(channels, bool) or not isinstance(channels, (int, np.integer)):
        raise AudioError(f"{name}: {what} must be an integer, got {channels!r}")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(f"{name}: {what} must be 1-{MAX_CHANNELS}, got {channels}")


def _libsndfile_reason(err: Exception) -> str:
    # LibsndfileError's str() embeds the repr of the BytesIO; keep only the reason.
    reason = getattr(err, "error_string", None) or str(err)
    return reason.strip().rstrip(".")


_BLOCK_FRAMES = 1 << 16  # frames a container is decoded by at a time, per channel
_UNKNOWN_FRAMES = 1 << 62  # libsndfile's frame count for a stream of unknown length is more


def _container_blocks(
    f: sf.SoundFile,
    encoding: str,
    sample_rate: int | None,
    target_rate: int,
    max_seconds: float,
    name: str,
    time_limit: float = 0.0,
) -> Iterator[np.ndarray]:
    """An open container's audio as float32 mono blocks at `target_rate` (closed at the
    end, or when the generator is closed): the same blocks, so the same samples, whether
    they are joined or used one by one. DecodeTooSlow once decoding has taken `time_limit`
    s (0 = no limit): the time spent in here, not the time a consumer spends between two
    blocks (a server recognizes each window before it decodes the next), checked after
    each block's read: this bounds the blocks decoded after the limit (none), not the
    time to the millisecond."""
    spent = 0.0  # s spent decoding so far
    with f:
        allowed = _CONTAINER_FORMATS.get(encoding)
        if allowed is not None and f.format not in allowed:
            raise AudioError(
                f"{name}: encoding {encoding!r} was requested but the data is {f.format}; "
                "send encoding 'auto' to accept any container"
            )
        rate = f.samplerate
        check_rate(rate, name)
        check_header_rate(sample_rate, rate, name)
        check_channels(f.channels, name)
        if f.frames >= _UNKNOWN_FRAMES:
            raise unknown_length(name)
        check_length(f.frames, rate, max_seconds, name, exact=True)
        to_model = MonoResampler(rate, target_rate)
        frames = 0
        while True:
            started = time.monotonic()
            try:
                block = f.read(_BLOCK_FRAMES, dtype="float32", always_2d=True)  # (b, C)
            except (sf.SoundFileError, RuntimeError) as e:
                raise _undecodable(e, encoding, name) from e
            if not len(block):
                break
            if time_limit and spent + time.monotonic() - started > time_limit:
                raise DecodeTooSlow(name, time_limit)
            frames += len(block)
            check_length(frames, rate, max_seconds, name, exact=False)
            if not np.isfinite(block).all():
                raise AudioError(f"{name}: the audio contains NaN or infinite samples")
            samples = to_model(block)
            spent += time.monotonic() - started
            yield samples
    if frames == 0:
        raise AudioError(f"{name}: the audio has no samples (0 s long)")
    yield to_model(np.zeros((0, 1), np.float32), last=True)


def audio_blocks(path: str | os.PathLike[str], target_rate: int) -> Iterator[np.ndarray]:
    """A file's audio as float32 mono blocks at `target_rate`, read from disk a block at
    a time (memory does not grow with the file's length); joined, the blocks are
    `load_audio(path, target_rate)`. Errors name the path, as `load_audio`'s do."""
    check_rate(target_rate, str(path), "target sample rate")
    if not Path(path).is_file():
        raise AudioError(f"{path}: no such audio file")
    try:
        f = sf.SoundFile(os.fspath(path))
    except (sf.SoundFileError, RuntimeError) as e:
        raise _undecodable(e, "auto", str(path)) from e
    yield from _container_blocks(f, "auto", None, target_rate, 0.0, str(path))


def unknown_length(name: str) -> AudioError:
    """The error for a FLAC whose header does not give its length: libsndfile fails at
    the end of such a stream, after decoding most of it."""
    return AudioError(
        f"{name}: the FLAC header does not give the audio's length (total samples 0, as a "
        "live encoder writes it), and such a stream cannot be decoded to its end: send the "
        "finished file, or stream WAV or LINEAR16"
    )


def _undecodable(e: Exception, encoding: str, name: str) -> AudioError:
    hint = (
        "; if it is raw PCM16 without a header, send encoding 'linear16' with its sample rate"
        if encoding == "auto"
        else ""
    )
    return AudioError(
        f"{name}: cannot decode audio ({_libsndfile_reason(e)}): expected WAV, FLAC or OGG{hint}"
    )


class MonoResampler:
    """(N, C) blocks in, float32 mono at the model's rate out, block by block: channels
    averaged in float64, soxr HQ resampling as a stream (the same samples as resampling
    the whole signal at once), clipped to [-1, 1]. `decode_audio` and the server's
    incremental `AudioInput` both go through it, so their samples are equal."""

    def __init__(self, rate: int, target_rate: int) -> None:
        self._stream = (
            soxr.ResampleStream(rate, target_rate, 1, dtype="float32", quality="HQ")
            if rate != target_rate
            else None
        )

    def __call__(self, block: np.ndarray, *, last: bool = False) -> np.ndarray:
        """The mono samples at the model's rate that `block` (N, C) completes; `last`
        flushes the resampler (the block may be empty then)."""
        if block.shape[1] == 1 and block.dtype == np.float32:
            # one channel's mean is itself, bit for bit (+0.0: as the mean turns -0.0 into
            # 0.0), without the float64 copies
            mono = block[:, 0] + np.float32(0.0)
        else:
            mono = np.asarray(block, dtype=np.float64).mean(axis=1).astype(np.float32)  # (N,)
        if self._stream is not None:
            mono = self._stream.resample_chunk(mono, last=last).astype(np.float32, copy=False)
        # Float containers and resampling overshoot can leave [-1, 1]; the contract is [-1, 1].
        return np.ascontiguousarray(np.clip(mono, -1.0, 1.0))


_RAW_NAMES = {"linear16": "raw PCM16 (linear16)", "mulaw": "raw mu-law", "alaw": "raw A-law"}


def _raw_blocks(
    data: bytes,
    encoding: str,
    sample_rate: int | None,
    target_rate: int,
    channels: int,
    max_seconds: float,
    name: str,
) -> Iterator[np.ndarray]:
    """Raw bytes' audio as float32 mono blocks at `target_rate`, each block converted from
    a slice of `data` (a view, not a copy), after the length is checked from the size."""
    what = _RAW_NAMES[encoding]
    if sample_rate is None:
        raise AudioError(f"{name}: {what} has no header; give its sample rate")
    check_channels(channels, name)
    frame_bytes = (2 if encoding == "linear16" else 1) * channels
    if len(data) % frame_bytes:
        raise AudioError(
            f"{name}: {what} with {channels} channel(s) needs a multiple of {frame_bytes} "
            f"bytes, got {len(data)} (truncated, or another encoding)"
        )
    check_length(len(data) // frame_bytes, sample_rate, max_seconds, name, exact=True)
    to_model = MonoResampler(sample_rate, target_rate)
    view, step = memoryview(data), _BLOCK_FRAMES * frame_bytes
    for start in range(0, len(data), step):
        block = raw_to_float(view[start : start + step], encoding).reshape(-1, channels)
        yield to_model(block)  # (b, C) in
    yield to_model(np.zeros((0, channels), np.float32), last=True)


def raw_to_float(data: bytes, encoding: str) -> np.ndarray:
    """Raw samples (interleaved) as float32 in [-1, 1]: PCM16 scaled by 2**15, G.711
    through libsndfile's table."""
    if encoding == "linear16":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(32768.0)
    return g711_table(encoding)[np.frombuffer(data, dtype=np.uint8)]


def decode_audio(
    data: bytes,
    target_rate: int,
    *,
    encoding: str = "auto",
    sample_rate: int | None = None,
    channels: int = 1,
    name: str = "<bytes>",
    max_seconds: float = 0.0,
    time_limit: float = 0.0,
) -> np.ndarray:
    """Decode `data` to float32 mono in [-1, 1] at `target_rate` Hz: `decode_blocks`'
    blocks, joined.

    encoding: "auto" (container detected from its header), "wav", "flac", "ogg" (the
    header must say so), or a raw encoding that needs `sample_rate` and is interleaved
    when `channels` > 1: "linear16" (little-endian PCM16), "mulaw" or "alaw" (G.711).
    For containers, a `sample_rate` that disagrees with the header is an error rather
    than silently ignored. Audio longer
    than `max_seconds` (0 = no limit) raises AudioTooLong as soon as that is known:
    from the header, or once that much has been decoded; a container that takes more than
    `time_limit` s (0 = no limit) to decode raises DecodeTooSlow.
    """
    blocks = decode_blocks(data, target_rate, encoding=encoding, sample_rate=sample_rate,
                           channels=channels, name=name, max_seconds=max_seconds,
                           time_limit=time_limit)  # fmt: skip
    return np.concatenate(list(blocks))


def decode_blocks(
    data: bytes,
    target_rate: int,
    *,
    encoding: str = "auto",
    sample_rate: int | None = None,
    channels: int = 1,
    name: str = "<bytes>",
    max_seconds: float = 0.0,
    time_limit: float = 0.0,
) -> Iterator[np.ndarray]:
    """`decode_audio(data, ...)` a block at a time (its arguments, its errors, raised when
    the block they concern is reached): memory holds `data` and one block, some 65536
    frames of the source, whatever the audio's length. Joined, the blocks are exactly
    `decode_audio`'s samples. Pass `bytes` (another buffer is copied once)."""
    if encoding not in ENCODINGS:
        raise AudioError(
            f"{name}: unsupported encoding {encoding!r} (supported: {', '.join(ENCODINGS)})"
        )
    check_rate(target_rate, name, "target sample rate")
    if sample_rate is not None:
        check_rate(sample_rate, name)
    data = bytes(data)
    if not data:
        raise AudioError(f"{name}: no audio data (0 bytes)")
    if encoding in RAW_ENCODINGS:
        yield from _raw_blocks(data, encoding, sample_rate, target_rate, channels,
                               max_seconds, name)  # fmt: skip
        return
    # From memory, every byte present: libsndfile's open never waits for more, so the
    # lock python-soundfile holds around every open is held only for this one's work.
    try:
        f = sf.SoundFile(io.BytesIO(data))
    except (sf.SoundFileError, RuntimeError) as e:
        raise _undecodable(e, encoding, name) from e
    yield from _container_blocks(f, encoding, sample_rate, target_rate, max_seconds, name,
                                 time_limit)  # fmt: skip


def load_audio(
    path: str | os.PathLike[str],
    target_rate: int,
    *,
    encoding: str = "auto",
    sample_rate: int | None = None,
    channels: int = 1,
) -> np.ndarray:
    """Read and decode an audio file; see `decode_audio`. Errors name the path."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError as e:
        raise AudioError(f"{path}: no such audio file") from e
    except OSError as e:
        raise AudioError(f"{path}: cannot read audio file ({e.strerror or e})") from e
    return decode_audio(
        data,
        target_rate,
        encoding=encoding,
        sample_rate=sample_rate,
        channels=channels,
        name=str(path),
    )


def audio_duration(path: str | os.PathLike[str]) -> float:
    """Duration in seconds from the file header (nothing is decoded)."""
    if not Path(path).is_file():
        raise AudioError(f"{path}: no such audio file")
    try:
        info = sf.info(os.fspath(path))
    except (sf.SoundFileError, RuntimeError) as e:
        raise AudioError(f"{path}: cannot read audio header ({_libsndfile_reason(e)})") from e
    if info.samplerate <= 0:
        raise AudioError(f"{path}: the header gives no sample rate")
    return info.frames / info.samplerate


def truncation(path: str | os.PathLike[str]) -> str | None:
    """A warning when a WAV file holds less audio than its header says (a copy or a
    recording cut short); None when it is whole or not a WAV. libsndfile reads such a
    file without complaint, as the shorter audio it holds."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
                return None
            size, rate, block = os.fstat(f.fileno()).st_size, 0, 0
            while len(chunk := f.read(8)) == 8:
                name, length = chunk[:4], int.from_bytes(chunk[4:], "little")
                if name == b"fmt ":
                    fmt = f.read(length + (length & 1))
                    rate = int.from_bytes(fmt[4:8], "little")  # Hz
                    block = int.from_bytes(fmt[12:14], "little")  # bytes per frame
                elif name == b"data":
                    held = size - f.tell()
                    if length >= 0x7FFF0000 or held >= length or not rate or not block:
                        return None  # whole, or a live writer's "unknown length"
                    said, has = length / block / rate, held / block / rate
                    return (
                        f"{path}: the file ends early: its header says {said:.2f} s of audio,"
                        f" it holds {has:.2f} s (transcribed as it is)"
                    )
                else:
                    f.seek(length + (length & 1), os.SEEK_CUR)
    except OSError:
        return None
    return None


def write_wav(path: str | os.PathLike[str], samples: np.ndarray, rate: int) -> None:
    """Write float samples in [-1, 1] (or int16) as a PCM16 WAV; (N,) or (N, C)."""
    check_rate(rate, str(path))
    samples = np.asarray(samples)
    if samples.ndim not in (1, 2):
        raise ValueError(f"samples must have shape (N,) or (N, C), got {samples.shape}")
    if samples.dtype != np.int16:
        if not np.issubdtype(samples.dtype, np.floating):
            raise TypeError(f"samples must be float in [-1, 1] or int16, got {samples.dtype}")
        # Quantise here, not in libsndfile, so the bits are the same everywhere.
        scaled = np.round(np.clip(samples.astype(np.float64), -1.0, 1.0) * 32767.0)
        samples = scaled.astype(np.int16)
    sf.write(os.fspath(path), samples, rate, subtype="PCM_16", format="WAV")
