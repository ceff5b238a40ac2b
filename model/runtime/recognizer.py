"""Audio in, transcripts out: an exported model plus a CTC decoder (numpy + onnxruntime).

Two ways in, one model:

- `Recognizer.transcribe(audios)`: whole utterances, run as one padded batch
  through model.onnx (batch jobs, `echoic transcribe`, `echoic eval`).
- `Recognizer.stream()`: a `Stream` per live audio stream, with the small API
  `accept_audio()`, `is_ready()`, `finish()`, `result()`, made with its endpointing
  and decoding settings. Streams do not run the model themselves, nor compute their
  features: `accept_audio` only stores the samples (and `finish` only marks the end),
  and `Recognizer.step(streams)` computes the new feature frames of every stream
  with work ready as one batch, then runs one batched stream.onnx call for those
  with a window ready. That is the one place where streaming work is batched; the
  server's dispatcher calls it, then each stream's `settle`, which says what the
  step gave: the partial utterance, and the utterances that ended (an endpoint, or
  the end of the audio).

Endpointing (as in sherpa-onnx and Riva; the rule is `Endpointing`, shared with
files transcribed locally) is checked after every step: the stream is cut into
utterances, the CTC decoder restarts at each cut, while the acoustic model's
recurrent state and window position carry on, since the audio is one continuous
signal (nothing is dropped or re-padded at the boundary, and no step is spent
warming up a new state). An utterance of silence alone ends without a result, so
silence never produces empty finals. Utterance times are seconds from the start
of the stream's audio.

Streaming output equals offline output for the same audio (the model was
trained chunked; `Engine` and `WindowFeeder` pad exactly as the network does).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from echoic.model.core.decoding import (
    FILE_ENDPOINTING,
    MAX_CUT_DELAY,
    BeamSearchDecoder,
    DecoderConfig,
    Endpointing,
    GreedyDecoder,
    StreamingDecoder,
    Transcript,
    joined,
)

__all__ = [
    "FILE_ENDPOINTING", "MAX_CUT_DELAY", "Endpointing", "Recognizer", "Stepped",
    "Stream", "Utterance", "default_model_dir",
]  # fmt: skip
from echoic.model.core.features import (
    FeatureStream,
    batch_features,
    compute_features,
    nemo_features,
    normalize_utterance,
)
from echoic.model.core.lm import model_lm
from echoic.model.runtime.chunking import (
    WHOLE_SECONDS,
    ChunkConfig,
    ChunkFeeder,
    can_chunk,
    output_frames,
    whole_chunks,
    window_frames,
)
from echoic.model.runtime.engine import Engine, StreamState, WindowFeeder
from echoic.model.runtime.repository import default_model_dir


class Recognizer:
    """An `Engine` and a decoder; thread-safe (ONNX Runtime sessions are)."""

    def __init__(
        self,
        model: str | Path | Engine | None = None,
        decoder: DecoderConfig | None = None,
        *,
        intra_op_threads: int = 0,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        chunking: ChunkConfig | None = ChunkConfig(),  # noqa: B008 - frozen
        whole_seconds: float = WHOLE_SECONDS,
        beam_decoders: Callable[..., Any] | None = None,
    ) -> None:
        """chunking: how a full-context imported model (a wav2vec2, a NeMo model) streams,
        by overlapped chunks (`chunking.py`); None: it does not stream. whole_seconds: the
        longest utterance such a model runs whole (`log_probs`); longer ones run in
        overlapped windows of that length. Other models ignore both.
        beam_decoders: what builds a beam search, called as `BeamSearchDecoder` is (the
        default) and giving an object with its `stream()` and `decode()`: the server's
        decoders in processes of their own (`echoic serve --beam-processes`)."""
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
        self.chunking = chunking if can_chunk(self.card) else None
        if self.chunking is not None:
            self.chunking.check(self.card)
        # Whole utterances over one window's length: by these windows, one at a time.
        self.whole_chunking = (
            whole_chunks(self.card, whole_seconds) if can_chunk(self.card) else None
        )
        self.lm_path = self._lm_path(self.decoder_config)  # the word LM in use (beam search)
        self._beam_decoders = beam_decoders or BeamSearchDecoder
        # Built at first use (`load_decoder`): a beam search's LM takes a while to load,
        # which a job that is refused for its settings should not wait for.
        self._built: Any = None
        self._building = threading.Lock()

    @property
    def sample_rate(self) -> int:
        return self.card.sample_rate

    @property
    def streamable(self) -> bool:
        """Streams: through stream.onnx (equal to offline), or by overlapped chunks."""
        return self.engine.streamable or self.chunking is not None

    @property
    def streams_exactly(self) -> bool:
        """Streaming gives offline's log-probs (stream.onnx); overlapped chunks do not."""
        return self.engine.streamable

    def _lm_path(self, cfg: DecoderConfig) -> str | None:
        """The word LM a beam search of `cfg` uses: its own, else the model's, or none."""
        if cfg.kind == "greedy" or not cfg.use_lm:
            return None
        if cfg.lm_path:
            return cfg.lm_path
        shipped = model_lm(self.engine.model_dir)  # lm.bin before lm.arpa
        return str(shipped) if shipped is not None else None

    def with_decoder(
        self, decoder: DecoderConfig, beam_decoders: Callable[..., Any] | None = None
    ) -> Recognizer:
        """A recognizer with another decoder, sharing this one's engine and chunking, its
        decoder built now (a beam search's LM loaded: by a caller off the requests' path)."""
        recognizer = Recognizer(
            self.engine, decoder, chunking=self.chunking, beam_decoders=beam_decoders
        )
        recognizer.load_decoder()
        return recognizer

    def load_decoder(self) -> None:
        """Build the decoder now (a beam search loads its LM) rather than at first use."""
        self._decoder  # noqa: B018 - the property builds it

    @property
    def _decoder(self) -> Any:
        if self._built is None:
            with self._building:
                if self._built is None:
                    self._built = self._make_decoder(self.decoder_config)
        return self._built

    def _make_decoder(self, cfg: DecoderConfig) -> Any:
        if cfg.kind == "greedy":
            return GreedyDecoder(self.vocab, frame_seconds=self.frame_seconds)
        return self._beam_decoders(
            self.vocab,
            frame_seconds=self.frame_seconds,
            beam_size=cfg.beam_size,
            lm_path=self.lm_path,
            lm_weight=cfg.lm_weight,
            word_bonus=cfg.word_bonus,
            boost=cfg.boost,
        )

    # ---- offline -------------------------------------------------------------------

    def model_input(self, audio: np.ndarray) -> np.ndarray:
        """What model.onnx takes for one utterance, as the card says: its features (echoic's,
        or for a model imported from NeMo, NeMo's recipe), or (an imported waveform model)
        its samples, normalised when the card asks."""
        audio = np.asarray(audio, dtype=np.float32)
        if self.card.nemo_features is not None:
            return nemo_features(audio.reshape(-1), self.card.nemo_features)
        if self.card.input == "features":
            return compute_features(audio, self.card.features)
        audio = audio.reshape(-1)
        return normalize_utterance(audio) if self.card.normalize == "utterance" else audio

    def log_probs(self, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Log-probs (T', V) of each utterance (float32 mono at `sample_rate`): their
        features (or samples), then one padded batch through model.onnx. An imported
        model's utterance longer than one window of `whole_chunking` runs in such windows
        instead (`in_windows`), so that no call holds more than a window's activations."""
        audios = [np.asarray(a, dtype=np.float32).reshape(-1) for a in audios]
        long = [self._too_long(a) for a in audios]
        whole = iter(
            self.engine.offline(
                [self.model_input(a) for a, x in zip(audios, long, strict=True) if not x]
            )
        )
        return [self.in_windows(a) if x else next(whole) for a, x in zip(audios, long, strict=True)]

    def _too_long(self, audio: np.ndarray) -> bool:
        cfg = self.whole_chunking
        return cfg is not None and output_frames(self.card, len(audio)) > window_frames(
            self.card, cfg
        )

    def in_windows(self, audio: np.ndarray) -> np.ndarray:
        """Log-probs (T', V) of one utterance run as `whole_chunking`'s overlapped windows,
        one model.onnx call each (each normalised over its own samples, or with NeMo's
        features of its own samples), the middle of each kept: `chunking.py`."""
        feeder = ChunkFeeder(self.card, self.whole_chunking)
        feeder.accept(audio)
        feeder.finish()
        kept = []
        while feeder.ready():
            window, first, keep = feeder.next_window()
            (rows,) = self.engine.offline([self.model_input(window)])
            kept.append(rows[first : first + keep])
        if not kept:
            return np.zeros((0, self.vocab.size), dtype=np.float32)
        return np.concatenate(kept)

    def decode(
        self, log_probs: np.ndarray, n_best: int = 1, endpointing: Endpointing | None = None
    ) -> Transcript:
        """One utterance's transcript from its log-probs (T', V); with beam search and
        n_best > 1 it carries up to n_best - 1 `alternatives`. With `endpointing` (and a
        model that streams by steps), the audio is cut into utterances as a stream of
        the same steps is on the server, each decoded afresh, and their transcripts
        joined (`joined`)."""
        steps = self.card.chunk_frames
        if endpointing is None or not self.streams_exactly:
            return self._decoder.decode(log_probs, n_best)
        utterances: list[tuple[float, Transcript]] = []
        decoder, start = self._decoder.stream(), 0  # the utterance's first frame
        decoder.n_best = n_best
        for at in range(0, len(log_probs), steps):
            partial = decoder.accept(log_probs[at : at + steps])
            spoken = (min(at + steps, len(log_probs)) - start) * self.frame_seconds
            if at + steps < len(log_probs) and endpointing.due(
                partial.words, spoken, self.frame_seconds
            ):
                utterances.append((start * self.frame_seconds, decoder.finalize()))
                decoder, start = self._decoder.stream(), at + steps
                decoder.n_best = n_best
        utterances.append((start * self.frame_seconds, decoder.finalize()))
        return joined(utterances)

    def transcribe(
        self,
        audios: Sequence[np.ndarray],
        n_best: int = 1,
        endpointing: Endpointing | None = None,
    ) -> list[Transcript]:
        """Transcripts of whole files, run through the model as one batch; with
        `endpointing`, each cut into utterances (`decode`)."""
        return [self.decode(lp, n_best, endpointing) for lp in self.log_probs(audios)]

    def transcribe_blocks(
        self,
        blocks: Iterable[np.ndarray],
        n_best: int = 1,
        endpointing: Endpointing | None = None,
    ) -> Transcript:
        """One file given a block at a time (float32 mono at `sample_rate`), through the
        streaming graph: memory holds a block, the recurrent state and the transcript,
        whatever the length (`transcribe` holds the whole file's features and log-probs).
        The transcript equals `transcribe`'s (with the same `endpointing`) up to export's
        parity tolerance."""
        # Without endpointing, rows are decoded a minute of audio at a time: a decoder's
        # partial transcript is rebuilt at every call, which done per window costs time
        # quadratic in the length. With it, every step (as on the server), and an
        # utterance is at most endpointing.max_utterance long.
        cutting = endpointing is not None and self.streams_exactly
        stream = self.stream(
            n_best=n_best, endpointing=endpointing if cutting else None, deferred=not cutting
        )
        utterances: list[tuple[float, Transcript]] = []
        decoded = 0  # output frames decoded so far (without endpointing)

        def run() -> None:
            nonlocal decoded
            while self.step([stream]):
                if cutting:
                    utterances.extend((u.start, u.transcript) for u in stream.settle().finals)
            if not cutting and (stream.frames_decoded - decoded) * self.frame_seconds >= 60.0:
                stream.decode_pending()
                decoded = stream.frames_decoded

        for block in blocks:
            stream.accept_audio(block)
            run()
        stream.finish()
        run()
        if not cutting:
            utterances.append((0.0, stream.result()))
        return joined(utterances)

    # ---- streaming -----------------------------------------------------------------

    def stream(
        self,
        *,
        endpointing: Endpointing | None = None,
        n_best: int = 1,
        deferred: bool | None = None,
    ) -> Stream:
        """A live stream (see `Stream`); deferred None: a beam search's rows are decoded
        by `settle` off the batch, a greedy decoder's in it."""
        if deferred is None:
            deferred = self.decoder_config.kind == "beam"
        return Stream(self, endpointing=endpointing, n_best=n_best, deferred=deferred)

    def decoder_stream(self) -> StreamingDecoder:
        """A fresh streaming decoder (one per utterance of a `Stream`)."""
        return self._decoder.stream()

    def step(self, streams: Sequence[Stream]) -> int:
        """One batched step of every given stream that has work ready.

        The new feature frames of all of them are computed as one batch (and the
        feeders of streams whose audio has ended are finished); then every one with a
        window ready contributes that window (at most one each, so a call costs one
        stream.onnx call whatever the mix) and takes its rows (decoded now, or queued
        with deferred decoding). Returns the number of streams that had work, including
        any whose step only finished their feeder.
        """
        ready = [s for s in streams if s.is_ready()]
        if not ready:
            return 0
        Stream.compute_pending_features(ready)
        stepping = [s for s in ready if s.has_window()]
        if stepping and self.chunking is not None:
            windows, firsts, keeps = zip(*(s.next_window() for s in stepping), strict=True)
            # Each window normalised over its own samples (or features, NeMo's): the whole
            # utterance is not here.
            outs = self.engine.offline([self.model_input(w) for w in windows])
            for stream, rows, first, keep in zip(stepping, outs, firsts, keeps, strict=True):
                stream.accept_step(rows[first : first + keep], {})
        elif stepping:
            windows, frames = zip(*(s.next_window() for s in stepping), strict=True)
            states = self.engine.gather_states([s.state for s in stepping])
            log_probs, new_states = self.engine.stream_step(
                np.stack(windows), np.asarray(frames, dtype=np.int64), states
            )
            for stream, rows, n, state in zip(
                stepping, log_probs, frames, self.engine.scatter_states(new_states), strict=True
            ):
                stream.accept_step(rows[: min(self.card.chunk_frames, n)], state)
        return len(ready)


@dataclass(frozen=True)
class Utterance:
    """One utterance of a stream: its transcript, its place among the stream's utterances
    and in its audio (s from the start of the stream's audio; word times count from
    `start`)."""

    transcript: Transcript
    index: int  # utterances with words that ended before this one, count
    start: float  # s
    end: float  # s


@dataclass(frozen=True)
class Stepped:
    """What a step gave a stream (`Stream.settle`)."""

    finals: tuple[Utterance, ...]  # utterances that ended: at an endpoint, or the last one
    partial: Utterance | None  # the current utterance so far; None once the stream is final
    endpoint: bool  # an endpoint cut the stream at this step
    decoded_seconds: float  # audio the model has given rows for, s

    def then(self, later: Stepped) -> Stepped:
        """This step and a later one of the same stream as one (a finished stream's last
        windows run back to back): both steps' finals, the later partial."""
        return Stepped(
            self.finals + later.finals,
            later.partial,
            self.endpoint or later.endpoint,
            later.decoded_seconds,
        )


class Stream:
    """One live audio stream: audio in, utterances with partial and final transcripts out.

    accept_audio(samples): float32 mono at the model's rate, any length.
    is_ready(): the stream has work for the model (`Recognizer.step` runs it).
    finish(): no more audio; the remaining windows become ready.
    settle(): after a step, what it gave (`Stepped`): the decoder has the step's rows,
      the endpoint is tested, an utterance that ended is finalized.
    result(): the current utterance's transcript so far (final once `is_final`).

    Made with its settings, which never change: `endpointing` (None: one utterance),
    `n_best` (transcripts a final result carries, itself included: `Transcript.alternatives`,
    beam search only) and `deferred` (True: a step only queues its rows, and `settle`
    decodes them, run wherever the caller likes: a beam search off the batch every
    stream shares).

    `compute_pending_features`, `has_window`, `next_window`, `state` and
    `accept_step` are the side that `Recognizer.step` drives.
    """

    def __init__(
        self,
        recognizer: Recognizer,
        *,
        endpointing: Endpointing | None = None,
        n_best: int = 1,
        deferred: bool = False,
    ) -> None:
        if n_best < 1:
            raise ValueError(f"n_best must be at least 1, got {n_best}")
        self.recognizer = recognizer
        self.endpointing = endpointing or Endpointing()
        self.n_best = n_best
        self.deferred = deferred
        self._feeder: WindowFeeder | ChunkFeeder
        self._features: FeatureStream | None = None  # none for a waveform model: samples
        if recognizer.chunking is not None:  # go straight to its feeder
            self._feeder = ChunkFeeder(recognizer.card, recognizer.chunking)
            self._state: StreamState = {}
        else:
            self._features = FeatureStream(recognizer.card.features)
            self._feeder = recognizer.engine.feeder()
            self._state = recognizer.engine.initial_state(1)
        self._decoder: StreamingDecoder = self._new_decoder()
        self._result = Transcript("", (), 0.0)
        self._lock = threading.Lock()
        self._ended = False  # finish() was called; the feeder finishes at the next step
        self._undecoded: list[np.ndarray] = []  # rows a step queued, not yet decoded
        self._last_given = False  # settle() has given the last utterance
        self.samples_in = 0  # audio samples accepted
        self.frames_decoded = 0  # output frames the model has given (decoded, or queued)
        self.utterance_index = 0  # utterances with words ended so far, count
        self._utterance_start_frame = 0  # output frame where the current utterance starts

    def close(self) -> None:
        """Let go of the stream: nothing to release in this process (a stream held by an
        engine process is let go of there: `server/core/engine_process.py:RemoteStream`)."""

    def _new_decoder(self) -> StreamingDecoder:
        decoder = self.recognizer.decoder_stream()
        decoder.n_best = self.n_best
        return decoder

    # ---- the caller's side ---------------------------------------------------------

    def accept_audio(self, samples: np.ndarray) -> None:
        """Store the samples; their features are computed by `Recognizer.step`, batched."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        with self._lock:
            if self._ended:
                raise RuntimeError("accept_audio() after finish()")
            if self._features is None:
                self._feeder.accept(samples)
            else:
                self._features.push(samples)
            self.samples_in += len(samples)

    def finish(self, *, features_now: bool = False) -> None:
        """No more audio. Cheap: the last frames are computed by the next step, batched
        with other streams; with `features_now`, here and now instead (a caller already
        off the event loop holding much audio, such as a whole-file request, so that
        the batch it joins is not held up by one stream's features)."""
        with self._lock:
            self._ended = True
        if features_now:
            Stream.compute_pending_features([self])

    def compute_features(self) -> None:
        """This stream's pending feature frames, here and now (a caller off the event loop
        holding much audio, so that the batch the stream joins is not held up by them)."""
        Stream.compute_pending_features([self])

    @property
    def finished(self) -> bool:
        """finish() was called."""
        return self._ended

    @property
    def finishing(self) -> bool:
        """Finished, with exactly one window still to run, its last (an engine runs it at
        once, in a round of its own, rather than have its caller ask again). Not before:
        audio that arrives all at the end (a whole file, FLAC decoded late) steps window by
        window, batched with the others and with interim results between."""
        feeder = self._feeder
        return self._ended and isinstance(feeder, WindowFeeder) and feeder.windows_left == 1

    def is_ready(self) -> bool:
        with self._lock:
            if self._ended and not self._feeder.finished:
                return True  # the last frames, and finishing the feeder, are a step's work
            pending = self._features.frames_pending if self._features is not None else 0
            return self._feeder.ready(pending)

    @property
    def is_final(self) -> bool:
        """Finished and every window decoded."""
        return self._feeder.done

    @property
    def audio_seconds(self) -> float:
        return self.samples_in / self.recognizer.sample_rate

    @property
    def decoded_seconds(self) -> float:
        return self.frames_decoded * self.recognizer.frame_seconds

    @property
    def utterance_start(self) -> float:
        """Where the current utterance starts in the audio, s."""
        return self._utterance_start_frame * self.recognizer.frame_seconds

    @property
    def utterance_seconds(self) -> float:
        """Audio decoded in the current utterance, s (counted in frames, as
        `Recognizer.decode` counts it, so both cut at the same step)."""
        return (self.frames_decoded - self._utterance_start_frame) * self.recognizer.frame_seconds

    def result(self) -> Transcript:
        """The transcript so far; the final one once `is_final`."""
        self.decode_pending()
        if self.is_final:
            self._result = self._decoder.finalize()
        return self._result

    def decode_pending(self) -> Transcript:
        """Decode the rows the steps queued (deferred decoding); the transcript so far."""
        rows, self._undecoded = self._undecoded, []
        if rows:  # one call: the decoder rebuilds its partial transcript once, not per step
            self._result = self._decoder.accept(np.concatenate(rows))
        return self._result

    def settle(self) -> Stepped:
        """After a step: the rows it queued decoded (deferred decoding), the endpoint
        tested, and an utterance that ended finalized; what the step gave. Once the stream
        is final its last utterance is given once (an utterance of silence only when it
        is the stream's only one). Runs where the caller decodes: in the batch's worker
        thread for a greedy stream, in a decoder thread for a deferred one."""
        self.decode_pending()
        decoded = min(self.decoded_seconds, self.audio_seconds)
        if self.is_final:
            finals: tuple[Utterance, ...] = ()
            if not self._last_given:
                self._last_given = True
                final = self.result()
                if self.utterance_index == 0 or final.words:
                    finals = (self._utterance(final, self.audio_seconds),)
            return Stepped(finals, None, False, self.audio_seconds)
        frame = self.recognizer.frame_seconds
        if not self.endpointing.due(self._result.words, self.utterance_seconds, frame):
            partial = self._utterance(self._result, decoded)
            return Stepped((), partial, False, decoded)
        ended = self._utterance(self.restart_decoder(), decoded)
        self._utterance_start_frame = self.frames_decoded
        if ended.transcript.words:
            self.utterance_index += 1
            return Stepped((ended,), None, True, decoded)
        return Stepped((), None, True, decoded)  # silence: dropped, never reported

    def _utterance(self, transcript: Transcript, end: float) -> Utterance:
        return Utterance(transcript, self.utterance_index, self.utterance_start, end)

    def restart_decoder(self) -> Transcript:
        """Finalize the decoder's utterance and start a new one at the current position.

        The recurrent state and the audio position carry on (an endpoint splits the
        transcript, not the acoustic context). Returns the finished utterance.
        """
        self.decode_pending()
        final = self._decoder.finalize()
        self._decoder = self._new_decoder()
        self._result = Transcript("", (), 0.0)
        return final

    # ---- Recognizer.step's side ----------------------------------------------------

    @staticmethod
    def compute_pending_features(streams: Sequence[Stream]) -> None:
        """The new feature frames of every stream, as one batch, into their feeders; a
        stream whose audio has ended then has its feeder finished.

        The streams' locks are held throughout (taken in one global order), so audio
        that arrives meanwhile waits for the next step.
        """
        with ExitStack() as locks:
            for s in sorted(streams, key=id):
                locks.enter_context(s._lock)
            waiting = [s for s in streams if s._features is not None and s._features.frames_pending]
            feats = batch_features([s._features for s in waiting])
            for s, f in zip(waiting, feats, strict=True):
                s._feeder.accept(f)
            for s in streams:
                if s._ended and not s._feeder.finished:
                    s._feeder.finish()

    def has_window(self) -> bool:
        """A window of feature frames is ready for stream.onnx."""
        with self._lock:
            return self._feeder.ready()

    def next_window(self) -> tuple[np.ndarray, int] | tuple[np.ndarray, int, int]:
        """The next window (W, F) and its valid output frames (`WindowFeeder.next_window`),
        or for overlapped chunks its samples and kept frames (`ChunkFeeder.next_window`)."""
        with self._lock:
            return self._feeder.next_window()

    @property
    def state(self) -> StreamState:
        """The recurrent state the next window starts from."""
        return self._state

    def accept_step(self, log_probs: np.ndarray, state: StreamState) -> None:
        """A window's log-prob rows (this stream's alone) and the state after it; the rows
        are decoded now, or queued for `decode_pending` with deferred decoding."""
        self._state = state
        self.frames_decoded += len(log_probs)
        if self.deferred:
            self._undecoded.append(log_probs)
        else:
            self._result = self._decoder.accept(log_probs)
