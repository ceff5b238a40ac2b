"""Audio bytes of one request or stream in, float32 mono at the model's rate out, as they come.

`echoic.model.core.audio.decode_audio` decodes whole files; a stream needs samples
while its bytes are still arriving. `AudioInput` does that for the encodings a
live stream uses, with the same arithmetic as `decode_audio` (integer PCM scaled
by 2**(bits-1), channels averaged in float64, soxr HQ resampling, clipping to
[-1, 1]), so a stream's samples equal the decoded file's:

- LINEAR16, MULAW, ALAW: raw PCM16 or G.711 bytes (telephony, 8 kHz); a sample
  split across two messages is carried over.
- WAV: the RIFF header is parsed once it has arrived; integer (8, 16, 24, 32 bit),
  float (32, 64 bit) and G.711 (mu-law, A-law) samples then stream. Other WAV
  codecs (ADPCM, ...) are buffered and decoded by `decode_blocks` at the end.
- FLAC and OGG (Opus or Vorbis): decoded as they arrive by libsndfile in a thread of
  its own (`_StreamDecoder`), reading from a pipe that `feed` fills, so their streams
  get interim results like PCM; memory holds the bytes not yet decoded, not the stream.
  FLAC reads a pipe that pretends to seek (`_Pipe`: libsndfile's FLAC reader refuses a
  file it cannot seek); Ogg reads a real OS pipe (`_FdPipe`: on a file it can seek,
  libsndfile's Ogg reader first seeks to the end to find the last page, which a stream
  does not have yet; on a pipe it reads page by page). The Ogg page framing is followed
  as the bytes pass (`_OggPages`), so a stream cut inside a page, or bytes that are not
  Ogg pages, are refused by name (libsndfile decodes what it can of both, silently).
- MP3 (ENCODING_UNSPECIFIED detects it): buffered, decoded by `decode_blocks` when the
  audio ends.

`max_seconds` holds for every encoding, as early as the audio allows: from the
WAV or FLAC header when it gives the length, as PCM, FLAC or Ogg samples arrive, and
for buffered audio while it is decoded (a block at a time, stopping at the limit):
`AudioTooLong`, before the rest is decoded.

A whole file (Recognize, an HTTP upload) goes through the same class, all its bytes at
once (`whole_blocks`), with the same header checks, and comes out a block at a time, so
that a request holds its bytes and a block of samples, never the whole file's samples
(a 60-minute 48 kHz Ogg is 1.9 MB, and 690 MB of float32 at its own rate): WAV and raw
bytes are fed `_WHOLE_SLICE_BYTES` at a time; FLAC, Ogg and MP3 are decoded from memory by
`echoic.model.core.audio.decode_blocks` rather than through a pipe, so nothing waits for
bytes that will not come (a truncated upload ends at its last byte, and no thread is left
reading).
Errors are `AudioError`. `close()` frees what an input holds (a FLAC or Ogg decoder's
threads and pipe) when a call ends early; an error from `feed` or `finish` closes it too.
"""

from __future__ import annotations

import fcntl
import io
import os
import queue
import struct
import sys
import termios
import threading
from collections.abc import Iterator

import numpy as np
import soundfile as sf

from echoic.model.core.audio import (
    ENCODINGS,
    RAW_ENCODINGS,
    AudioError,
    MonoResampler,
    check_channels,
    check_header_rate,
    check_length,
    check_rate,
    decode_blocks,
    raw_to_float,
    unknown_length,
)

_WAVE_PCM, _WAVE_FLOAT, _WAVE_ALAW, _WAVE_MULAW = 0x0001, 0x0003, 0x0006, 0x0007
_WAVE_EXTENSIBLE = 0xFFFE
_PLACEHOLDER_SIZE = 0x7FFF0000  # a WAV data size from here on means "unknown", bytes
_MAX_HEADER_BYTES = 1 << 20  # a WAV whose samples have not begun after this is not streamable
# bytes of a whole WAV or raw file decoded at a time (`whole_blocks`): 8 s of 16 kHz PCM16,
# 33 s of 8 kHz mu-law (66 s of samples at 16 kHz, 4 MB of float32)
_WHOLE_SLICE_BYTES = 1 << 18


