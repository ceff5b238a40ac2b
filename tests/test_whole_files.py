"""Whole files (Recognize, HTTP uploads) decoded a block at a time: the blocks are the samples
`decode_audio` gives, and of a whole-at-once decode; its errors come as before; and a server
holds a window of a long file's samples, not the file's."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from echoic.model.core.audio import (
    AudioError,
    AudioTooLong,
    decode_audio,
    decode_blocks,
    g711_table,
)
from echoic.server.core.audio_input import AudioInput

RATE = 16000  # the models' rate, Hz


def _signal(seconds: float, rate: int, channels: int) -> np.ndarray:
    """A chirp over noise, each channel its own phase: (N, C) float32 in [-0.5, 0.5]."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(7)
    chans = [0.3 * np.sin(2 * np.pi * (200 + 150 * t) * t + c) + 0.05 * rng.standard_normal(len(t))
             for c in range(channels)]  # fmt: skip
    return np.stack(chans, axis=1).astype(np.float32)


def _container(seconds: float, rate: int, channels: int, fmt: str, subtype: str) -> bytes:
    out = io.BytesIO()
    sf.write(out, _signal(seconds, rate, channels), rate, format=fmt, subtype=subtype)
    return out.getvalue()


def _whole_at_once(data: bytes) -> np.ndarray:
    """A container decoded whole, the other way round: every frame read at once, channels
    averaged in float64, one soxr HQ resampling of the whole signal, clipped."""
    x, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = x.astype(np.float64).mean(axis=1).astype(np.float32)
    if rate != RATE:
        mono = soxr.resample(mono, rate, RATE, quality="HQ").astype(np.float32)
    return np.clip(mono, -1.0, 1.0)


# 9 s: three of decode_blocks' 65536-frame blocks at 16 kHz, seven at 48 kHz
CONTAINERS = [
    pytest.param("WAV", "PCM_16", 16000, 1, id="wav-pcm16-16k"),
    pytest.param("WAV", "PCM_16", 48000, 2, id="wav-pcm16-48k-stereo"),
    pytest.param("WAV", "ULAW", 8000, 1, id="wav-mulaw-8k"),
    pytest.param("WAV", "ALAW", 8000, 1, id="wav-alaw-8k"),
    pytest.param("WAV", "FLOAT", 22050, 1, id="wav-float-22k"),
    pytest.param("WAV", "PCM_24", 16000, 3, id="wav-pcm24-3ch"),
    pytest.param("FLAC", "PCM_16", 16000, 1, id="flac-16k"),
    pytest.param("FLAC", "PCM_24", 44100, 2, id="flac-44k-stereo"),
    pytest.param("OGG", "VORBIS", 44100, 2, id="ogg-vorbis-44k-stereo"),
    pytest.param("OGG", "OPUS", 48000, 1, id="ogg-opus-48k"),
    pytest.param("OGG", "OPUS", 16000, 1, id="ogg-opus-16k"),
    pytest.param("MP3", "MPEG_LAYER_III", 16000, 1, id="mp3-16k"),
    pytest.param("MP3", "MPEG_LAYER_III", 44100, 2, id="mp3-44k-stereo"),
]


def _whole_blocks(data: bytes, encoding: str = "auto", **kwargs) -> list[np.ndarray]:
    """The server's blocks of a whole file, WAV and raw bytes fed 8 KiB at a time here (the
    server's 256 KiB would be one or two slices of these short files)."""
    return list(AudioInput(encoding, RATE, **kwargs).whole_blocks(data, slice_bytes=8192))


@pytest.mark.parametrize(("fmt", "subtype", "rate", "channels"), CONTAINERS)
def test_a_whole_file_in_blocks_is_the_file_decoded_at_once(fmt, subtype, rate, channels) -> None:
    """Joined, the server's blocks and decode_blocks' are decode_audio's samples, and those
    of the file read whole and resampled at once: the same bits, every container (MP3's
    decoder itself rounds by the size of its reads)."""
    data = _container(9.0, rate, channels, fmt, subtype)
    want = decode_audio(data, RATE)
    served = _whole_blocks(data)
    model_side = list(decode_blocks(data, RATE))
    assert len(served) >= 3 and len(model_side) >= 3, (len(served), len(model_side))
    np.testing.assert_array_equal(np.concatenate(served), want)
    np.testing.assert_array_equal(np.concatenate(model_side), want)
    if fmt == "MP3":  # libmpg123's float output depends on the size of each read, by an ulp
        np.testing.assert_allclose(want, _whole_at_once(data), rtol=0, atol=2**-23)
    else:
        np.testing.assert_array_equal(want, _whole_at_once(data))


