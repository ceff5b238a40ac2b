"""Log spectrogram features, offline and streaming."""

from __future__ import annotations

import numpy as np
import pytest

from echoic.model.core.features import (
    FeatureConfig,
    FeatureStream,
    batch_features,
    compute_features,
    mel_filterbank,
    num_frames,
)

LINEAR = FeatureConfig()
MEL = FeatureConfig(window_ms=25.0, n_fft=512, mel_bins=80)
CONFIGS = [pytest.param(LINEAR, id="linear"), pytest.param(MEL, id="mel")]


def _noise(num_samples: int, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(num_samples)).astype(np.float32)


def test_sizes() -> None:
    assert (LINEAR.window_samples, LINEAR.hop_samples, LINEAR.num_features) == (320, 160, 161)
    assert (MEL.window_samples, MEL.fft_size, MEL.num_features) == (400, 512, 80)
    assert FeatureConfig(n_fft=512).num_features == 257


@pytest.mark.parametrize(
    ("num_samples", "frames"),
    [
        pytest.param(0, 0, id="empty"),
        pytest.param(319, 0, id="shorter-than-a-window"),
        pytest.param(320, 1, id="one-window"),
        pytest.param(479, 1, id="just-short-of-two"),
        pytest.param(480, 2, id="two"),
        pytest.param(16000, 99, id="one-second"),
    ],
)
def test_frame_count_and_shape(num_samples: int, frames: int) -> None:
    assert num_frames(num_samples, LINEAR) == frames
    out = compute_features(_noise(num_samples), LINEAR)
    assert out.shape == (frames, 161) and out.dtype == np.float32


@pytest.mark.parametrize("cfg", CONFIGS)
def test_values_finite_and_deterministic(cfg: FeatureConfig) -> None:
    audio = _noise(8000)
    first = compute_features(audio, cfg)
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(first, compute_features(audio.copy(), cfg))


def test_silence_is_the_log_floor() -> None:
    out = compute_features(np.zeros(1600, dtype=np.float32), LINEAR)
    np.testing.assert_array_equal(out, np.float32(np.log(LINEAR.log_floor)))


def test_sine_peaks_at_its_bin() -> None:
    t = np.arange(16000) / 16000
    out = compute_features((0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32), LINEAR)
    assert (out.argmax(axis=1) == 1000 // 50).all()  # bins are 16000 / 320 = 50 Hz apart


def test_mel_filterbank_shape_and_peaks() -> None:
    fb = mel_filterbank(16000, 512, 80)
    assert fb.shape == (257, 80)
    assert (fb >= 0).all() and fb.max() <= 1.0
    assert (fb.sum(axis=0) > 0).all()


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param("1", id="one-sample"),
        pytest.param("7", id="seven"),
        pytest.param("160", id="one-hop"),
        pytest.param("401", id="just-over-a-window"),
        pytest.param("1000", id="thousand"),
        pytest.param("10000", id="larger-than-the-audio"),
        pytest.param("random", id="random-sizes"),
        pytest.param("with-empty", id="with-empty-chunks"),
    ],
)
def test_stream_equals_offline_bitwise(cfg: FeatureConfig, chunks: str) -> None:
    audio = _noise(2399)
    if chunks == "random":
        sizes = np.random.default_rng(1).integers(1, 700, size=50)
    elif chunks == "with-empty":
        sizes = [0, 5, 0, 0, 600, 0, 1794, 0]
    else:
        sizes = [int(chunks)] * (audio.size // int(chunks) + 1)
    bounds = np.cumsum([0, *sizes])
    stream = FeatureStream(cfg)
    outputs = [stream.accept(audio[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert all(out.ndim == 2 and out.shape[1] == cfg.num_features for out in outputs)
    streamed = np.concatenate(outputs)
    offline = compute_features(audio, cfg)
    assert stream.frames_emitted == offline.shape[0] == num_frames(audio.size, cfg)
    np.testing.assert_array_equal(streamed, offline)


def test_long_audio_in_odd_chunks_equals_offline_bitwise() -> None:
    """Many filterbank tiles: frames land at every place in a tile, chunk by chunk."""
    audio = _noise(3 * 16000 + 77, seed=3)
    stream = FeatureStream(MEL)
    bounds = np.cumsum([0, *np.random.default_rng(4).integers(1, 5000, size=40)])
    streamed = np.concatenate(
        [stream.accept(audio[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    )
    np.testing.assert_array_equal(streamed, compute_features(audio, MEL))


@pytest.mark.parametrize("cfg", CONFIGS)
def test_batched_streams_equal_each_stream_alone_bitwise(cfg: FeatureConfig) -> None:
    """Streams push audio in their own chunk sizes; `batch_features` over all of them
    after each round gives every stream the bits of compute_features on its audio."""
    rng = np.random.default_rng(2)
    audios = [_noise(n, seed=i) for i, n in enumerate([3001, 160, 0, 1999, 5000])]
    streams = [FeatureStream(cfg) for _ in audios]
    got: list[list[np.ndarray]] = [[] for _ in audios]
    at = [0] * len(audios)
    while any(a < len(x) for a, x in zip(at, audios, strict=True)):
        for i, audio in enumerate(audios):
            n = int(rng.integers(0, 900))
            streams[i].push(audio[at[i] : at[i] + n])
            at[i] += n
        pending = [s.frames_pending for s in streams]
        out = batch_features(streams)
        assert [len(o) for o in out] == pending
        assert all(s.frames_pending == 0 for s in streams)
        for g, o in zip(got, out, strict=True):
            g.append(o)
    for g, audio, s in zip(got, audios, streams, strict=True):
        np.testing.assert_array_equal(np.concatenate(g), compute_features(audio, cfg))
        assert s.frames_emitted == num_frames(audio.size, cfg)
    assert batch_features([]) == []
    with pytest.raises(ValueError, match="one feature config"):
        batch_features([FeatureStream(LINEAR), FeatureStream(MEL)])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"hop_ms": 30.0}, "must not exceed", id="hop-over-window"),
        pytest.param({"window_ms": 0.0}, "must be positive", id="zero-window"),
        pytest.param({"sample_rate": 22050, "window_ms": 25.0}, "whole number", id="fractional"),
        pytest.param({"n_fft": 256}, "at least the window length", id="short-fft"),
        pytest.param({"mel_bins": -1}, "mel_bins", id="negative-mel"),
        pytest.param({"mel_bins": 80}, "covers no FFT bin", id="empty-mel-filter"),
        pytest.param({"log_floor": 0.0}, "log_floor", id="zero-floor"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FeatureConfig(**kwargs)


@pytest.mark.parametrize(
    ("samples", "error"),
    [
        pytest.param(np.zeros(1000, dtype=np.int16), TypeError, id="int16"),
        pytest.param(np.zeros((1000, 2), dtype=np.float32), ValueError, id="stereo"),
    ],
)
def test_bad_samples_are_rejected(samples: np.ndarray, error: type[Exception]) -> None:
    with pytest.raises(error):
        compute_features(samples, LINEAR)
