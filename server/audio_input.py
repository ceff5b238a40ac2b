"""Audio bytes of one request or stream in, float32 mono at the model's rate out, as they come.

`echoic.model.core.audio.decode_audio` decodes whole files; a stream needs samples
while its bytes are still arriving. `AudioInput` does that for the encodings a
live stream uses, with the same arithmetic as `decode_audio` (integer PCM scaled
by 2**(bits-1), channels averaged in float64, soxr HQ resampling, clipping to
[-1, 1]), so a stream's samples equal the decoded file's:

- LINEAR16: raw PCM16; a sample split across two messages is carried over.
- WAV: the RIFF header is parsed once it has arrived; integer (8, 16, 24, 32 bit)
  and float (32, 64 bit) PCM then stream. Other WAV codecs (mu-law, ADPCM, ...)
  are buffered and decoded by `decode_audio` at the end.
- FLAC (and the containers ENCODING_UNSPECIFIED detects besides WAV: OGG, MP3):
  buffered, decoded by `decode_audio` when the audio ends.

`max_seconds` holds for every encoding, as early as the audio allows: from the
WAV or FLAC header when it gives the length, as PCM samples arrive, and for
buffered audio while it is decoded (a block at a time, stopping at the limit):
`AudioTooLong`, before the rest is decoded.

Recognize goes through the same class (all bytes, then `finish()`), so a request
and a stream of the same bytes give the same samples. Errors are `AudioError`.
"""

from __future__ import annotations

import struct

import numpy as np

from echoic.model.core.audio import (
    ENCODINGS,
    AudioError,
    MonoResampler,
    check_channels,
    check_header_rate,
    check_length,
    check_rate,
    decode_audio,
    unknown_length,
)

_WAVE_PCM, _WAVE_FLOAT, _WAVE_EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
_PLACEHOLDER_SIZE = 0x7FFF0000  # a WAV data size from here on means "unknown", bytes
_MAX_HEADER_BYTES = 1 << 20  # a WAV whose samples have not begun after this is not streamable


def check_format(encoding: str, sample_rate: int | None, channels: int) -> None:
    """AudioError unless an `AudioInput` can read audio described so (the request's own
    description, before any audio: each door calls it on its config, as `AudioInput` does).
    The messages name the config fields (RecognitionConfig's)."""
    if encoding not in ENCODINGS:
        raise AudioError(f"unsupported encoding {encoding!r}")
    if encoding == "linear16" and sample_rate is None:
        raise AudioError(
            "LINEAR16 (raw PCM16) has no header: set sample_rate_hertz (e.g. 16000) in the config"
        )
    if sample_rate is not None:
        check_rate(sample_rate, "sample_rate_hertz")
    check_channels(channels, "audio_channel_count", "the channel count")


def _is_mp3(head: bytes) -> bool:
    """An ID3 tag, or an MPEG audio frame's 11-bit sync word."""
    return head[:3] == b"ID3" or (head[0] == 0xFF and head[1] & 0xE0 == 0xE0)


