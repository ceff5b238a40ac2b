"""On-the-fly augmentation in the data loader: other speeds, levels, rooms, noise and phone
lines than the training voices came with, so that the model learns speech rather than
the corpus's recording conditions.

Each transform has a probability (`AugmentConfig`, the recipe's `[data.augment]`; all 0
by default: no augmentation). What happens to an utterance is drawn from a generator
keyed by (seed, epoch, utterance index) alone, so it differs every epoch, is the same
whatever the number of loader workers or ranks, and a resumed run draws what an
uninterrupted one would (determinism holds).

A share of the utterances (`clean_prob`) is left as the corpus has it on the waveform
(SpecAugment still applies), so that every batch keeps some clean speech whatever the
other probabilities: a fine-tune that augments everything forgets the clean voices it
started from.

On the waveform, in this order (a room comes before the line, the line before the
noise on it, the level and the clipping last):

- speed perturbation: resampled by a factor in `speed` (pitch and tempo change
  together, as in Kaldi's speed perturbation);
- room reverberation: convolution with a simulated room impulse response (a direct
  path, then exponentially decaying noise with an RT60 in `rt60`, in `RIR_BANK`
  responses made once per process from the seed);
- narrowband telephone: band-limited to 300-3400 Hz, at 8 kHz through a G.711 mu-law
  or A-law round trip, back to the model's rate;
- additive noise at an SNR in `snr_db`: white, pink or brown, or babble (several other
  utterances of the corpus, summed);
- level: scaled to an RMS level in `level_dbfs` (dB below full scale);
- clipping: clipped at a fraction `clip_level` of its peak.

On the features: SpecAugment (Park et al. 2019) frequency and time masks, set to the
utterance's mean so that a mask carries no level information.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import soxr

from echoic.model.core.audio import g711_table
from echoic.training.synth import make_noise  # white, pink or brown noise at unit RMS

NOISE_KINDS = ("white", "pink", "brown", "babble")
RIR_BANK = 64  # room impulse responses simulated per process, count
BABBLE_TALKERS = (3, 6)  # other utterances summed into babble, count range


@dataclass(frozen=True)
class AugmentConfig:
    clean_prob: float = 0.0  # chance that the waveform is left untouched, 0-1
    speed_prob: float = 0.0  # chance of speed perturbation, 0-1
    speed: tuple[float, float] = (0.9, 1.1)  # speed factor range, x
    reverb_prob: float = 0.0  # chance of room reverberation, 0-1
    rt60: tuple[float, float] = (0.2, 0.9)  # reverberation time range, s
    telephone_prob: float = 0.0  # chance of the narrowband telephone line, 0-1
    noise_prob: float = 0.0  # chance of additive noise, 0-1
    snr_db: tuple[float, float] = (5.0, 30.0)  # speech-to-noise ratio range, dB
    noise_kinds: tuple[str, ...] = NOISE_KINDS  # noise drawn from these, names
    level_prob: float = 0.0  # chance of a new level, 0-1
    level_dbfs: tuple[float, float] = (-35.0, -5.0)  # RMS level range, dB below full scale
    clip_prob: float = 0.0  # chance of clipping, 0-1
    clip_level: tuple[float, float] = (0.3, 0.8)  # clipping point range, x the peak
    freq_masks: int = 0  # SpecAugment frequency masks per utterance, count
    freq_width: int = 8  # widest frequency mask, feature bins
    time_masks: int = 0  # SpecAugment time masks per utterance, count
    time_width: float = 0.05  # widest time mask, fraction of the utterance

    def __post_init__(self) -> None:
        probs = ("clean_prob", "speed_prob", "reverb_prob", "telephone_prob", "noise_prob",
                 "level_prob", "clip_prob")  # fmt: skip
        for name in probs:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"augment.{name} must be in [0, 1], got {getattr(self, name)}")
        ranges = ("speed", "rt60", "snr_db", "level_dbfs", "clip_level")
        for name in ranges:
            lo, hi = getattr(self, name)
            if lo > hi:
                raise ValueError(f"augment.{name}: low {lo} is above high {hi}")
        if min(self.speed) <= 0 or min(self.rt60) <= 0 or not 0 < min(self.clip_level):
            raise ValueError("augment.speed, rt60 and clip_level must be positive")
        if max(self.level_dbfs) > 0 or max(self.clip_level) > 1:
            raise ValueError("augment.level_dbfs must be <= 0 and clip_level <= 1")
        bad = [k for k in self.noise_kinds if k not in NOISE_KINDS]
        if bad or not self.noise_kinds:
            raise ValueError(f"augment.noise_kinds: {bad or 'none'} (from {NOISE_KINDS})")
        if self.freq_masks < 0 or self.time_masks < 0 or self.freq_width < 0:
            raise ValueError("augment masks and widths must not be negative")
        if not 0 <= self.time_width < 1:
            raise ValueError("augment.time_width must be in [0, 1)")

    @property
    def active(self) -> bool:
        """Whether anything is augmented."""
        probs = (self.speed_prob, self.reverb_prob, self.telephone_prob, self.noise_prob,
                 self.level_prob, self.clip_prob)  # fmt: skip
        return any(probs) or bool(self.freq_masks or self.time_masks)


def _rng(seed: int, epoch: int, index: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, index, stream])


class Augmenter:
    """Applies an `AugmentConfig` to utterances; `other(i, rng)` gives the samples of
    another utterance (for babble). Pure functions of (seed, epoch, index)."""

    def __init__(
        self,
        cfg: AugmentConfig,
        seed: int,
        sample_rate: int,
        other: Callable[[np.random.Generator], np.ndarray] | None = None,
    ) -> None:
        self.cfg, self.seed, self.rate = cfg, seed, sample_rate
        self._other = other
        self._rirs: list[np.ndarray] | None = None

    # ------------------------------------------------------------------ waveform

    def waveform(self, samples: np.ndarray, epoch: int, index: int) -> np.ndarray:
        """The augmented float32 samples of utterance `index` in `epoch`."""
        cfg = self.cfg
        # Each transform draws from a generator of its own, so that turning one off or
        # changing its range leaves what the others do as it was.
        speed, room, line, noise, level, clipping = (
            _rng(self.seed, epoch, index, 10 + k) for k in range(6)
        )
        x = samples.astype(np.float32, copy=False)
        # Its own stream too: with clean_prob 0 nothing else draws differently.
        if cfg.clean_prob and _rng(self.seed, epoch, index, 16).random() < cfg.clean_prob:
            return x
        if speed.random() < cfg.speed_prob:
            x = speed_perturb(x, float(speed.uniform(*cfg.speed)))
        if room.random() < cfg.reverb_prob:
            x = reverberate(x, self._rir(room))
        if line.random() < cfg.telephone_prob:
            x = telephone(x, self.rate, "mulaw" if line.random() < 0.5 else "alaw")
        if noise.random() < cfg.noise_prob:
            kind = str(noise.choice(cfg.noise_kinds))
            snr = float(noise.uniform(*cfg.snr_db))
            x = add_noise(x, self._noise(kind, len(x), noise), snr)
        if level.random() < cfg.level_prob:
            x = set_level(x, float(level.uniform(*cfg.level_dbfs)))
        if clipping.random() < cfg.clip_prob:
            x = clip(x, float(clipping.uniform(*cfg.clip_level)))
        return np.clip(x, -1.0, 1.0).astype(np.float32)

    def _rir(self, rng: np.random.Generator) -> np.ndarray:
        if self._rirs is None:
            bank = np.random.default_rng([self.seed, 0x5EED])
            self._rirs = [room_impulse_response(float(bank.uniform(*self.cfg.rt60)), self.rate,
                                                bank) for _ in range(RIR_BANK)]  # fmt: skip
        return self._rirs[int(rng.integers(len(self._rirs)))]

    def _noise(self, kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
        if kind != "babble" or self._other is None:
            return make_noise("white" if kind == "babble" else kind, n, rng)
        babble = np.zeros(n, np.float32)
        for _ in range(int(rng.integers(BABBLE_TALKERS[0], BABBLE_TALKERS[1] + 1))):
            talker = self._other(rng)
            if len(talker) == 0:
                continue
            start = int(rng.integers(len(talker)))
            piece = np.resize(np.roll(talker, -start), n)  # repeated to length n
            babble += piece / max(_rms(piece), 1e-4)
        return babble

    # ------------------------------------------------------------------ features

    def features(self, features: np.ndarray, epoch: int, index: int) -> np.ndarray:
        """SpecAugment masks on (T, F) features."""
        cfg = self.cfg
        if not (cfg.freq_masks or cfg.time_masks) or features.size == 0:
            return features
        rng = _rng(self.seed, epoch, index, 1)
        out = features.copy()
        fill = out.mean(axis=0)  # (F,): a masked bin carries no level
        t, f = out.shape
        for _ in range(cfg.freq_masks):
            width = int(rng.integers(0, min(cfg.freq_width, f) + 1))
            start = int(rng.integers(0, f - width + 1))
            out[:, start : start + width] = fill[start : start + width]
        longest = int(cfg.time_width * t)
        for _ in range(cfg.time_masks):
            width = int(rng.integers(0, longest + 1))
            start = int(rng.integers(0, t - width + 1))
            out[start : start + width] = fill
        return out


# ---------------------------------------------------------------- the transforms


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if x.size else 0.0


def speed_perturb(x: np.ndarray, factor: float) -> np.ndarray:
    """Played `factor` times faster (pitch up with it): resampled to 1/factor the length."""
    if factor == 1.0 or x.size == 0:
        return x
    # Resampling from rate r*factor to r: a clip of n samples becomes n / factor.
    base = 16000
    return soxr.resample(x, round(base * factor), base).astype(np.float32)


def room_impulse_response(rt60: float, rate: int, rng: np.random.Generator) -> np.ndarray:
    """A simulated room: a direct path, a few early reflections, then a diffuse tail of
    noise decaying 60 dB in `rt60` s, normalised to unit energy."""
    n = max(int(rt60 * rate), 16)
    t = np.arange(n) / rate
    tail = rng.standard_normal(n) * np.exp(-6.9078 * t / rt60)  # ln(1000) = 6.9078: -60 dB
    onset = int(rate * float(rng.uniform(0.002, 0.01)))  # the diffuse part starts later
    tail[:onset] = 0.0
    rir = tail * float(rng.uniform(0.2, 0.6))
    rir[0] = 1.0
    for _ in range(4):
        rir[int(rng.integers(1, max(onset, 2)))] += float(rng.uniform(0.1, 0.5))
    return (rir / np.sqrt(np.sum(rir**2))).astype(np.float32)


def reverberate(x: np.ndarray, rir: np.ndarray) -> np.ndarray:
    """`x` in the room of `rir`, as long as `x`, at the level it had."""
    if x.size == 0:
        return x
    size = 1 << math.ceil(math.log2(len(x) + len(rir)))
    wet = np.fft.irfft(np.fft.rfft(x, size) * np.fft.rfft(rir, size), size)[: len(x)]
    return (wet * (_rms(x) / max(_rms(wet), 1e-9))).astype(np.float32)


def _g711_encode(x: np.ndarray, law: str) -> np.ndarray:
    """The G.711 byte nearest each sample (by the decoder's own table)."""
    table = g711_table(law)
    order = np.argsort(table)
    values = table[order]
    pos = np.clip(np.searchsorted(values, x), 1, len(values) - 1)
    nearer = np.where(np.abs(values[pos - 1] - x) <= np.abs(values[pos] - x), pos - 1, pos)
    return order[nearer].astype(np.uint8)


def narrowband(x: np.ndarray, rate: int) -> np.ndarray:
    """`x` as a phone line carries it: at 8 kHz, 300-3400 Hz only, in [-1, 1]."""
    narrow = soxr.resample(x, rate, 8000) if rate != 8000 else x.copy()
    spectrum = np.fft.rfft(narrow)
    freqs = np.fft.rfftfreq(len(narrow), 1 / 8000)
    spectrum[(freqs < 300) | (freqs > 3400)] = 0.0
    return np.clip(np.fft.irfft(spectrum, len(narrow)), -1.0, 1.0).astype(np.float32)


def telephone(x: np.ndarray, rate: int, law: str = "mulaw") -> np.ndarray:
    """A narrowband phone line: 300-3400 Hz, 8 kHz, G.711 `law`, back at `rate`."""
    if x.size == 0:
        return x
    band = narrowband(x, rate)
    line = g711_table(law)[_g711_encode(band, law)]
    return (soxr.resample(line, 8000, rate) if rate != 8000 else line).astype(np.float32)


def add_noise(x: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """`x` plus `noise` scaled to `snr_db` below the speech's RMS."""
    scale = _rms(x) / max(_rms(noise), 1e-9) / 10 ** (snr_db / 20)
    return (x + noise * np.float32(scale)).astype(np.float32)


def set_level(x: np.ndarray, dbfs: float) -> np.ndarray:
    """`x` at an RMS of `dbfs` dB below full scale (a sine at full scale is -3 dBFS)."""
    rms = _rms(x)
    return x if rms == 0 else (x * np.float32(10 ** (dbfs / 20) / rms)).astype(np.float32)


def clip(x: np.ndarray, level: float) -> np.ndarray:
    """`x` clipped at `level` times its peak, as an overdriven input stage does."""
    peak = float(np.max(np.abs(x))) if x.size else 0.0
    return np.clip(x, -level * peak, level * peak).astype(np.float32) if peak else x
