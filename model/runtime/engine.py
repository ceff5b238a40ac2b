"""Run an exported model with ONNX Runtime: offline batches and batched streaming steps.

numpy and onnxruntime only: this is what the server runs. An `Engine` loads a
model directory as written by `echoic export`:

    model.onnx   features (B, T, F), lengths (B,) -> log_probs (B, T', V), out_lengths (B,)
                 (an imported model: waveform (B, S), lengths (B,) -> the same outputs)
    stream.onnx  features (B, W, F), out_frames (B,), state_* -> log_probs (B, C, V), next_state_*

and reads everything else (vocabulary, feature config, chunk sizes, state shapes)
from the model card in their metadata.

Streaming, per stream: feature frames (from `FeatureStream`) go into a
`WindowFeeder`, which hands out the windows that `stream.onnx` takes, padded
exactly as `network.stream_utterance` pads them, so the streamed log-probs equal
`Engine.offline` on the whole utterance. Batching is the caller's: take the ready
windows of many streams, `gather_states` their states, run one `stream_step`, and
`scatter_states` the new states back.

With `io_binding` (what `echoic serve --device cuda` uses) `stream.onnx` runs through
ONNX Runtime's I/O binding: the new states are bound to outputs on the engine's device
and stay there. A stream's state is then `DeviceRows` (its row of the batch's device
tensors); when the next step is the same streams in the same order, as under steady
load, `gather_states` hands the device tensors back as they are, with no copy to the
host; any other batch is regathered through host memory (counted in
`host_state_copies`). The windows go to the device and the log-probs come back each
step, as they must.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from echoic.model.runtime.card import (
    OFFLINE_FILE,
    STREAM_FILE,
    ModelCard,
    ModelError,
    card_from_metadata,
    check_graph,
    open_session,
)

__all__ = ["DeviceRows", "Engine", "ModelCard", "ModelError", "StreamState", "WindowFeeder"]


@dataclass(frozen=True, eq=False)
class DeviceRows:
    """One stream's recurrent state left on the device by an I/O-bound step: row `row`
    of the batch's state tensors `values` (state input name -> OrtValue (1, B, H))."""

    values: dict[str, Any]
    row: int


StreamState = dict[str, np.ndarray] | DeviceRows  # state input name -> (1, B, H) float32