def check_format(encoding: str, sample_rate: int | None, channels: int) -> None:
    """AudioError unless an `AudioInput` can read audio described so (the request's own
    description, before any audio: each door calls it on its config, as `AudioInput` does).
    The messages name the config fields (RecognitionConfig's)."""
    if encoding not in ENCODINGS:
        raise AudioError(f"unsupported encoding {encoding!r}")
    if encoding in RAW_ENCODINGS and sample_rate is None:
        what = {"linear16": "LINEAR16 (raw PCM16)", "mulaw": "MULAW (raw G.711 mu-law)",
                "alaw": "ALAW (raw G.711 A-law)"}[encoding]  # fmt: skip
        example = "16000" if encoding == "linear16" else "8000"
        raise AudioError(
            f"{what} has no header: set sample_rate_hertz (e.g. {example}) in the config"
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
        time_limit: float = 0.0,
    ) -> None:
        check_format(encoding, sample_rate, channels)
        self.encoding = encoding
        self.target_rate = target_rate
        self.name = name
        self.max_seconds = max_seconds  # longest audio accepted, s; 0 = no limit
        self._declared_rate = sample_rate
        self._channels = channels
        self._mode = "raw" if encoding in RAW_ENCODINGS else "sniff"
        # bytes not yet turned into samples (or the whole buffered file): a bytearray, which
        # grows in place, so a file buffered a message at a time is not copied per message
        self._pending = bytearray()
        self._whole = False  # all the bytes are here at once (whole_blocks)
        # s decoding a buffered container (a whole file, MP3) may take, from memory, before
        # DecodeTooSlow; 0 = no limit
        self.time_limit = time_limit
        g711 = encoding in ("mulaw", "alaw")  # one byte a sample
        self._sample_bytes = 1 if g711 else 2
        self._sample_format = encoding if g711 else "int16"
        self._data_left: int | None = None  # WAV data-chunk bytes still to come; None: unbounded
        self._rate = sample_rate or 0
        self._to_model: MonoResampler | None = None
        self.source_samples = 0  # frames (per channel) decoded so far, at the source rate
        self.bytes_in = 0
        self._decoder: _StreamDecoder | None = None  # FLAC's or Ogg's
        self._ogg_pages: _OggPages | None = None

    # ------------------------------------------------------------------ public

    @property
    def source_seconds(self) -> float:
        """Audio decoded so far, s (0 until the rate is known)."""
        return self.source_samples / self._rate if self._rate else 0.0

    @property
    def buffered(self) -> bool:
        """Whether the audio is decoded only at `finish()` (no samples before the end)."""
        return self._mode == "buffer"

    @property
    def undecoded_bytes(self) -> int:
        """Bytes held that are not decoded yet: a buffered container's, or a FLAC or Ogg
        stream's that its decoder has not reached (a client sending faster than it decodes)."""
        if self._mode == "buffer":
            return self.bytes_in
        return self._decoder.backlog if self._decoder is not None else 0

    def decode_whole(self, data: bytes) -> np.ndarray:
        """All of a file's bytes at once: its samples (`whole_blocks`, joined)."""
        return np.concatenate(list(self.whole_blocks(data)))

    def whole_blocks(
        self, data: bytes, *, slice_bytes: int = _WHOLE_SLICE_BYTES
    ) -> Iterator[np.ndarray]:
        """All of a file's bytes at once (Recognize, an HTTP upload): its samples a block
        at a time, as `feed(data)` then `finish()` give them, each block decoded when it
        is asked for; memory holds `data` and a block. FLAC, Ogg and MP3 are decoded from
        memory (`decode_blocks`): no thread and no pipe, and libsndfile never waits for
        bytes. The header's checks (and the length of raw bytes) come with the first block;
        an error in the audio, with the block it is in. slice_bytes: of WAV or raw bytes
        fed at a time."""
        if self.bytes_in:
            raise RuntimeError("whole_blocks takes all the bytes: this input was fed already")
        self._whole = True
        view = memoryview(data)
        if self._mode == "raw":  # the length is known from the size, before any decoding
            frames = len(view) // (self._sample_bytes * self._channels)
            check_length(frames, self._rate, self.max_seconds, self.name, exact=True)
        for start in range(0, len(view), slice_bytes):
            samples = self.feed(view[start : start + slice_bytes])
            if self._mode == "buffer":
                break  # a container for libsndfile: decoded from `data`, not fed
            if len(samples):
                yield samples
        if self._mode in ("raw", "wav"):
            yield self.finish()
            return
        self._pending, self.bytes_in = bytearray(), len(view)
        yield from self._buffered_blocks(data)

    def _buffered_blocks(self, data: bytes) -> Iterator[np.ndarray]:
        """A buffered container's samples (FLAC, Ogg, MP3 or a WAV codec that does not
        stream), decoded from `data` in memory a block at a time; also what says what is
        wrong with bytes too short to tell their format."""
        if self._ogg_pages is not None:  # a whole Ogg file: its page framing first
            self._ogg_pages.feed(data)
            self._ogg_pages.end()
        self._rate = self.target_rate  # source_samples counts the decoded samples
        blocks = decode_blocks(data, self.target_rate, encoding=self.encoding,
                               sample_rate=self._declared_rate, name=self.name,
                               max_seconds=self.max_seconds,
                               time_limit=self.time_limit)  # fmt: skip
        for samples in blocks:
            self.source_samples += len(samples)
            yield samples

    def feed(self, data: bytes) -> np.ndarray:
        """Take the next bytes; return the samples they complete (possibly none)."""
        try:
            return self._feed(data)
        except BaseException:
            self.close()  # a decoder's pipe and threads end with the error
            raise

    def _feed(self, data: bytes) -> np.ndarray:
        self.bytes_in += len(data)
        self._pending += data
        if self._mode == "sniff":
            self._sniff()
        if self._mode == "flac-header":
            self._check_flac_header()
        if self._mode == "wav-header":
            self._parse_wav_header()
        if self._mode in ("raw", "wav"):
            return self._decode_pcm(last=False)
        if self._mode in ("flac", "ogg"):
            if self._ogg_pages is not None:
                self._ogg_pages.feed(self._pending)
            self._decoder.feed(bytes(self._pending))
            self._pending.clear()
            return self._from_decoder(last=False)
        return _EMPTY

    def close(self) -> None:
        """Stop decoding (a call that ended early); safe to call more than once."""
        if self._decoder is not None:
            self._decoder.close()

    def finish(self) -> np.ndarray:
        """The audio has ended: the remaining samples (flushes the resampler)."""
        try:
            return self._finish()
        except BaseException:
            self.close()  # e.g. a truncated Ogg: its decoder must not wait for the rest
            raise

    def _finish(self) -> np.ndarray:
        if self.bytes_in == 0:
            raise AudioError(f"{self.name}: no audio data (0 bytes)")
        if self._mode in ("flac", "ogg"):
            if self._ogg_pages is not None:
                self._ogg_pages.end()
            self._decoder.finish()
            return self._from_decoder(last=True)
        if self._mode in ("sniff", "wav-header", "flac-header"):
            self._mode = "buffer"  # too short to tell: let decode_blocks say what is wrong
        if self._mode == "buffer":
            data, self._pending = bytes(self._pending), bytearray()
            return np.concatenate(list(self._buffered_blocks(data)))
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
        head = bytes(self._pending[:4])
        if len(head) < 4:
            return
        found = {b"RIFF": "wav", b"fLaC": "flac", b"OggS": "ogg"}.get(head)
        if found is not None and self.encoding not in ("auto", found):
            raise AudioError(
                f"{self.name}: encoding {self.encoding.upper()} was requested but the data is "
                f"{found.upper()}"
            )
        if found == "wav":
            self._mode = "wav-header"
        elif found == "flac":
            self._mode = "flac-header"
        elif found == "ogg":
            self._ogg_pages = _OggPages(self.name)
            if self._whole:
                self._mode = "buffer"  # decoded from memory at the end
            else:
                self._mode = "ogg"  # the rate and channels come from the decoder
                self._decoder = _StreamDecoder(self.name, "Ogg", _FdPipe())
        elif self.encoding == "auto" and _is_mp3(head):
            self._mode = "buffer"
        else:
            want = {"auto": "WAV, FLAC, OGG or MP3", "wav": "WAV", "flac": "FLAC", "ogg": "OGG"}
            want = want[self.encoding]
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
            return  # not a STREAMINFO block: decode_blocks says what is wrong at the end
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
        if self._whole:
            return  # decoded from memory at the end, as "buffer"
        self._mode, self._rate = "flac", rate
        self._decoder = _StreamDecoder(self.name, "FLAC", _Pipe())

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
            (_WAVE_ALAW, 8): "alaw",
            (_WAVE_MULAW, 8): "mulaw",
        }
        if (tag, bits) not in formats or channels < 1:
            return False
        check_channels(channels, self.name)
        check_rate(rate, self.name)
        check_header_rate(self._declared_rate, rate, self.name)
        self._mode = "wav"
        self._rate, self._channels = rate, channels
        self._sample_format, self._sample_bytes = formats[tag, bits], (bits + 7) // 8
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
        # a view, not a copy, of what is decoded now (a whole file's samples, at most)
        raw, rest = memoryview(self._pending)[:usable], self._pending[usable:]
        if self._data_left is not None:
            self._data_left -= usable
            if self._data_left < frame:
                rest = bytearray()  # chunks after the data (LIST, ...) are not audio
        self._pending = rest
        frames = self.source_samples + len(raw) // frame
        check_length(frames, self._rate, self.max_seconds, self.name, exact=False)
        samples = _pcm_to_float(raw, self._sample_format, self._channels)  # (N, C)
        self.source_samples = frames
        if self._sample_format in _FLOATS and not np.isfinite(samples).all():
            raise AudioError(f"{self.name}: the audio contains NaN or infinite samples")
        if self._to_model is None:
            self._to_model = MonoResampler(self._rate, self.target_rate)
        return self._to_model(samples, last=last)

    def _from_decoder(self, *, last: bool) -> np.ndarray:
        """The samples the FLAC or Ogg decoder has ready (all of them with `last`), as mono
        at the model's rate, with the length limit checked as they come."""
        blocks = self._decoder.take(wait=last)
        if self._rate == 0 and self._decoder.format is not None:
            rate, channels = self._decoder.format  # an Ogg header, as libsndfile read it
            check_rate(rate, self.name)
            check_header_rate(self._declared_rate, rate, self.name)
            check_channels(channels, self.name)
            self._rate = rate
        if not blocks and not last:
            return _EMPTY
        if self._to_model is None:
            self._to_model = MonoResampler(self._rate, self.target_rate)
        out = []
        for block in blocks:
            self.source_samples += len(block)
            check_length(self.source_samples, self._rate, self.max_seconds, self.name, exact=False)
            if not np.isfinite(block).all():
                raise AudioError(f"{self.name}: the audio contains NaN or infinite samples")
            out.append(self._to_model(block))
        if last:
            if self.source_samples == 0:
                raise AudioError(f"{self.name}: the audio has no samples (0 s long)")
            out.append(self._to_model(np.zeros((0, 1), np.float32), last=True))
        return np.concatenate(out) if out else _EMPTY


