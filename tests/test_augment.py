"""Augmentation in the data loader: each transform does what it says, measured on real
signals, and what happens to an utterance depends on (seed, epoch, index) alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from echoic.model.core.configs import ConfigError, from_dict
from echoic.model.core.features import FeatureConfig, compute_features
from echoic.model.core.text import Vocabulary
from echoic.training.augment import (
    AugmentConfig,
    Augmenter,
    add_noise,
    clip,
    reverberate,
    room_impulse_response,
    set_level,
    speed_perturb,
    telephone,
)
from echoic.training.data import DataConfig, make_loader, read_manifest
from echoic.training.synth import make_noise

RATE = 16000
FEATURES = FeatureConfig(sample_rate=RATE)
EVERYTHING = AugmentConfig(
    speed_prob=0.5, reverb_prob=0.5, telephone_prob=0.3, noise_prob=0.5, level_prob=0.5,
    clip_prob=0.2, freq_masks=2, time_masks=2,
)  # fmt: skip


def _speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """Bursts of a harmonic tone with a moving pitch: energy from 100 Hz to 7 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    x = sum(np.sin(k * phase) / k for k in range(1, 40))
    envelope = (np.sin(2 * np.pi * 3 * t) > 0).astype(float)
    return (0.2 * x * envelope + 0.001 * rng.standard_normal(t.size)).astype(np.float32)


def _band_energy(x: np.ndarray, lo: float, hi: float) -> float:
    spectrum = np.abs(np.fft.rfft(x)) ** 2
    freqs = np.fft.rfftfreq(len(x), 1 / RATE)
    return float(spectrum[(freqs >= lo) & (freqs < hi)].sum())