class AudioInput:
    """Decode one request's or stream's audio incrementally: `feed(bytes)`, then `finish()`."""

    def __init__(
        self,
        encoding: str,
        target_rate: int,
        *,
        sample_rate: int | None = None,
        channels: int = 1,
        name: str = "audio",
        max_seconds: float = 0.0,
    ) -> None:
        check_format(encoding, sample_rate, channels)
        self.encoding = encoding
        self.target_rate = target_rate
        self.name = name
        self.max_seconds = max_seconds  # longest audio accepted, s; 0 = no limit
        self._declared_rate = sample_rate
        self._channels = channels
        self._mode = "linear16" if encoding == "linear16" else "sniff"
        self._pending = b""  # bytes not yet turned into samples (or the whole buffered file)
        self._sample_bytes = 2
        self._sample_format = "int16"
        self._data_left: int | None = None  # WAV data-chunk bytes still to come; None: unbounded
        self._rate = sample_rate or 0
        self._to_model: MonoResampler | None = None
        self.source_samples = 0  # frames (per channel) decoded so far, at the source rate
        self.bytes_in = 0

    # ------------------------------------------------------------------ public

    @property
    def source_seconds(self) -> float:
        """Audio decoded so far, s (0 until the rate is known)."""
        return self.source_samples / self._rate if self._rate else 0.0

    @property
    def buffered(self) -> bool:
        """Whether the audio is decoded only at `finish()` (no samples before the end)."""
        return self._mode == "buffer"

    def feed(self, data: bytes) -> np.ndarray:
        """Take the next bytes; return the samples they complete (possibly none)."""
        self.bytes_in += len(data)
        self._pending += data
        if self._mode == "sniff":
            self._sniff()
        if self._mode == "flac-header":
            self._check_flac_header()
        if self._mode == "wav-header":
            self._parse_wav_header()
        if self._mode in ("linear16", "wav"):
            return self._decode_pcm(last=False)
        return _EMPTY

    def finish(self) -> np.ndarray:
        """The audio has ended: the remaining samples (flushes the resampler)."""
        if self.bytes_in == 0:
            raise AudioError(f"{self.name}: no audio data (0 bytes)")
        if self._mode in ("sniff", "wav-header", "flac-header"):
            self._mode = "buffer"  # too short to tell: let decode_audio say what is wrong
        if self._mode == "buffer":
            samples = decode_audio(
                self._pending,
                self.target_rate,
                encoding=self.encoding,
                sample_rate=self._declared_rate,
                name=self.name,
                max_seconds=self.max_seconds,
            )
            self._pending = b""
            self.source_samples = len(samples)
            self._rate = self.target_rate
            return samples
        if self._pending:
            raise AudioError(
                f"{self.name}: the audio ends inside a sample ({len(self._pending)} stray "
                f"bytes): send whole {self._sample_bytes * self._channels}-byte frames"
            )
        if self.source_samples == 0:
            raise AudioError(f"{self.name}: the audio has no samples (0 s long)")
        return self._decode_pcm(last=True)

    # ------------------------------------------------------------------ formats

    def _sniff(self) -> None:
        head = self._pending[:4]
        if len(head) < 4:
            return
        if head == b"RIFF":
            if self.encoding == "flac":
                raise AudioError(f"{self.name}: encoding FLAC was requested but the data is WAV")
            self._mode = "wav-header"
        elif head == b"fLaC":
            if self.encoding == "wav":
                raise AudioError(f"{self.name}: encoding WAV was requested but the data is FLAC")
            self._mode = "flac-header"
        elif self.encoding == "auto" and (head == b"OggS" or _is_mp3(head)):
            self._mode = "buffer"
        else:
            want = {"auto": "WAV or FLAC", "wav": "WAV", "flac": "FLAC"}[self.encoding]
            raise AudioError(
                f"{self.name}: cannot decode audio: expected {want} but the data starts with "
                f"{head!r}; for raw PCM16 without a header send encoding LINEAR16 and its "
                "sample_rate_hertz"
            )

    def _check_flac_header(self) -> None:
        """FLAC's STREAMINFO (the first metadata block, always): refuse a rate, channel
        count or length (when the encoder wrote it) out of bounds before buffering more."""
        info = self._pending[8:42]
        if len(info) < 34:
            return
        self._mode = "buffer"
        if self._pending[4] & 0x7F != 0 or self._pending[5:8] != b"\x00\x00\x22":
            return  # not a STREAMINFO block: decode_audio says what is wrong at the end
        rate = (info[10] << 12) | (info[11] << 4) | (info[12] >> 4)
        if rate == 0:
            return  # not a valid header either
        channels = ((info[12] >> 1) & 0x7) + 1
        total = ((info[13] & 0x0F) << 32) | int.from_bytes(info[14:18], "big")
        check_rate(rate, self.name)
        check_header_rate(self._declared_rate, rate, self.name)
        check_channels(channels, self.name)
        if total == 0:  # the encoder did not know the length
            raise unknown_length(self.name)
        check_length(total, rate, self.max_seconds, self.name, exact=True)

    def _parse_wav_header(self) -> None:
        buf = self._pending
        if len(buf) < 12:
            return
        if buf[8:12] != b"WAVE":
            raise AudioError(f"{self.name}: cannot decode audio: a RIFF file but not WAVE")
        pos, fmt = 12, None
        while pos + 8 <= len(buf):
            chunk_id, size = buf[pos : pos + 4], struct.unpack("<I", buf[pos + 4 : pos + 8])[0]
            body = pos + 8
            if chunk_id == b"data":
                if fmt is None:
                    raise AudioError(f"{self.name}: cannot decode audio: WAV data before 'fmt '")
                if self._start_wav(fmt, size):
                    self._pending = buf[body:]
                else:
                    self._mode = "buffer"  # a codec libsndfile may know: decode it at the end
                return
            if body + size + (size & 1) > len(buf):
                break  # the rest of this chunk has not arrived yet
            if chunk_id == b"fmt ":
                fmt = buf[body : body + size]
            pos = body + size + (size & 1)
        if len(buf) > _MAX_HEADER_BYTES:
            raise AudioError(f"{self.name}: cannot decode audio: no WAV data chunk found")

    def _start_wav(self, fmt: bytes, data_size: int) -> bool:
        """Set up streaming from the 'fmt ' chunk; False when its codec does not stream."""
        if len(fmt) < 16:
            raise AudioError(f"{self.name}: cannot decode audio: WAV 'fmt ' chunk too short")
        tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", fmt[:16])
        if tag == _WAVE_EXTENSIBLE and len(fmt) >= 26:
            tag = struct.unpack("<H", fmt[24:26])[0]  # the subformat GUID's first two bytes
        formats = {
            (_WAVE_PCM, 8): "uint8",
            (_WAVE_PCM, 16): "int16",
            (_WAVE_PCM, 24): "int24",
            (_WAVE_PCM, 32): "int32",
            (_WAVE_FLOAT, 32): "float32",
            (_WAVE_FLOAT, 64): "float64",
        }
        if (tag, bits) not in formats or channels < 1:
            return False
        check_channels(channels, self.name)
        check_rate(rate, self.name)
        check_header_rate(self._declared_rate, rate, self.name)
        self._mode = "wav"
        self._rate, self._channels = rate, channels
        self._sample_format, self._sample_bytes = formats[tag, bits], bits // 8
        # Writers that stream WAV leave the size at 0, 0xFFFFFFFF or a placeholder near
        # 2**31 (arecord to a pipe): read to the end then, and count as the audio comes.
        self._data_left = None if data_size == 0 or data_size >= _PLACEHOLDER_SIZE else data_size
        if self._data_left is not None:
            frames = self._data_left // (self._sample_bytes * channels)
            check_length(frames, rate, self.max_seconds, self.name, exact=True)
        return True

    def _decode_pcm(self, *, last: bool) -> np.ndarray:
        frame = self._sample_bytes * self._channels
        usable = len(self._pending) - len(self._pending) % frame
        if self._data_left is not None:
            usable = min(usable, self._data_left - self._data_left % frame)
        raw, rest = self._pending[:usable], self._pending[usable:]
        if self._data_left is not None:
            self._data_left -= usable
            if self._data_left < frame:
                rest = b""  # chunks after the data (LIST, ...) are not audio
        self._pending = rest
        frames = self.source_samples + len(raw) // frame
        check_length(frames, self._rate, self.max_seconds, self.name, exact=False)
        samples = _pcm_to_float(raw, self._sample_format, self._channels)  # (N, C)
        self.source_samples = frames
        if not np.isfinite(samples).all():
            raise AudioError(f"{self.name}: the audio contains NaN or infinite samples")
        if self._to_model is None:
            self._to_model = MonoResampler(self._rate, self.target_rate)
        return self._to_model(samples, last=last)


_EMPTY = np.zeros(0, dtype=np.float32)


def _pcm_to_float(raw: bytes, fmt: str, channels: int) -> np.ndarray:
    """Interleaved PCM bytes -> (N, C) float32 in [-1, 1], scaled as libsndfile scales."""
    if fmt == "int16":
        x = np.frombuffer(raw, "<i2").astype(np.float32) / np.float32(32768.0)
    elif fmt == "uint8":
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / np.float32(128.0)
    elif fmt == "int24":
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] << 8) | (b[:, 1] << 16) | (b[:, 2] << 24)).astype(np.float32)
        x /= np.float32(2.0**31)
    elif fmt == "int32":
        x = np.frombuffer(raw, "<i4").astype(np.float32) / np.float32(2.0**31)
    elif fmt == "float32":
        x = np.frombuffer(raw, "<f4").astype(np.float32)
    else:
        x = np.frombuffer(raw, "<f8").astype(np.float32)
    return x.reshape(-1, channels)