_EMPTY = np.zeros(0, dtype=np.float32)
_FLOATS = ("float32", "float64")  # the PCM formats that can hold NaN or infinity
_DECODER_BLOCK = 4096  # frames a FLAC or Ogg decoder hands over at a time, per channel
_STALL = 120.0  # s a FLAC or Ogg decoder waits for bytes before giving up (a leaked stream)


class _Pipe(io.RawIOBase):
    """Bytes written by one thread (`write_bytes`, `close_writing`) and read by libsndfile
    in another, which blocks until enough have come. Its length is unknown: seeking to
    the end says "very far", which is all libsndfile asks of it before decoding FLAC."""

    _FAR = 1 << 40
    _KEEP = 1 << 18  # bytes kept behind the read position: libsndfile reads ahead 8 KiB
    # at a time and seeks back to where its decoder stopped

    def __init__(self) -> None:
        super().__init__()
        self._buf = bytearray()
        self._base = 0  # stream offset of _buf[0]: bytes read are dropped
        self._pos = 0
        self._done = False  # no more bytes will come
        self._cond = threading.Condition()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write_bytes(self, data: bytes) -> None:
        with self._cond:
            self._buf += data
            self._cond.notify_all()

    def close_writing(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def readinto(self, target) -> int:  # noqa: ANN001 - a buffer from cffi
        want = len(target)
        with self._cond:
            while self._base + len(self._buf) - self._pos < want and not self._done:
                if not self._cond.wait(timeout=_STALL):
                    self._done = True  # nobody feeds it any more: end here
            start = self._pos - self._base
            data = bytes(self._buf[start : start + want])
            self._pos += len(data)
            if self._pos - self._base > 2 * self._KEEP:  # drop what was read long ago
                drop = self._pos - self._base - self._KEEP
                del self._buf[:drop]
                self._base += drop
        target[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._pos

    @property
    def unread(self) -> int:
        """Bytes written and not yet read."""
        with self._cond:
            return max(self._base + len(self._buf) - self._pos, 0)

    def seek(self, offset: int, whence: int = 0) -> int:
        target = {0: offset, 1: self._pos + offset}.get(whence, self._FAR)
        if target < self._base:
            raise OSError("cannot seek back into bytes already decoded")
        self._pos = target
        return self._pos


class _FdPipe:
    """Bytes written by one thread (`write_bytes`, `close_writing`) and read by libsndfile
    in another through an OS pipe (`read_fd`), which libsndfile knows it cannot seek: its
    Ogg reader then reads page by page instead of first seeking to the end for the last
    page. A thread of its own moves the bytes into the pipe, so `write_bytes` (on the
    server's event loop) never blocks; only the bytes not yet moved, and those in the
    kernel's pipe buffer (64 KiB at most), are held."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()  # read_fd: the decoder's to close
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()  # bytes, then None at the end
        self._unmoved = 0  # bytes written and not yet in the OS pipe
        self._lock = threading.Lock()
        self._abandoned = False
        self._thread = threading.Thread(target=self._move, name="echoic-pipe", daemon=True)
        self._thread.start()

    def write_bytes(self, data: bytes) -> None:
        with self._lock:
            self._unmoved += len(data)
        self._chunks.put(data)

    def close_writing(self, *, abandon: bool = False) -> None:
        """No more bytes will come; with `abandon`, the ones not yet moved are dropped."""
        self._abandoned = self._abandoned or abandon
        self._chunks.put(None)

    @property
    def unread(self) -> int:
        """Bytes written and not yet read by the decoder: not moved yet, or in the pipe."""
        with self._lock:  # the mover closes the pipe under the lock: the fd stays ours
            if self._write_fd < 0:
                return self._unmoved
            in_pipe = bytearray(4)
            fcntl.ioctl(self._write_fd, termios.FIONREAD, in_pipe)
            return self._unmoved + int.from_bytes(in_pipe, sys.byteorder)

    def _move(self) -> None:
        try:
            while not self._abandoned:
                try:
                    chunk = self._chunks.get(timeout=_STALL)
                except queue.Empty:
                    break  # nobody feeds it any more: end here
                if chunk is None:
                    break
                view = memoryview(chunk)
                while view and not self._abandoned:
                    view = view[os.write(self._write_fd, view) :]
                with self._lock:
                    self._unmoved -= len(chunk)
        except OSError:
            pass  # the decoder stopped reading: it reports its own error
        finally:
            with self._lock:
                os.close(self._write_fd)  # the decoder reads the end of the stream
                self._write_fd = -1


class _OwnLockSoundFile(sf.SoundFile):
    """A SoundFile that opens under a lock of its own. python-soundfile holds one lock for
    every file it opens, around libsndfile's open and the read of libsndfile's global
    error code after a failed one; a stream's open reads a pipe, and waits there for the
    header's bytes, which a client may send slowly or never: under the shared lock every
    other open in the process (every FLAC, Ogg or MP3 request) would wait with it. The
    price: two opens failing at the same moment may each name the other's reason."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._sf_error_lock = threading.Lock()  # found before the class's: see above
        super().__init__(*args, **kwargs)


class _StreamDecoder:
    """libsndfile decoding a FLAC or Ogg stream in a thread of its own as its bytes arrive,
    from `source` (a `_Pipe`, or an `_FdPipe` for Ogg)."""

    def __init__(self, name: str, codec: str, source: _Pipe | _FdPipe) -> None:
        self.name = name
        self.codec = codec  # "FLAC" or "Ogg", for messages
        self.format: tuple[int, int] | None = None  # (rate, channels), once the header is read
        self._source = source
        self._blocks: queue.SimpleQueue = queue.SimpleQueue()  # (N, C) arrays, then None
        self._error: Exception | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"echoic-{codec.lower()}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        # libsndfile closes the pipe's read end when the file closes, or fails to open.
        file = self._source.read_fd if isinstance(self._source, _FdPipe) else self._source
        try:
            with _OwnLockSoundFile(file) as f:
                self.format = (f.samplerate, f.channels)  # set before the first block is put
                while True:
                    block = f.read(_DECODER_BLOCK, dtype="float32", always_2d=True)
                    if not len(block):
                        break
                    self._blocks.put(block)
        except Exception as e:  # noqa: BLE001 - reported to the caller as an AudioError
            self._error = e
        finally:
            self._blocks.put(None)

    def feed(self, data: bytes) -> None:
        if data:
            self._source.write_bytes(data)

    def finish(self) -> None:
        self._source.close_writing()

    @property
    def backlog(self) -> int:
        return self._source.unread

    def close(self) -> None:
        if isinstance(self._source, _FdPipe):
            self._source.close_writing(abandon=True)
        else:
            self._source.close_writing()

    def take(self, *, wait: bool) -> list[np.ndarray]:
        """The blocks decoded so far; with `wait`, all of them (after `finish`)."""
        blocks = []
        while True:
            try:
                block = self._blocks.get(block=wait, timeout=_STALL if wait else None)
            except queue.Empty:
                break
            if block is None:
                self._blocks.put(None)  # stays at the end for later calls
                if self._error is not None:
                    reason = getattr(self._error, "error_string", None) or str(self._error)
                    reason = reason.strip().rstrip(".")
                    raise AudioError(
                        f"{self.name}: cannot decode the {self.codec} audio ({reason}): "
                        f"{_DAMAGED_HINT[self.codec]}"
                    )
                break
            blocks.append(block)
        return blocks


_DAMAGED_HINT = {
    "FLAC": "the file is damaged or not FLAC; send the whole file as the encoder wrote it",
    "Ogg": "Ogg with Opus or Vorbis inside is accepted, as the encoder wrote it; the file "
    "is damaged or holds another codec (send WAV or FLAC then)",
}


class _OggPages:
    """The Ogg page framing, followed as the bytes pass: each page is a 27-byte header
    ('OggS', version 0, ..., the segment count), a segment table and a body of the
    segments' total length. libsndfile decodes what it can of a stream cut inside a page,
    or of bytes that are not Ogg pages, without a word; this names both."""

    _HEADER = 27  # bytes before the segment table

    def __init__(self, name: str) -> None:
        self.name = name
        self._head = bytearray()  # the current page's header and segment table, so far
        self._body_left = 0  # bytes of the current page's body still to come
        self._page_start = 0  # stream offset of the current page
        self._offset = 0  # stream offset of the next byte

    def feed(self, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            if self._body_left:
                step = min(self._body_left, len(data) - pos)
                self._body_left -= step
            else:
                if not self._head:
                    self._page_start = self._offset + pos
                size = self._HEADER + (self._head[26] if len(self._head) > 26 else 0)
                step = min(size - len(self._head), len(data) - pos)
                self._head += data[pos : pos + step]
                self._check_capture()
                self._close_header()
            pos += step
        self._offset += len(data)

    def _close_header(self) -> None:
        """A complete header and segment table: the body comes next."""
        head = self._head
        if len(head) > 26 and len(head) == self._HEADER + head[26]:
            self._body_left = sum(head[self._HEADER :])
            self._head = bytearray()

    def _check_capture(self) -> None:
        head = self._head
        if head[:4] != b"OggS"[: len(head[:4])] or (len(head) > 4 and head[4] != 0):
            raise AudioError(
                f"{self.name}: cannot decode audio: the bytes at offset {self._page_start} "
                f"are not an Ogg page (they start {bytes(head[:5])!r}, not b'OggS' and "
                "version 0): the Ogg file is damaged, or other data was sent after it; "
                "send one whole Ogg file, unchanged"
            )

    def end(self) -> None:
        """The bytes have ended: AudioError if they end inside a page (truncated)."""
        if self._head or self._body_left:
            got = self._offset - self._page_start
            raise AudioError(
                f"{self.name}: the Ogg audio is truncated: it ends inside a page (the last "
                f"{got} bytes begin a page that is not complete); send the whole file, or "
                "end a live stream after a whole page"
            )


def _pcm_to_float(raw: bytes, fmt: str, channels: int) -> np.ndarray:
    """Interleaved PCM bytes -> (N, C) float32 in [-1, 1], scaled as libsndfile scales."""
    if fmt in ("int16", "mulaw", "alaw"):
        x = raw_to_float(raw, "linear16" if fmt == "int16" else fmt)
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