@pytest.mark.parametrize(
    ("encoding", "rate", "channels"),
    [
        pytest.param("linear16", 16000, 1, id="linear16-16k"),
        pytest.param("linear16", 48000, 2, id="linear16-48k-stereo"),
        pytest.param("mulaw", 8000, 1, id="mulaw-8k"),
        pytest.param("alaw", 8000, 2, id="alaw-8k-stereo"),
    ],
)
def test_raw_bytes_in_blocks_are_the_bytes_decoded_at_once(encoding, rate, channels) -> None:
    """Raw bytes sliced (by the server, and by decode_blocks 65536 frames at a time) give
    the samples of the whole signal scaled, averaged and resampled at once."""
    x = _signal(9.0, rate, channels)
    if encoding == "linear16":
        data = np.round(x * 32767).astype("<i2").tobytes()
        scaled = np.frombuffer(data, "<i2").astype(np.float32) / np.float32(32768.0)
    else:
        data = _container(9.0, rate, channels, "RAW", {"mulaw": "ULAW", "alaw": "ALAW"}[encoding])
        scaled = g711_table(encoding)[np.frombuffer(data, np.uint8)]
    mono = scaled.reshape(-1, channels).astype(np.float64).mean(axis=1).astype(np.float32)
    if rate != RATE:
        mono = soxr.resample(mono, rate, RATE, quality="HQ").astype(np.float32)
    want = np.clip(mono, -1.0, 1.0)
    raw = dict(encoding=encoding, sample_rate=rate, channels=channels)
    served = _whole_blocks(data, **raw)
    model_side = list(decode_blocks(data, RATE, **raw))
    assert len(served) >= 3 and len(model_side) >= 2, (len(served), len(model_side))
    np.testing.assert_array_equal(np.concatenate(served), want)
    np.testing.assert_array_equal(np.concatenate(model_side), want)
    np.testing.assert_array_equal(decode_audio(data, RATE, **raw), want)


def _first_block(data: bytes, encoding: str = "auto", **kwargs) -> np.ndarray:
    return next(AudioInput(encoding, RATE, name="clip", **kwargs).whole_blocks(data))


OGG = _container(9.0, 48000, 1, "OGG", "OPUS")


