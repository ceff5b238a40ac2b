"""Log spectrogram features: the one implementation, for training and serving alike.

Frame i covers samples [i * hop, i * hop + window): no centering and no padding,
so a frame depends only on its own samples and `FeatureStream` can produce the
frames of live audio chunk by chunk, bit for bit equal to `compute_features` on
the whole recording. Every frame is computed by the same row-wise arithmetic
(per-row FFT, elementwise products, and the mel filterbank as matrix products of
one fixed shape rather than one product of all rows, whose rounding can depend on
how many rows it is given), so the chunking never changes a bit.

There is no per-utterance normalisation: the network normalises with fixed
statistics, and per-utterance statistics would need audio that a stream has not
received yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class FeatureConfig:
    sample_rate: int = 16000  # Hz, rate the audio is resampled to before framing
    window_ms: float = 20.0  # analysis window length, ms
    hop_ms: float = 10.0  # frame shift, ms
    n_fft: int = 0  # FFT size, samples; 0 = the window length (>= window length otherwise)
    mel_bins: int = 0  # 0 = linear-frequency log spectrogram (n_fft//2+1 bins); >0 = log mel bins
    log_floor: float = 1e-10  # power added before the log, (full scale)^2

    def __post_init__(self) -> None:
        if self.sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {self.sample_rate}")
        if self.window_ms <= 0 or self.hop_ms <= 0:
            raise ValueError(
                f"window_ms and hop_ms must be positive, got {self.window_ms}, {self.hop_ms}"
            )
        if self.hop_ms > self.window_ms:
            raise ValueError(f"hop_ms ({self.hop_ms}) must not exceed window_ms ({self.window_ms})")
        for name in ("window_ms", "hop_ms"):
            samples = getattr(self, name) * self.sample_rate / 1000
            if abs(samples - round(samples)) > 1e-6:
                raise ValueError(
                    f"{name}={getattr(self, name)} is {samples:g} samples at {self.sample_rate} Hz;"
                    " it must be a whole number of samples"
                )
        if self.n_fft < 0 or (self.n_fft and self.n_fft < self.window_samples):
            raise ValueError(
                f"n_fft must be 0 or at least the window length ({self.window_samples}), "
                f"got {self.n_fft}"
            )
        if self.mel_bins < 0:
            raise ValueError(f"mel_bins must be 0 (linear) or positive, got {self.mel_bins}")
        if not (self.log_floor > 0 and math.isfinite(self.log_floor)):
            raise ValueError(f"log_floor must be a positive number, got {self.log_floor}")
        if self.mel_bins:
            _mel_matrix(self.sample_rate, self.fft_size, self.mel_bins)  # raises on empty filters

    @property
    def window_samples(self) -> int:
        return round(self.window_ms * self.sample_rate / 1000)

    @property
    def hop_samples(self) -> int:
        return round(self.hop_ms * self.sample_rate / 1000)

    @property
    def fft_size(self) -> int:
        """The FFT length actually used, samples."""
        return self.n_fft or self.window_samples

    @property
    def num_features(self) -> int:
        return self.mel_bins or self.fft_size // 2 + 1


def num_frames(num_samples: int, cfg: FeatureConfig) -> int:
    """Frames produced from `num_samples` samples (0 when shorter than one window)."""
    if num_samples < cfg.window_samples:
        return 0
    return 1 + (num_samples - cfg.window_samples) // cfg.hop_samples


# ---------------------------------------------------------------- mel filterbank


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + hz / 700.0)  # HTK


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


@lru_cache(maxsize=16)
def _mel_matrix(sample_rate: int, n_fft: int, mel_bins: int) -> np.ndarray:
    """The filterbank (F, M), checked: every filter covers at least one FFT bin."""
    fb = mel_filterbank(sample_rate, n_fft, mel_bins)  # (F, M)
    counts = (fb > 0).sum(axis=0)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise ValueError(
            f"mel_bins={mel_bins} is too many for n_fft={n_fft} at {sample_rate} Hz: "
            f"mel filter {int(empty[0])} covers no FFT bin; use fewer mel bins or a larger n_fft"
        )
    fb.flags.writeable = False
    return fb


def mel_filterbank(sample_rate: int, n_fft: int, mel_bins: int) -> np.ndarray:
    """Triangular HTK-mel filters from 0 Hz to sample_rate / 2, shape (n_fft//2+1, mel_bins).

    Triangles are linear in Hz between mel-spaced corners, unnormalised (peak 1),
    as torchaudio's `melscale_fbanks(norm=None, mel_scale="htk")`.
    """
    bin_hz = np.arange(n_fft // 2 + 1) * (sample_rate / n_fft)  # (F,)
    corners = _mel_to_hz(np.linspace(0.0, _hz_to_mel(np.float64(sample_rate / 2)), mel_bins + 2))
    lower, center, upper = corners[:-2], corners[1:-1], corners[2:]  # (M,) each
    rising = (bin_hz[:, None] - lower) / (center - lower)  # (F, M)
    falling = (upper - bin_hz[:, None]) / (upper - center)  # (F, M)
    return np.maximum(0.0, np.minimum(rising, falling))


# ---------------------------------------------------------------- features


MEL_TILE = 16  # rows per filterbank product (see frame_features)


@lru_cache(maxsize=16)
def _hann(length: int) -> np.ndarray:
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(length) / length)  # periodic
    window.flags.writeable = False
    return window


def _as_samples(samples: np.ndarray) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise ValueError(f"samples must be mono with shape (N,), got {samples.shape}")
    if not np.issubdtype(samples.dtype, np.floating):
        raise TypeError(
            f"samples must be float in [-1, 1], got {samples.dtype} (decode with model.audio)"
        )
    return np.ascontiguousarray(samples, dtype=np.float32)


def _frames(samples: np.ndarray, count: int, cfg: FeatureConfig) -> np.ndarray:
    """The first `count` frames of `samples` as a (count, window) view."""
    window, hop = cfg.window_samples, cfg.hop_samples
    if count == 0:
        return np.zeros((0, window), dtype=np.float32)
    return sliding_window_view(samples, window)[: (count - 1) * hop + 1 : hop]


def _features(samples: np.ndarray, count: int, cfg: FeatureConfig) -> np.ndarray:
    """Features of the first `count` frames of float32 `samples`; (count, F) float32."""
    return frame_features(_frames(samples, count, cfg), cfg)


def frame_features(frames: np.ndarray, cfg: FeatureConfig) -> np.ndarray:
    """Features (T, F) float32 of frames of samples (T, window): any frames, of any
    streams, in any number; each row's bits depend on that frame alone."""
    if len(frames) == 0:
        return np.zeros((0, cfg.num_features), dtype=np.float32)
    window = cfg.window_samples
    spectrum = np.fft.rfft(frames * _hann(window), n=cfg.fft_size, axis=1)  # (T, n_fft//2+1)
    power = spectrum.real**2 + spectrum.imag**2  # (T, n_fft//2+1) float64
    if cfg.mel_bins:
        fb = _mel_matrix(cfg.sample_rate, cfg.fft_size, cfg.mel_bins)  # (F, M)
        # One product of MEL_TILE rows at a time, zero-padded: every row goes through a
        # product of the same shape whatever T and its place in T, so its bits depend on
        # that row alone (one product of all T rows is not so: the rows at its edges
        # round otherwise), and features computed in chunks equal features at once.
        count = len(power)
        tiles = -(-count // MEL_TILE)
        padded = np.zeros((tiles * MEL_TILE, power.shape[1]))
        padded[:count] = power
        power = np.matmul(padded.reshape(tiles, MEL_TILE, -1), fb).reshape(-1, fb.shape[1])
        power = power[:count]  # (T, M)
    return np.log(power + cfg.log_floor).astype(np.float32)  # (T, F)


def compute_features(samples: np.ndarray, cfg: FeatureConfig) -> np.ndarray:
    """Log (mel) power spectrogram of mono float samples in [-1, 1]: (T, F) float32."""
    samples = _as_samples(samples)
    return _features(samples, num_frames(samples.size, cfg), cfg)


def normalize_utterance(samples: np.ndarray) -> np.ndarray:
    """Zero mean and unit variance over the utterance's own samples: the waveform input
    of an imported wav2vec2-style model (its feature extractor's `do_normalize`, with
    the same 1e-7 added to the variance). float32 (S,)."""
    x = _as_samples(samples).astype(np.float64)
    if not x.size:
        return x.astype(np.float32)
    return ((x - x.mean()) / np.sqrt(x.var() + 1e-7)).astype(np.float32)


class FeatureStream:
    """Incremental `compute_features`: the concatenated outputs of `accept` over any
    chunking equal `compute_features` on the whole audio, bit for bit.

    Two ways to use it: `accept(samples)` returns the frames that the samples
    complete; or `push(samples)` only stores them, and `batch_features(streams)`
    later computes the pending frames of many streams in one batch (the same bits).
    """

    def __init__(self, cfg: FeatureConfig) -> None:
        self.cfg = cfg
        self.frames_emitted = 0  # frames taken so far
        self._pending = np.zeros(0, dtype=np.float32)  # samples not yet consumed by a frame
        self._pushed: list[np.ndarray] = []  # samples pushed since, in order
        self._pushed_size = 0  # their total, samples

    def push(self, samples: np.ndarray) -> None:
        """Add samples without computing anything yet."""
        samples = _as_samples(samples)
        if samples.size:
            self._pushed.append(samples)
            self._pushed_size += samples.size

    @property
    def frames_pending(self) -> int:
        """Frames that the samples added so far complete and nothing has taken yet."""
        return num_frames(self._pending.size + self._pushed_size, self.cfg)

    def take_frames(self) -> np.ndarray:
        """The pending frames as samples, (n, window) float32 (a view; n may be 0)."""
        if self._pushed:
            self._pending = np.concatenate([self._pending, *self._pushed])
            self._pushed, self._pushed_size = [], 0
        count = num_frames(self._pending.size, self.cfg)
        frames = _frames(self._pending, count, self.cfg)
        # Keep from the start of the next frame on (the window may overlap this chunk's
        # frames); `frames` keeps the old buffer alive.
        self._pending = self._pending[count * self.cfg.hop_samples :].copy()
        self.frames_emitted += count
        return frames

    def accept(self, samples: np.ndarray) -> np.ndarray:
        """Add samples; return the frames they complete, (n, F) float32 (n may be 0)."""
        self.push(samples)
        return frame_features(self.take_frames(), self.cfg)


def batch_features(streams: list[FeatureStream]) -> list[np.ndarray]:
    """Each stream's pending frames, (n_i, F) float32, computed as one batch: one FFT
    call and one filterbank reduction for all of them instead of one per stream; each
    stream gets the same bits as its own `accept` would have given."""
    if not streams:
        return []
    cfg = streams[0].cfg
    if any(s.cfg != cfg for s in streams):
        raise ValueError("batch_features needs streams of one feature config")
    frames = [s.take_frames() for s in streams]
    counts = np.cumsum([len(f) for f in frames])[:-1]
    return np.split(frame_features(np.concatenate(frames), cfg), counts)


# ---------------------------------------------------------------- NeMo's recipe


@dataclass(frozen=True)
class NemoFeatureConfig:
    """NVIDIA NeMo's log-mel features (`AudioToMelSpectrogramPreprocessor`, whose work
    is `FilterbankFeatures`) at inference, for a model imported from NeMo: the card's
    `feature_recipe` "nemo". The values are the preprocessor's config, in its terms.

    Per utterance: pre-emphasis; a centred STFT (zero padding of n_fft // 2 each side)
    with a symmetric window of `window_samples` in the middle of `n_fft`; magnitude to
    the power `mag_power`; mel filters (librosa's: Slaney's mel scale, area-normalised
    with `mel_norm` "slaney"); the log with a zero guard; then per-utterance
    normalisation over the valid frames. NeMo counts (S + 2 * (n_fft // 2) - n_fft) //
    hop valid frames, one fewer than the STFT gives: the last is dropped, as NeMo masks
    it. Dither is a training-time augmentation in NeMo and is not applied. Padding to a
    multiple of `pad_to` frames is the graph's (see model/nn/nemo_import.py), not this.
    """

    sample_rate: int = 16000  # Hz
    window_samples: int = 400  # analysis window (NeMo's window_size * sample_rate), samples
    hop_samples: int = 160  # frame shift (window_stride * sample_rate), samples
    n_fft: int = 512  # FFT size, samples (>= window_samples)
    window: Literal["hann", "hamming", "blackman", "bartlett"] = "hann"  # symmetric (torch's
    # periodic=False)
    preemph: float = 0.97  # x[t] - preemph * x[t-1]; 0 = none
    mel_bins: int = 80  # NeMo's `features` (nfilt)
    low_hz: float = 0.0  # lowest mel filter edge, Hz (lowfreq)
    high_hz: float = 0.0  # highest mel filter edge, Hz (highfreq); 0 = sample_rate / 2
    mel_norm: Literal["slaney", "none"] = "slaney"  # filter area normalisation
    mag_power: float = 2.0  # |STFT| ** mag_power (2: power, 1: magnitude)
    log: bool = True  # take the log of the mel energies
    log_guard: Literal["add", "clamp"] = "add"  # log(x + g), or log(max(x, g))
    log_guard_value: float = 2.0**-24  # g ("tiny"/"eps" in NeMo: float32's, written here)
    normalize: Literal["per_feature", "all_features", "none"] = "per_feature"  # statistics
    # over each utterance's valid frames: per mel bin, or over all values

    def __post_init__(self) -> None:
        if self.sample_rate <= 0 or self.window_samples <= 0 or self.hop_samples <= 0:
            raise ValueError("sample_rate, window_samples and hop_samples must be positive")
        if self.n_fft < self.window_samples:
            raise ValueError(f"n_fft ({self.n_fft}) must be at least the window length")
        if self.mel_bins <= 0 or not 0 <= self.low_hz < self.top_hz <= self.sample_rate / 2:
            raise ValueError(
                f"mel filters need mel_bins >= 1 and 0 <= low_hz < high_hz <= sample_rate / 2, "
                f"got {self.mel_bins}, {self.low_hz}, {self.high_hz}"
            )
        if not self.log_guard_value > 0:
            raise ValueError(f"log_guard_value must be positive, got {self.log_guard_value}")

    @property
    def top_hz(self) -> float:
        return self.high_hz or self.sample_rate / 2

    @property
    def hop_ms(self) -> float:
        return 1000.0 * self.hop_samples / self.sample_rate

    def num_frames(self, num_samples: int) -> int:
        """Valid frames of `num_samples` samples, as NeMo counts them."""
        return max(0, (num_samples + 2 * (self.n_fft // 2) - self.n_fft) // self.hop_samples)


def _slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default, `htk=False`): linear below 1 kHz, log above."""
    hz = np.asarray(hz, dtype=np.float64)
    step = math.log(6.4) / 27.0
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / step, hz * 0.015)


def _slaney_hz(mel: np.ndarray) -> np.ndarray:
    step = math.log(6.4) / 27.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(step * (mel - 15.0)), mel / 0.015)


@lru_cache(maxsize=8)
def nemo_mel_filters(cfg: NemoFeatureConfig) -> np.ndarray:
    """The filterbank (M, n_fft//2+1) float32 NeMo builds with `librosa.filters.mel`."""
    bin_hz = np.linspace(0.0, cfg.sample_rate / 2, cfg.n_fft // 2 + 1)
    edges = _slaney_mel(np.array([cfg.low_hz, cfg.top_hz]))
    corners = _slaney_hz(np.linspace(edges[0], edges[1], cfg.mel_bins + 2))  # (M + 2,)
    widths = np.diff(corners)
    ramps = corners[:, None] - bin_hz[None, :]  # (M + 2, F)
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    filters = np.maximum(0.0, np.minimum(rising, falling))  # (M, F)
    if cfg.mel_norm == "slaney":
        filters *= (2.0 / (corners[2:] - corners[:-2]))[:, None]
    filters = filters.astype(np.float32)
    filters.flags.writeable = False
    return filters


@lru_cache(maxsize=8)
def _nemo_window(kind: str, length: int, n_fft: int) -> np.ndarray:
    """torch's symmetric window of `length`, centred in `n_fft` zeros (torch.stft's)."""
    n = np.arange(length) / max(length - 1, 1)
    window = {
        "hann": 0.5 - 0.5 * np.cos(2 * np.pi * n),
        "hamming": 0.54 - 0.46 * np.cos(2 * np.pi * n),
        "blackman": 0.42 - 0.5 * np.cos(2 * np.pi * n) + 0.08 * np.cos(4 * np.pi * n),
        "bartlett": 1.0 - np.abs(2.0 * n - 1.0),
    }[kind]
    left = (n_fft - length) // 2
    padded = np.zeros(n_fft)
    padded[left : left + length] = window
    padded.flags.writeable = False
    return padded


def nemo_features(samples: np.ndarray, cfg: NemoFeatureConfig) -> np.ndarray:
    """NeMo's features of one utterance (mono float in [-1, 1]): (T, M) float32, T =
    `cfg.num_frames(len(samples))`, normalised over the utterance (see NemoFeatureConfig).
    Computed in float64; NeMo's float32 agrees to about 1e-4 (tests/test_nemo_import.py)."""
    x = _as_samples(samples).astype(np.float64)
    count = cfg.num_frames(x.size)
    if count == 0:
        return np.zeros((0, cfg.mel_bins), dtype=np.float32)
    if cfg.preemph:
        x = np.concatenate([x[:1], x[1:] - cfg.preemph * x[:-1]])
    half = cfg.n_fft // 2
    x = np.pad(x, (half, half))
    frames = sliding_window_view(x, cfg.n_fft)[
        : (count - 1) * cfg.hop_samples + 1 : cfg.hop_samples
    ]
    window = _nemo_window(cfg.window, cfg.window_samples, cfg.n_fft)
    spectrum = np.abs(np.fft.rfft(frames * window, axis=1))  # (T, F)
    if cfg.mag_power != 1.0:
        spectrum = spectrum**cfg.mag_power
    mel = spectrum @ nemo_mel_filters(cfg).T.astype(np.float64)  # (T, M)
    if cfg.log:
        g = cfg.log_guard_value
        mel = np.log(mel + g) if cfg.log_guard == "add" else np.log(np.maximum(mel, g))
    if cfg.normalize == "per_feature":
        mean = mel.mean(axis=0)
        std = np.sqrt(((mel - mean) ** 2).sum(axis=0) / (count - 1)) if count > 1 else 0.0
        mel = (mel - mean) / (std + 1e-5)
    elif cfg.normalize == "all_features":
        std = mel.std(ddof=1) if mel.size > 1 else 0.0
        mel = (mel - mel.mean()) / (std + 1e-5)
    return mel.astype(np.float32)