class Engine:
    """An exported model loaded into ONNX Runtime sessions (thread-safe to call)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        intra_op_threads: int = 0,
        inter_op_threads: int = 1,
        spin_wait: bool = True,
        io_binding: bool = False,
    ) -> None:
        """Load `model_dir`/model.onnx (and stream.onnx when present).

        intra_op_threads: threads inside one operator (0 = onnxruntime's default, all
        cores); inter_op_threads: operators run at once (1 = sequential execution);
        spin_wait: onnxruntime's idle threads spin for the next work (its default)
        rather than sleep, which is fastest when nothing else wants the cores.
        io_binding: streaming steps keep the recurrent states on the first provider's
        device between steps (module docstring); on the CPU provider it changes nothing
        but the path, which is how it is tested without a GPU.
        """
        import onnxruntime as ort

        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ModelError(f"{self.model_dir}: no such model directory")
        offline_path = self.model_dir / OFFLINE_FILE
        if not offline_path.is_file():
            raise ModelError(
                f"{offline_path}: missing; a model directory comes from `echoic export`"
            )
        self.providers = tuple(providers)
        self.io_binding = io_binding
        self.device = "cuda" if self.providers[0] == "CUDAExecutionProvider" else "cpu"
        self.host_state_copies = 0  # state batches copied device -> host to regather (I/O binding)
        available = ort.get_available_providers()
        missing = [p for p in self.providers if p not in available]
        if missing:
            hint = " (pip install 'echoic[gpu]')" if "CUDAExecutionProvider" in missing else ""
            raise ModelError(
                f"{self.model_dir}: execution provider {missing[0]} is not available in this "
                f"onnxruntime{hint}; available: {', '.join(available)}"
            )
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = inter_op_threads
        options.execution_mode = (
            ort.ExecutionMode.ORT_SEQUENTIAL
            if inter_op_threads <= 1
            else ort.ExecutionMode.ORT_PARALLEL
        )
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.use_deterministic_compute = True
        if not spin_wait:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        options.log_severity_level = 3  # errors only: the server logs what matters itself
        self._options = options

        self.offline_session = self._load(offline_path)
        self.card: ModelCard = card_from_metadata(
            self.offline_session.get_modelmeta().custom_metadata_map, offline_path
        )
        check_graph(self.card, self.offline_session, offline_path, stream=False)

        self.stream_session = None
        stream_path = self.model_dir / STREAM_FILE
        if stream_path.is_file():
            self.stream_session = self._load(stream_path)
            stream_card = card_from_metadata(
                self.stream_session.get_modelmeta().custom_metadata_map, stream_path
            )
            if stream_card != self.card:
                raise ModelError(
                    f"{stream_path}: its model card differs from {OFFLINE_FILE}'s; "
                    "the two files come from different exports"
                )
            check_graph(self.card, self.stream_session, stream_path, stream=True)

    def _load(self, path: Path) -> Any:
        session = open_session(path, self._options, self.providers)
        # onnxruntime falls back to CPU when a requested provider fails to start.
        unused = [p for p in self.providers if p not in session.get_providers()]
        if unused:
            raise ModelError(
                f"{path}: execution provider {unused[0]} could not be initialised "
                "(for CUDA: check the CUDA and cuDNN libraries onnxruntime-gpu needs)"
            )
        return session

    def __repr__(self) -> str:
        c = self.card
        return f"Engine({c.name!r} version {c.version!r} from {str(self.model_dir)!r})"

    # ---- offline ---------------------------------------------------------------

    def offline(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Log-probs of whole utterances, run as one padded batch.

        inputs: per utterance what the card's `input` says: raw features (T_i, F) from
        `model.features`, or samples (S_i,) already scaled as its `normalize` says.
        Returns one (T'_i, V) float32 array per utterance, trimmed to its output frames.
        A model whose graph cannot mask padding (`batch_padding` "alone") runs each
        utterance as a batch of its own, so a transcript never depends on its batch-mates.
        """
        waveform = self.card.input == "waveform"
        f = self.card.num_features
        rows = [np.asarray(x, dtype=np.float32) for x in inputs]
        for i, x in enumerate(rows):
            if waveform and x.ndim != 1:
                raise ValueError(f"waveform[{i}] must have shape (S,), got {x.shape}")
            if not waveform and (x.ndim != 2 or x.shape[1] != f):
                raise ValueError(f"features[{i}] must have shape (T, {f}), got {x.shape}")
        if self.card.max_frames:
            self._check_length(rows)
        if self.card.batch_padding == "alone" and len(rows) > 1:
            return [out for x in rows for out in self.offline([x])]
        if not rows:
            return []
        lengths = np.array([len(x) for x in rows], dtype=np.int64)
        vocab = len(self.card.vocabulary)
        # Below one output frame's worth of input a graph has nothing to give (a wav2vec2's
        # convolutions would fail on it): those rows get no frames and stay out of the batch.
        if lengths.max() < (self.card.receptive_field if waveform else 1):
            return [np.zeros((0, vocab), dtype=np.float32) for _ in rows]
        batch = np.zeros((len(rows), int(lengths.max()), *rows[0].shape[1:]), dtype=np.float32)
        for row, x in zip(batch, rows, strict=True):
            row[: len(x)] = x
        name = "waveform" if waveform else "features"
        log_probs, out_lengths = self.offline_session.run(
            ["log_probs", "out_lengths"], {name: batch, "lengths": lengths}
        )
        return [lp[: max(int(n), 0)].copy() for lp, n in zip(log_probs, out_lengths, strict=True)]

    def _check_length(self, rows: Sequence[np.ndarray]) -> None:
        """ValueError for an input longer than the card's `max_frames` output frames (a
        Conformer's positional table ends there: its graph would fail with a shape error)."""
        c = self.card
        for i, x in enumerate(rows):
            if c.input == "waveform":
                frames = (len(x) - c.receptive_field) // c.time_stride + 1
            else:
                frames = -(-len(x) // c.time_stride)
            if frames > c.max_frames:
                seconds = c.max_frames * c.output_frame_ms / 1000
                raise ValueError(
                    f"input {i} gives {frames} output frames; model {c.name!r} gives at most "
                    f"{c.max_frames} ({seconds:g} s) in one call: Recognizer.log_probs runs "
                    "longer audio in windows"
                )

    # ---- streaming --------------------------------------------------------------

    @property
    def streamable(self) -> bool:
        return self.stream_session is not None

    def _require_stream(self) -> None:
        if self.stream_session is None:
            why = (
                "the model is a full-context BiRNN (chunk_frames = 0), which cannot stream"
                if not self.card.streamable
                else "the file is missing"
            )
            raise ModelError(f"{self.model_dir / STREAM_FILE}: no streaming graph: {why}")

    def feeder(self) -> WindowFeeder:
        """A new per-stream window feeder for this model."""
        self._require_stream()
        return WindowFeeder(self.card)

    def initial_state(self, n: int) -> StreamState:
        """Zero recurrent state for `n` streams (what a new stream starts from)."""
        self._require_stream()
        return {
            s.input: np.zeros(self.card.state_shape(s, n), dtype=np.float32)
            for s in self.card.states
        }

    def gather_states(self, states: Sequence[StreamState]) -> StreamState:
        """Stack per-stream states (each for one or more streams) into one batch.

        States an I/O-bound step left on the device come back as they are when they are
        exactly that step's batch, in order; otherwise they are copied to the host first.
        """
        if states and all(isinstance(st, DeviceRows) for st in states):
            values = states[0].values
            rows = [st.row for st in states]
            same = all(st.values is values for st in states)
            if same and rows == list(range(self._batch_of(values))):
                return values
        axis = self.card.state_batch_axis
        on_host: dict[int, dict[str, np.ndarray]] = {}  # each device batch copied once

        def host(st: StreamState) -> dict[str, np.ndarray]:
            if not isinstance(st, DeviceRows):
                return st
            if id(st.values) not in on_host:
                on_host[id(st.values)] = {k: v.numpy() for k, v in st.values.items()}
                self.host_state_copies += 1
            return {k: np.take(v, [st.row], axis=axis) for k, v in on_host[id(st.values)].items()}

        hosted = [host(st) for st in states]
        return {
            s.input: np.concatenate([st[s.input] for st in hosted], axis=axis)
            for s in self.card.states
        }

    def _batch_of(self, values: dict[str, Any]) -> int:
        first = next(iter(values.values()))
        shape = first.shape() if callable(first.shape) else first.shape  # OrtValue or array
        return int(shape[self.card.state_batch_axis])

    def scatter_states(self, state: StreamState) -> list[StreamState]:
        """Split a batched state into one state per stream (each with batch 1); states on
        the device stay there (`DeviceRows`)."""
        n = self._batch_of(state)
        if not all(isinstance(v, np.ndarray) for v in state.values()):
            return [DeviceRows(state, i) for i in range(n)]
        axis = self.card.state_batch_axis
        return [
            {k: np.ascontiguousarray(np.take(v, [i], axis=axis)) for k, v in state.items()}
            for i in range(n)
        ]

    def stream_step(
        self, windows: np.ndarray, out_frames: np.ndarray, states: StreamState
    ) -> tuple[np.ndarray, StreamState]:
        """One streaming step for B streams, each with its own state.

        windows: (B, W, F) from each stream's `WindowFeeder`; out_frames: (B,) their
        valid output frames; states: batched as `gather_states` makes them. Returns
        log-probs (B, C, V), of which row b's first min(C, out_frames[b]) frames are
        real, and the new states (same keys).
        """
        self._require_stream()
        card = self.card
        windows = np.asarray(windows, dtype=np.float32)
        want = (card.window_input_frames, card.num_features)
        if windows.ndim != 3 or windows.shape[1:] != want:
            raise ValueError(
                f"windows must have shape (B, {want[0]}, {want[1]}), got {windows.shape}"
            )
        out_frames = np.asarray(out_frames, dtype=np.int64).reshape(-1)
        if out_frames.shape[0] != windows.shape[0]:
            raise ValueError(f"out_frames must have shape ({windows.shape[0]},)")
        if self.io_binding:
            return self._bound_step(windows, out_frames, states)
        feeds: dict[str, np.ndarray] = {"features": windows, "out_frames": out_frames}
        for s in card.states:
            feeds[s.input] = np.asarray(states[s.input], dtype=np.float32)
        names = ["log_probs", *(s.output for s in card.states)]
        log_probs, *new = self.stream_session.run(names, feeds)
        return log_probs, {s.input: v for s, v in zip(card.states, new, strict=True)}

    def _bound_step(
        self, windows: np.ndarray, out_frames: np.ndarray, states: StreamState
    ) -> tuple[np.ndarray, StreamState]:
        """`stream_step` through I/O binding: states in and out as OrtValues on the device."""
        import onnxruntime as ort

        binding = self.stream_session.io_binding()
        binding.bind_cpu_input("features", windows)
        binding.bind_cpu_input("out_frames", out_frames)
        for s in self.card.states:
            value = states[s.input]
            if isinstance(value, np.ndarray):  # a new stream's zeros, or a regathered batch
                value = ort.OrtValue.ortvalue_from_numpy(
                    np.ascontiguousarray(value, dtype=np.float32), self.device, 0
                )
            binding.bind_ortvalue_input(s.input, value)
        binding.bind_output("log_probs", "cpu")
        for s in self.card.states:
            binding.bind_output(s.output, self.device, 0)
        self.stream_session.run_with_iobinding(binding)
        log_probs, *new = binding.get_outputs()
        return log_probs.numpy(), {s.input: v for s, v in zip(self.card.states, new, strict=True)}


def window_ready(card: ModelCard, next_frame: int, frames_in: int) -> bool:
    """Whether a stream's window starting at output frame `next_frame` has all its input
    once `frames_in` real feature frames have arrived (before the stream's end):
    `WindowFeeder.ready`'s rule, which a stream held in another process follows too."""
    end = next_frame * card.time_stride + card.window_input_frames
    return end <= card.pad_left + frames_in


class WindowFeeder:
    """Feature frames in, `stream.onnx` windows out, for one stream.

    Mirrors `network.stream_utterance`: the frames are preceded by `pad_left`
    frames of the feature mean; window n covers padded frames [n*C*S, n*C*S + W)
    and yields output frames [n*C, n*C + C). A window is ready once all its frames
    have arrived; after `finish()` the rest are padded with the feature mean (whose
    normalised value is exactly 0, as the offline model pads) and become ready too.
    """

    def __init__(self, card: ModelCard) -> None:
        if not card.streamable:
            raise ModelError(f"model {card.name!r} is not streamable (full-context BiRNN)")
        self.card = card
        self.chunk = card.chunk_frames  # C: output frames per window
        self._mean = np.asarray(card.feature_mean, dtype=np.float32)
        self._buffer = np.tile(self._mean, (card.pad_left, 1))  # padded frames from _offset on
        self._offset = 0  # padded-frame index of _buffer[0]
        self.frames_in = 0  # real feature frames accepted
        self.next_frame = 0  # first output frame of the next window
        self.finished = False

    def accept(self, frames: np.ndarray) -> None:
        """Add feature frames (n, F) as they arrive (n may be 0)."""
        if self.finished:
            raise RuntimeError("accept() after finish()")
        frames = np.asarray(frames, dtype=np.float32)
        if frames.ndim != 2 or frames.shape[1] != self.card.num_features:
            raise ValueError(
                f"frames must have shape (n, {self.card.num_features}), got {frames.shape}"
            )
        self._buffer = np.concatenate([self._buffer, frames])
        self.frames_in += len(frames)

    def finish(self) -> None:
        """No more frames: the remaining (partial) windows become ready."""
        self.finished = True

    @property
    def total_output_frames(self) -> int | None:
        """Output frames of the whole stream, known once it is finished."""
        s = self.card.time_stride
        return (self.frames_in + s - 1) // s if self.finished else None

    def ready(self, coming: int = 0) -> bool:
        """Whether `next_window()` has a window to give now, or will have once `coming`
        more frames (computed but not yet accepted) arrive."""
        if self.finished:
            return self.next_frame < self.total_output_frames
        return window_ready(self.card, self.next_frame, self.frames_in + coming)

    @property
    def done(self) -> bool:
        """Finished, and every window has been taken."""
        return self.finished and not self.ready()

    @property
    def windows_left(self) -> int | None:
        """Windows still to take, once finished (None before)."""
        if not self.finished:
            return None
        return max(0, -(-(self.total_output_frames - self.next_frame) // self.chunk))

    def next_window(self) -> tuple[np.ndarray, int]:
        """The next window (W, F) float32 and its valid output frames (`out_frames`).

        Of the C log-prob rows that `stream.onnx` returns for it, the first
        min(C, out_frames) belong to the stream.
        """
        if not self.ready():
            raise RuntimeError("no window is ready: accept() more frames or finish()")
        card = self.card
        start = self.next_frame * card.time_stride - self._offset
        window = self._buffer[start : start + card.window_input_frames]
        if len(window) < card.window_input_frames:
            pad = np.tile(self._mean, (card.window_input_frames - len(window), 1))
            window = np.concatenate([window, pad])
        full = card.chunk_frames + card.context_frames
        out_frames = (
            full if not self.finished else min(full, self.total_output_frames - self.next_frame)
        )
        self.next_frame += self.chunk
        # Frames before the next window's start are never needed again.
        drop = min(self.next_frame * card.time_stride - self._offset, len(self._buffer))
        self._buffer = self._buffer[drop:]
        self._offset += drop
        return np.ascontiguousarray(window), out_frames
