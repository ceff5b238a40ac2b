"""Audio in, transcripts out: an exported model plus a CTC decoder (numpy + onnxruntime).

Two ways in, one model:

- `Recognizer.transcribe(audios)`: whole utterances, run as one padded batch
  through model.onnx (batch jobs, `echoic transcribe`, `echoic eval`).
- `Recognizer.stream()`: a `Stream` per live utterance, with the small API
  `accept_audio()`, `is_ready()`, `finish()`, `result()`. Streams do not run the
  model themselves, nor compute their features: `accept_audio` only stores the
  samples, and `Recognizer.step(streams)` computes the new feature frames of every
  stream that has a window ready as one batch, then runs one batched stream.onnx
  call for them. That is the one place where streaming work is batched; the
  server's dispatcher calls it.

Streaming output equals offline output for the same audio (the model was
trained chunked; `Engine` and `WindowFeeder` pad exactly as the network does).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from echoic.model.core.decoding import (
    BeamSearchDecoder,
    GreedyDecoder,
    StreamingDecoder,
    Transcript,
)
from echoic.model.core.features import (
    FeatureStream,
    batch_features,
    compute_features,
    frame_features,
)
from echoic.model.runtime.engine import Engine, StreamState, WindowFeeder

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "default"
LM_FILE = "lm.arpa"  # an optional word LM shipped beside the graphs


def default_model_dir() -> Path:
    """The model bundled with the package (used when no model is named)."""
    return DEFAULT_MODEL_DIR


@dataclass(frozen=True)
class DecoderConfig:
    kind: str = "greedy"  # "greedy" or "beam"
    beam_size: int = 32  # hypotheses kept per frame (beam)
    lm_path: str = ""  # ARPA word LM; "" = the model directory's lm.arpa when present
    use_lm: bool = True  # with kind="beam": use the LM when one is found
    lm_weight: float = 0.5  # LM weight (beam), natural-log units per LM log-prob
    word_bonus: float = 1.0  # score added per word (beam), nats

    def __post_init__(self) -> None:
        if self.kind not in ("greedy", "beam"):
            raise ValueError(f"decoder kind must be 'greedy' or 'beam', got {self.kind!r}")


class Recognizer:
    """An `Engine` and a decoder; thread-safe (ONNX Runtime sessions are)."""

    def __init__(
        self,
        model: str | Path | Engine | None = None,
        decoder: DecoderConfig | None = None,
        *,
        intra_op_threads: int = 0,
        providers: Sequence[str] = ("CPUExecutionProvider",),
    ) -> None:
        if isinstance(model, Engine):
            self.engine = model
        else:
            self.engine = Engine(
                model or default_model_dir(),
                providers=providers,
                intra_op_threads=intra_op_threads,
            )
        self.card = self.engine.card
        self.vocab = self.card.vocab
        self.frame_seconds = self.card.output_frame_ms / 1000.0
        self.decoder_config = decoder or DecoderConfig()
        self.lm_path: str | None = None  # the word LM in use (beam search)
        self.decoder = self._make_decoder(self.decoder_config)

    @property
    def sample_rate(self) -> int:
        return self.card.sample_rate

    def _make_decoder(self, cfg: DecoderConfig) -> GreedyDecoder | BeamSearchDecoder:
        if cfg.kind == "greedy":
            return GreedyDecoder(self.vocab, frame_seconds=self.frame_seconds)
        lm = cfg.lm_path or None
        if lm is None and cfg.use_lm and (self.engine.model_dir / LM_FILE).is_file():
            lm = str(self.engine.model_dir / LM_FILE)
        self.lm_path = lm if cfg.use_lm else None
        return BeamSearchDecoder(
            self.vocab,
            frame_seconds=self.frame_seconds,
            beam_size=cfg.beam_size,
            lm_path=lm if cfg.use_lm else None,
            lm_weight=cfg.lm_weight,
            word_bonus=cfg.word_bonus,
        )

    # ---- offline -------------------------------------------------------------------

    def log_probs(self, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Log-probs (T', V) of each utterance (float32 mono at `sample_rate`)."""
        feats = [
            compute_features(np.asarray(a, dtype=np.float32), self.card.features) for a in audios
        ]
        return self.engine.offline(feats)

    def transcribe(self, audios: Sequence[np.ndarray]) -> list[Transcript]:
        """Transcripts of whole utterances, run through the model as one batch."""
        return [self.decoder.decode(lp) for lp in self.log_probs(audios)]

    # ---- streaming -----------------------------------------------------------------

    def stream(self) -> Stream:
        return Stream(self)

    def step(self, streams: Sequence[Stream]) -> int:
        """One batched stream.onnx call for every given stream with a window ready.

        Returns the number of streams that advanced. Each stream contributes at
        most one window per call, so a call costs one model step whatever the mix.
        """
        ready = [s for s in streams if s.is_ready()]
        if not ready:
            return 0
        self._compute_features(ready)
        windows, frames = zip(*(s._take_window() for s in ready), strict=True)
        states = self.engine.gather_states([s._state for s in ready])
        log_probs, new_states = self.engine.stream_step(
            np.stack(windows), np.asarray(frames, dtype=np.int64), states
        )
        for stream, rows, n, state in zip(
            ready, log_probs, frames, self.engine.scatter_states(new_states), strict=True
        ):
            stream._accept_step(rows[: min(self.card.chunk_frames, n)], state)
        return len(ready)

    @staticmethod
    def _compute_features(streams: Sequence[Stream]) -> None:
        """The new feature frames of every stream, as one batch, into their feeders.

        The streams' locks are held throughout (taken in one global order), so audio
        that arrives meanwhile waits, and a finish() cannot come between taking a
        stream's frames and feeding them.
        """
        with ExitStack() as locks:
            for s in sorted(streams, key=id):
                locks.enter_context(s._lock)
            waiting = [s for s in streams if s._features.frames_pending]
            feats = batch_features([s._features for s in waiting])
            for s, f in zip(waiting, feats, strict=True):
                s._feeder.accept(f)

    def stream_all(self, audio: np.ndarray, chunk_samples: int = 1600) -> Transcript:
        """Run one utterance through a stream in pieces (for tests and checks)."""
        s = self.stream()
        for i in range(0, len(audio), chunk_samples):
            s.accept_audio(audio[i : i + chunk_samples])
            while self.step([s]):
                pass
        s.finish()
        while self.step([s]):
            pass
        return s.result()


