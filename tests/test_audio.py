"""Decoding audio bytes and files to float32 mono at the model's rate."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from echoic.model.core.audio import AudioError, audio_duration, decode_audio, load_audio, write_wav


def _sine(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    return amplitude * np.sin(2 * np.pi * freq * t)


def _pcm16(samples: np.ndarray) -> np.ndarray:
    return np.round(samples * 32767).astype(np.int16)


def _encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.argmax(spectrum) * rate / samples.size)


@pytest.mark.parametrize(
    ("fmt", "encoding"),
    [
        pytest.param("WAV", "auto", id="wav-auto"),
        pytest.param("WAV", "wav", id="wav-explicit"),
        pytest.param("FLAC", "auto", id="flac-auto"),
        pytest.param("FLAC", "flac", id="flac-explicit"),
    ],
)
def test_pcm16_container_round_trip_is_exact(fmt: str, encoding: str) -> None:
    pcm = _pcm16(_sine(440, 16000, 0.25))
    out = decode_audio(_encode(pcm, 16000, fmt, "PCM_16"), 16000, encoding=encoding)
    assert out.dtype == np.float32 and out.shape == pcm.shape
    np.testing.assert_array_equal(out, pcm.astype(np.float32) / 32768)


def test_linear16_round_trip_is_exact() -> None:
    pcm = _pcm16(_sine(440, 16000, 0.25))
    out = decode_audio(pcm.astype("<i2").tobytes(), 16000, encoding="linear16", sample_rate=16000)
    np.testing.assert_array_equal(out, pcm.astype(np.float32) / 32768)


def test_linear16_interleaved_channels_are_averaged() -> None:
    stereo = np.array([[1000, 3000], [-2000, 0], [4, 6]], dtype="<i2")
    out = decode_audio(stereo.tobytes(), 16000, encoding="linear16", sample_rate=16000, channels=2)
    np.testing.assert_array_equal(out, np.array([2000, -1000, 5], dtype=np.float32) / 32768)


@pytest.mark.parametrize(
    ("fmt", "subtype", "rate", "channels"),
    [
        pytest.param("WAV", "PCM_16", 44100, 2, id="wav-stereo-44k1"),
        pytest.param("FLAC", "PCM_24", 48000, 1, id="flac-48k"),
        pytest.param("OGG", "VORBIS", 22050, 2, id="ogg-stereo-22k05"),
        pytest.param("WAV", "PCM_16", 8000, 1, id="wav-8k-upsampled"),
    ],
)
def test_resampled_to_mono_keeps_the_tone(fmt: str, subtype: str, rate: int, channels: int) -> None:
    tone = _sine(1000, rate, 0.5)
    audio = np.stack([tone] * channels, axis=1) if channels > 1 else tone
    out = decode_audio(_encode(audio, rate, fmt, subtype), 16000)
    assert out.ndim == 1 and out.dtype == np.float32
    assert abs(out.size - 8000) <= 1
    assert abs(_peak_hz(out, 16000) - 1000) <= 2
    assert np.abs(out).max() <= 1.0


def test_out_of_range_float_samples_are_clipped() -> None:
    loud = np.array([1.5, -2.0, 0.25] * 100, dtype=np.float32)
    out = decode_audio(_encode(loud, 16000, "WAV", "FLOAT"), 16000)
    assert out.max() == 1.0 and out.min() == -1.0


def test_decoding_is_deterministic() -> None:
    data = _encode(_sine(440, 44100, 0.3), 44100, "WAV", "PCM_16")
    np.testing.assert_array_equal(decode_audio(data, 16000), decode_audio(data, 16000))


def _wav16k(seconds: float = 0.1) -> bytes:
    return _encode(_sine(440, 16000, seconds), 16000, "WAV", "PCM_16")


@pytest.mark.parametrize(
    ("data", "kwargs", "match"),
    [
        pytest.param(b"", {}, "no audio data", id="empty"),
        pytest.param(_wav16k()[:20], {}, "cannot decode audio", id="truncated-header"),
        pytest.param(np.random.default_rng(0).bytes(4000), {}, "cannot decode audio", id="garbage"),
        pytest.param(
            np.random.default_rng(1).bytes(4000),
            {"encoding": "wav"},
            "cannot decode",
            id="garbage-wav",
        ),
        pytest.param(_wav16k(0.0), {}, "no samples", id="header-only-wav"),
        pytest.param(
            b"\x00\x01\x02",
            {"encoding": "linear16", "sample_rate": 16000},
            "multiple of 2 bytes",
            id="odd-length-pcm16",
        ),
        pytest.param(
            b"\x00" * 6,
            {"encoding": "linear16", "sample_rate": 16000, "channels": 2},
            "multiple of 4 bytes",
            id="partial-stereo-frame",
        ),
        pytest.param(b"\x00" * 64, {"encoding": "linear16"}, "give its sample rate", id="no-rate"),
        pytest.param(
            b"\x00" * 64,
            {"encoding": "linear16", "sample_rate": 4000},
            "unsupported sample rate 4000 Hz",
            id="rate-too-low",
        ),
        pytest.param(
            _wav16k(), {"encoding": "mp3"}, "unsupported encoding 'mp3'", id="bad-encoding"
        ),
        pytest.param(_wav16k(), {"encoding": "flac"}, "the data is WAV", id="wav-sent-as-flac"),
        pytest.param(_wav16k(), {"sample_rate": 8000}, "header says 16000 Hz", id="rate-mismatch"),
        pytest.param(
            _encode(np.zeros(100), 4000, "WAV", "PCM_16"),
            {},
            "unsupported sample rate 4000 Hz",
            id="wav-rate-too-low",
        ),
    ],
)
def test_bad_input_is_an_audio_error(data: bytes, kwargs: dict, match: str) -> None:
    with pytest.raises(AudioError, match=match):
        decode_audio(data, 16000, name="clip.raw", **kwargs)
    with pytest.raises(AudioError, match="^clip.raw: "):
        decode_audio(data, 16000, name="clip.raw", **kwargs)


def test_raw_pcm_sent_as_auto_gets_a_hint() -> None:
    with pytest.raises(AudioError, match="encoding 'linear16'"):
        decode_audio(_pcm16(_sine(440, 16000, 0.1)).tobytes(), 16000)


def test_load_audio_and_duration(tmp_path: Path) -> None:
    path = tmp_path / "tone.wav"
    write_wav(path, _sine(440, 16000, 1.5), 16000)
    assert audio_duration(path) == pytest.approx(1.5)
    out = load_audio(path, 16000)
    assert out.shape == (24000,)
    assert abs(_peak_hz(out, 16000) - 440) <= 1


def test_write_wav_quantises_and_clips(tmp_path: Path) -> None:
    path = tmp_path / "loud.wav"
    write_wav(path, np.array([2.0, -2.0, 0.5]), 16000)
    pcm, rate = sf.read(path, dtype="int16")
    assert rate == 16000
    np.testing.assert_array_equal(pcm, [32767, -32767, 16384])


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        pytest.param("missing.wav", None, "no such audio file", id="missing"),
        pytest.param("noise.wav", b"not audio at all" * 10, "cannot", id="garbage-file"),
    ],
)
def test_file_errors_name_the_path(
    tmp_path: Path, name: str, content: bytes | None, match: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    for read in (lambda: load_audio(path, 16000), lambda: audio_duration(path)):
        with pytest.raises(AudioError, match=match) as info:
            read()
        assert str(path) in str(info.value)


def test_directory_is_an_audio_error(tmp_path: Path) -> None:
    with pytest.raises(AudioError, match="cannot read audio file"):
        load_audio(tmp_path, 16000)


# ---------------------------------------------------------------- telephony and Ogg


@pytest.mark.parametrize(("law", "subtype"), [("mulaw", "ULAW"), ("alaw", "ALAW")])
def test_raw_g711_decodes_as_libsndfile_decodes_it_in_a_wav(law: str, subtype: str) -> None:
    """Raw G.711 bytes (no header, the caller gives the rate) give exactly the samples
    libsndfile gives for the same bytes in a WAV file, at 8 kHz and resampled."""
    wav = _encode(_sine(300, 8000, 0.5, 0.8), 8000, "WAV", subtype)
    with sf.SoundFile(io.BytesIO(wav)) as f:
        assert f.subtype == subtype
    raw = wav[wav.index(b"data") + 8 :]
    for rate in (8000, 16000):
        want = decode_audio(wav, rate)
        got = decode_audio(raw, rate, encoding=law, sample_rate=8000)
        assert np.array_equal(got, want)
    with pytest.raises(AudioError, match="raw mu-law has no header; give its sample rate"):
        decode_audio(raw, 16000, encoding="mulaw")
    stereo = decode_audio(raw, 8000, encoding=law, sample_rate=8000, channels=2)
    assert stereo.size == len(raw) // 2


def test_ogg_opus_and_vorbis_decode_and_ogg_is_checked() -> None:
    """OGG holds Opus (browsers, phones) or Vorbis; "ogg" refuses other containers."""
    tone = _sine(440, 48000, 0.5)
    for subtype in ("OPUS", "VORBIS"):
        data = _encode(tone, 48000, "OGG", subtype)
        samples = decode_audio(data, 16000, encoding="ogg")
        assert np.array_equal(samples, decode_audio(data, 16000))
        assert abs(samples.size - 8000) <= 400 and abs(_peak_hz(samples, 16000) - 440) < 10
    with pytest.raises(AudioError, match="encoding 'ogg' was requested but the data is WAV"):
        decode_audio(_encode(tone, 48000, "WAV"), 16000, encoding="ogg")