def _db(x: np.ndarray) -> float:
    return 20 * np.log10(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def test_speed_perturbation_changes_the_length_by_the_factor() -> None:
    x = _speechlike(2.0)
    for factor in (0.9, 1.1):
        assert abs(len(speed_perturb(x, factor)) - len(x) / factor) <= 2


def test_reverberation_decays_by_60_db_in_rt60() -> None:
    """The simulated room's energy decay curve (Schroeder integration) falls 60 dB in
    about its RT60, and reverberating keeps the length and the level."""
    rng = np.random.default_rng(3)
    for rt60 in (0.3, 0.8):
        rir = room_impulse_response(rt60, RATE, rng).astype(np.float64)
        edc = np.cumsum((rir**2)[::-1])[::-1]
        edc_db = 10 * np.log10(edc / edc[0])
        t5, t35 = np.argmax(edc_db < -5), np.argmax(edc_db < -35)
        measured = (t35 - t5) / RATE * 2  # T30 extrapolated to 60 dB
        assert 0.7 * rt60 < measured < 1.3 * rt60, (rt60, measured)
    x = _speechlike(1.0)
    wet = reverberate(x, room_impulse_response(0.5, RATE, rng))
    assert len(wet) == len(x) and abs(_db(wet) - _db(x)) < 0.01


def test_the_telephone_line_is_narrowband_and_g711() -> None:
    x = _speechlike(1.0)
    for law in ("mulaw", "alaw"):
        line = telephone(x, RATE, law)
        assert len(line) == len(x)
        inside = _band_energy(line, 400, 3300)
        assert _band_energy(line, 3700, 8000) < 1e-3 * inside  # nothing above the band
        assert _band_energy(line, 0, 200) < 1e-2 * inside
        assert _band_energy(x, 3700, 8000) > 1e-2 * _band_energy(x, 400, 3300)  # there was


def test_noise_level_and_clipping_hit_their_targets() -> None:
    x = _speechlike(1.0)
    rng = np.random.default_rng(0)
    for kind in ("white", "pink", "brown"):
        noise = make_noise(kind, len(x), rng)
        noisy = add_noise(x, noise, 10.0)
        assert abs(_db(x) - _db(noisy - x) - 10.0) < 0.01
    assert abs(_db(set_level(x, -35.0)) - -35.0) < 0.01
    clipped = clip(x, 0.5)
    assert np.max(np.abs(clipped)) <= 0.5 * np.max(np.abs(x)) + 1e-7


def test_specaugment_masks_set_bins_to_the_mean() -> None:
    features = compute_features(_speechlike(2.0), FEATURES)
    cfg = AugmentConfig(freq_masks=2, freq_width=8, time_masks=2, time_width=0.1)
    out = Augmenter(cfg, seed=1, sample_rate=RATE).features(features, epoch=0, index=0)
    mean = features.mean(axis=0)
    masked_bins = [f for f in range(features.shape[1]) if np.all(out[:, f] == mean[f])]
    masked_frames = [t for t in range(len(out)) if np.all(out[t] == mean)]
    assert masked_bins and masked_frames and len(masked_bins) <= 16
    assert len(masked_frames) <= 2 * int(0.1 * len(out))
    assert not np.array_equal(out, features) and out.shape == features.shape


def test_the_draws_depend_on_seed_epoch_and_index_alone() -> None:
    x = _speechlike(1.0)
    augmenter = Augmenter(EVERYTHING, seed=7, sample_rate=RATE)
    runs = {(e, i): augmenter.waveform(x, e, i) for e in range(3) for i in range(4)}
    again = Augmenter(EVERYTHING, seed=7, sample_rate=RATE)
    assert all(np.array_equal(again.waveform(x, e, i), y) for (e, i), y in runs.items())
    distinct = {y.tobytes() for y in runs.values()}
    assert len(distinct) >= 10  # epochs and utterances differ (a few may draw nothing)
    assert not np.array_equal(Augmenter(EVERYTHING, 8, RATE).waveform(x, 0, 0), runs[0, 0])


def test_a_clean_share_leaves_the_waveform_and_changes_no_other_draw() -> None:
    """clean_prob leaves that share of the utterances as they were (a fine-tune keeps
    clean speech in every batch); the others are augmented exactly as without it."""
    from dataclasses import replace

    x = _speechlike(0.5)
    always = replace(EVERYTHING, speed_prob=1.0)  # every augmented utterance changes length
    plain = Augmenter(always, seed=5, sample_rate=RATE)
    shared = Augmenter(replace(always, clean_prob=0.4), seed=5, sample_rate=RATE)
    clean = 0
    for index in range(200):
        out = shared.waveform(x, 0, index)
        if np.array_equal(out, x):
            clean += 1
        else:
            assert np.array_equal(out, plain.waveform(x, 0, index))
    assert 60 <= clean <= 100  # 40% of 200, give or take the draw
    assert not any(np.array_equal(plain.waveform(x, 0, i), x) for i in range(200))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"noise_prob": 1.5}, "noise_prob must be in [0, 1]"),
        ({"clean_prob": -0.1}, "clean_prob must be in [0, 1]"),
        ({"speed": [1.2, 0.9]}, "low 1.2 is above high 0.9"),
        ({"noise_kinds": ["thunder"]}, "noise_kinds"),
        ({"level_dbfs": [-10.0, 3.0]}, "level_dbfs must be <= 0"),
    ],
)
def test_bad_augment_settings_say_which(override: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        from_dict(DataConfig, {"augment": override})


def _corpus(tmp_path: Path, count: int = 12) -> Path:
    import soundfile as sf

    lines = []
    for i in range(count):
        path = tmp_path / f"u{i}.wav"
        sf.write(path, _speechlike(0.4 + 0.05 * i, seed=i), RATE)
        lines.append(json.dumps({"audio_filepath": str(path), "duration": 0.4 + 0.05 * i,
                                 "text": "a b c"}))  # fmt: skip
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def test_the_loader_augments_training_batches_the_same_with_any_worker_count(
    tmp_path: Path,
) -> None:
    """Training batches differ from the clean ones and from epoch to epoch, and are the
    same with 0 or 2 worker processes; an unshuffled (validation) loader never augments."""
    manifest = _corpus(tmp_path)
    cfg = {"batch_seconds": 2.0, "max_batch": 4, "max_duration": 5.0}
    utts, _ = read_manifest(manifest, Vocabulary(), from_dict(DataConfig, cfg))

    def epochs(workers: int, augment: AugmentConfig | None, shuffle: bool = True) -> list:
        data = from_dict(DataConfig, {**cfg, "num_workers": workers})
        if augment is not None:
            data = DataConfig(**{**data.__dict__, "augment": augment})
        loader, sampler = make_loader(utts, FEATURES, data, seed=3, shuffle=shuffle)
        out = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            out.append([b.features.numpy().copy() for b in loader])
        return out

    clean = epochs(0, None)
    augmented = epochs(0, EVERYTHING)
    assert [[b.shape[0] for b in e] for e in augmented] == [[b.shape[0] for b in e] for e in clean]
    assert not all(np.array_equal(a, c) for a, c in zip(augmented[0], clean[0], strict=True))
    with_workers = epochs(2, EVERYTHING)
    for ours, theirs in zip(augmented, with_workers, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    unshuffled_clean, unshuffled_aug = epochs(0, None, False), epochs(0, EVERYTHING, False)
    assert all(np.array_equal(a, b) for a, b in zip(unshuffled_clean[0], unshuffled_aug[0],
                                                     strict=True))  # fmt: skip