class Stream:
    """One live utterance: audio in, partial and final transcripts out.

    accept_audio(samples): float32 mono at the model's rate, any length.
    is_ready(): a window is ready for the model (`Recognizer.step` runs it).
    finish(): no more audio; the remaining windows become ready.
    result(): the transcript so far (final once `is_final`).
    """

    def __init__(self, recognizer: Recognizer) -> None:
        self._recognizer = recognizer
        self._features = FeatureStream(recognizer.card.features)
        self._feeder: WindowFeeder = recognizer.engine.feeder()
        self._state: StreamState = recognizer.engine.initial_state(1)
        self._decoder: StreamingDecoder = recognizer.decoder.stream()
        self._n_best = 1
        self._result = Transcript("", (), 0.0)
        self._lock = threading.Lock()
        self.samples_in = 0  # audio samples accepted
        self.frames_decoded = 0  # output frames decoded

    def accept_audio(self, samples: np.ndarray) -> None:
        """Store the samples; their features are computed by `Recognizer.step`, batched."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        with self._lock:
            if self._feeder.finished:
                raise RuntimeError("accept_audio() after finish()")
            self._features.push(samples)
            self.samples_in += len(samples)

    def finish(self) -> None:
        with self._lock:
            if not self._feeder.finished:
                frames = self._features.take_frames()  # the last ones, this stream's alone
                self._feeder.accept(frame_features(frames, self._features.cfg))
                self._feeder.finish()

    @property
    def finished(self) -> bool:
        return self._feeder.finished

    def is_ready(self) -> bool:
        with self._lock:
            return self._feeder.ready(self._features.frames_pending)

    @property
    def is_final(self) -> bool:
        """Finished and every window decoded."""
        return self._feeder.done

    @property
    def audio_seconds(self) -> float:
        return self.samples_in / self._recognizer.sample_rate

    @property
    def decoded_seconds(self) -> float:
        return self.frames_decoded * self._recognizer.frame_seconds

    @property
    def n_best(self) -> int:
        """Transcripts a final result carries, itself included (`Transcript.alternatives`,
        beam search only; greedy decoding has one)."""
        return self._n_best

    @n_best.setter
    def n_best(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n_best must be at least 1, got {n}")
        self._n_best = self._decoder.n_best = n

    def result(self) -> Transcript:
        """The transcript so far; the final one once `is_final`."""
        if self.is_final:
            self._result = self._decoder.finalize()
        return self._result

    def restart_decoder(self) -> Transcript:
        """Finalize the decoder's utterance and start a new one at the current position.

        The recurrent state and the audio position carry on (an endpoint splits the
        transcript, not the acoustic context). Returns the finished utterance.
        """
        final = self._decoder.finalize()
        self._decoder = self._recognizer.decoder.stream()
        self._decoder.n_best = self._n_best
        self._result = Transcript("", (), 0.0)
        return final

    def _take_window(self) -> tuple[np.ndarray, int]:
        with self._lock:
            return self._feeder.next_window()

    def _accept_step(self, log_probs: np.ndarray, state: StreamState) -> None:
        self._state = state
        self.frames_decoded += len(log_probs)
        self._result = self._decoder.accept(log_probs)