@pytest.mark.parametrize(
    ("data", "kwargs", "error", "message"),
    [
        pytest.param(_container(9.0, 48000, 1, "OGG", "OPUS"), {"max_seconds": 5.0},
                     AudioTooLong, "clip: the audio is 9.0 s long, over the limit of 5 s",
                     id="ogg-too-long"),
        pytest.param(_container(9.0, 16000, 1, "FLAC", "PCM_16"), {"max_seconds": 5.0},
                     AudioTooLong, "clip: the audio is 9.0 s long, over the limit of 5 s",
                     id="flac-too-long"),
        pytest.param(_container(9.0, 16000, 1, "WAV", "PCM_16"), {"max_seconds": 5.0},
                     AudioTooLong, "clip: the audio is 9.0 s long, over the limit of 5 s",
                     id="wav-too-long"),
        pytest.param(bytes(9 * 16000 * 2), {"max_seconds": 5.0, "encoding": "linear16",
                     "sample_rate": 16000}, AudioTooLong,
                     "clip: the audio is 9.0 s long, over the limit of 5 s", id="raw-too-long"),
        pytest.param(OGG[: len(OGG) // 2], {}, AudioError, "clip: the Ogg audio is truncated",
                     id="ogg-truncated"),
        pytest.param(b"garbage " * 100, {}, AudioError,
                     "clip: cannot decode audio: expected WAV, FLAC, OGG or MP3", id="garbage"),
        pytest.param(b"", {}, AudioError, "clip: no audio data (0 bytes)", id="empty"),
    ],
)  # fmt: skip
def test_a_whole_file_is_refused_at_its_first_block(data, kwargs, error, message) -> None:
    """What the header or the size says (too long), and a truncated or garbled file, are
    refused before any samples are handed out, with the messages they always had."""
    with pytest.raises(error) as caught:
        _first_block(data, **kwargs)
    assert str(caught.value).startswith(message), caught.value
    if error is AudioTooLong:
        assert caught.value.exact  # from the header or the size, not after decoding 5 s


def test_an_error_inside_the_audio_comes_with_its_block() -> None:
    """A FLAC damaged after its first seconds hands out the blocks before the damage, then
    the error decode_audio gives for it."""
    flac = bytearray(_container(30.0, 16000, 1, "FLAC", "PCM_16"))
    flac[len(flac) * 2 // 3 :] = b"\xff" * (len(flac) - len(flac) * 2 // 3)
    with pytest.raises(AudioError) as whole:
        decode_audio(bytes(flac), RATE, name="clip")
    blocks = AudioInput("auto", RATE, name="clip").whole_blocks(bytes(flac))
    assert len(next(blocks)) > 0
    with pytest.raises(AudioError) as blockwise:
        list(blocks)
    assert str(blockwise.value) == str(whole.value)


# ---------------------------------------------------------------- through a server

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
pytest.importorskip("aiohttp", reason="the HTTP door needs the serve extra (aiohttp)")

from tests.test_hostile_doors import _grpc_recognize, _transcribe  # noqa: E402
from tests.test_http import http_server  # noqa: E402


def _long_ogg(clip: np.ndarray, seconds: float, path: Path) -> bytes:
    """`clip` (16 kHz) and a 440 Hz tone after it, repeated to `seconds`, as a 48 kHz
    Ogg/Opus at Opus's lowest bitrate, written a repeat at a time."""
    tone = 0.2 * np.sin(2 * np.pi * 440 * np.arange(RATE) / RATE).astype(np.float32)
    one = np.concatenate([clip, np.zeros(RATE // 2, np.float32), tone,
                          np.zeros(RATE // 2, np.float32)])  # fmt: skip
    one = soxr.resample(one, RATE, 48000, quality="HQ").astype(np.float32)
    left = int(seconds * 48000)
    with sf.SoundFile(path, "w", 48000, 1, "OPUS", format="OGG", compression_level=1.0) as f:
        while left > 0:
            f.write(one[:left])
            left -= len(one)
    return path.read_bytes()


@pytest.fixture(scope="module")
def speech(speech_corpus: Path) -> np.ndarray:
    import json

    row = json.loads(speech_corpus.read_text().splitlines()[0])
    return decode_audio((speech_corpus.parent / row["audio_filepath"]).read_bytes(), RATE)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


@pytest.mark.slow
def test_a_long_ogg_gives_the_words_of_its_samples_on_both_doors(speech, tmp_path) -> None:
    """100 s of speech and tone, 48 kHz Ogg/Opus (four windows, each decoded as it is
    needed): HTTP and gRPC Recognize give the words of decode_audio's samples of it sent
    as they are (a float WAV at the model's rate), and Recognize counts all of them."""
    ogg = _long_ogg(speech, 100.0, tmp_path / "long.ogg")
    samples = decode_audio(ogg, RATE)
    as_decoded = io.BytesIO()
    sf.write(as_decoded, samples, RATE, format="WAV", subtype="FLOAT")
    with http_server(max_upload_mb=25.0) as server:  # the float WAV is 6 MiB
        status, http_want = _transcribe(server, as_decoded.getvalue())
        assert status == 200 and http_want["text"], http_want
        assert _transcribe(server, ogg) == (200, http_want)  # each door cuts utterances its own way
        grpc_want = _grpc_recognize(server, as_decoded.getvalue())
        assert grpc_want and _grpc_recognize(server, ogg) == grpc_want


@pytest.mark.slow
def test_a_long_whole_file_holds_a_window_of_samples_not_the_file(speech, tmp_path) -> None:
    """A 12-minute 48 kHz Ogg/Opus (0.5 MB; 138 MB as float32 at 48 kHz, 46 MB at the
    model's 16 kHz) over HTTP: the peak memory of the process the server's doors run in
    (this one; the model runs in its engine process) grows by far less than the file's
    samples at the model's rate (8 MB measured; at least twice 46 MB when they were
    whole: the blocks and their join)."""
    ogg = _long_ogg(speech, 12 * 60.0, tmp_path / "long.ogg")
    with http_server() as server:
        assert _transcribe(server, _long_ogg(speech, 2.0, tmp_path / "short.ogg"))[0] == 200
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
        before = _status_kb("VmRSS")
        # 12 minutes of speech take the bundled model 56 s on an idle 2-core machine:
        # the call's time is not what this test measures
        status, body = _transcribe(server, ogg, timeout=300.0)
        growth_mb = (_status_kb("VmHWM") - before) / 1024
    assert status == 200 and body["text"], body
    assert growth_mb < 40, f"the server's process grew by {growth_mb:.0f} MB"
