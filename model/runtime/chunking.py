"""Streaming a full-context imported model (a wav2vec2, a NeMo CTC model) by overlapped chunks.

Such a model has no stream.onnx: every output frame may look at the whole
utterance. To stream it anyway, each step runs model.onnx on a window of audio and
keeps only the window's middle:

    window n:  | left context L | chunk C (kept) | right context R |
    window n+1:                 | left context L | chunk C (kept) | right context R |

in output frames (20 ms for wav2vec2, 40 ms for a Conformer-CTC). A NeMo model's window
is its samples too: its features (NeMo's recipe) are computed on the window. Chunk n's
frames are final once the audio through its right context has arrived, so a word shows
up at most C + R after it was said (plus a step's compute). The cost, measured in the
docs/models-and-import.md ("Serving other models"): each frame sees L + C + R of context
instead of the whole utterance, each window is normalised over its own samples (an
"utterance" card's statistics need the whole utterance), and the model runs
(L + C + R) / C times the audio. Recognize (whole audio) does not stream: it runs the
utterance whole, as offline.

Whole utterances are not run whole without bound, though: a wav2vec2's self-attention
holds (frames)^2 scores per head and layer (5 GB for the tiny test model on 5 minutes
of audio, measured by bench/long_audio_memory.py), and a Conformer exported by NeMo
has a fixed positional table (the card's `max_frames`). An utterance longer than
WHOLE_SECONDS (or `max_frames`) runs by the same overlapped windows, with long ones
(`whole_chunks`: windows of WHOLE_SECONDS, the middle two thirds kept, a sixth of
context either side, as Hugging Face's ASR pipeline chunks with chunk_length_s=30), one
window at a time, so memory holds one window's activations whatever the length:
`Recognizer.log_probs`.

A `ChunkFeeder` is the per-stream side (samples in, windows out), as `WindowFeeder`
is for stream.onnx; `Recognizer.step` batches the windows of many streams into one
model.onnx call (they have one length, but for a stream's first and last).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from echoic.model.runtime.card import ModelCard, ModelError


@dataclass(frozen=True)
class ChunkConfig:
    chunk_ms: float = 1000.0  # audio each window adds to the transcript, ms (rounded to frames)
    left_ms: float = 1000.0  # audio before the chunk each window sees again, ms
    right_ms: float = 500.0  # audio after the chunk each window waits for, ms (latency)

    def __post_init__(self) -> None:
        if not self.chunk_ms > 0 or self.left_ms < 0 or self.right_ms < 0:
            raise ValueError(
                f"chunk_ms must be positive and left_ms, right_ms not negative; got "
                f"{self.chunk_ms}, {self.left_ms}, {self.right_ms}"
            )

    def frames(self, card: ModelCard) -> tuple[int, int, int]:
        """(C, L, R) in output frames of `card`'s model; C at least one."""
        frame = card.output_frame_ms
        return (
            max(1, round(self.chunk_ms / frame)),
            round(self.left_ms / frame),
            round(self.right_ms / frame),
        )

    def check(self, card: ModelCard) -> None:
        """ModelError unless one window fits the model (its card's `max_frames`)."""
        frames = window_frames(card, self)
        if card.max_frames and frames > card.max_frames:
            frame = card.output_frame_ms
            raise ModelError(
                f"model {card.name!r}: a window of {self.left_ms:g} + {self.chunk_ms:g} + "
                f"{self.right_ms:g} ms ({frames} output frames) is longer than the "
                f"{card.max_frames} frames ({card.max_frames * frame / 1000:g} s) one call of "
                "this model can give: choose a shorter chunk or context"
            )


WHOLE_SECONDS = 30.0  # the most audio one model.onnx call of an imported model runs, s


def window_frames(card: ModelCard, cfg: ChunkConfig) -> int:
    """Output frames the model gives for one full window of `cfg` (L + C + R, or one
    more where NeMo's features count the frame at the end)."""
    chunk, left, right = cfg.frames(card)
    stride, field = card.time_stride, card.receptive_field
    if card.nemo_features is not None:
        stride = field = card.time_stride * card.nemo_features.hop_samples
    return output_frames(card, (left + chunk + right - 1) * stride + field)


def whole_chunks(card: ModelCard, seconds: float = WHOLE_SECONDS) -> ChunkConfig:
    """The windows a whole utterance longer than one window runs in: `seconds` of audio
    (fewer where the card's `max_frames` says), each keeping its middle two thirds with a
    sixth of context on either side."""
    frame = card.output_frame_ms
    frames = max(3, round(min(seconds * 1000.0 / frame, 2**40)))  # L + C + R
    if card.max_frames:
        frames = max(3, min(frames, card.max_frames))
    while True:
        side = frames // 6
        cfg = ChunkConfig((frames - 2 * side) * frame, side * frame, side * frame)
        if not card.max_frames or window_frames(card, cfg) <= card.max_frames or frames <= 3:
            return cfg
        frames -= 1


def can_chunk(card: ModelCard) -> bool:
    """Whether overlapped chunks can stream this model: an imported one (waveform input,
    or NeMo's features computed from each window's samples) without stream.onnx
    (echoic's own full-context BiRNNs are not: their features and normalisation are a
    stream.onnx matter)."""
    imported = card.input == "waveform" or card.nemo_features is not None
    return imported and not card.streamable


def output_frames(card: ModelCard, samples: int) -> int:
    """Output frames model.onnx gives for `samples` samples of a model `can_chunk` takes."""
    if card.nemo_features is not None:  # NeMo's frames, then its encoder's strides (ceil)
        return -(-card.nemo_features.num_frames(samples) // card.time_stride)
    return (
        (samples - card.receptive_field) // card.time_stride + 1
        if samples >= card.receptive_field
        else 0
    )


class ChunkFeeder:
    """Samples in, overlapped windows out, for one stream.

    Output frame t of the model covers samples [t * S, t * S + F) (S = time_stride,
    F = receptive_field), so a window starting at frame a holds frames a, a + 1, ...
    as far as its samples reach. Window n starts at frame max(0, nC - L) and its kept
    frames are [nC, nC + C) of the utterance. For a NeMo-recipe model S and F are
    time_stride feature hops (frames are centred on their hop, so a window starting on
    an output frame's first sample holds the utterance's frames from that one on).
    """

    def __init__(self, card: ModelCard, cfg: ChunkConfig) -> None:
        if not can_chunk(card):
            raise ModelError(f"model {card.name!r} cannot stream by overlapped chunks")
        self.card = card
        self.chunk, self.left, self.right = cfg.frames(card)
        self.stride, self.field = card.time_stride, card.receptive_field
        if card.nemo_features is not None:  # in samples, as the feeder counts
            self.stride = self.field = card.time_stride * card.nemo_features.hop_samples
        self._buffer = np.zeros(0, dtype=np.float32)  # samples from _offset on
        self._offset = 0  # sample index of _buffer[0]
        self.samples_in = 0  # samples accepted
        self.next_frame = 0  # first frame of the next chunk
        self.finished = False

    def accept(self, samples: np.ndarray) -> None:
        if self.finished:
            raise RuntimeError("accept() after finish()")
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        self._buffer = np.concatenate([self._buffer, samples])
        self.samples_in += len(samples)

    def finish(self) -> None:
        self.finished = True

    @property
    def total_frames(self) -> int | None:
        """Output frames of the whole stream, known once it is finished."""
        if not self.finished:
            return None
        return output_frames(self.card, self.samples_in)

    def _end(self, first: int) -> int:
        """Samples a window needs to hold frames up to chunk `first`'s right context."""
        return (first + self.chunk + self.right - 1) * self.stride + self.field

    def ready(self, coming: int = 0) -> bool:
        if self.finished:
            return self.next_frame < self.total_frames
        return self._end(self.next_frame) <= self.samples_in + coming

    @property
    def done(self) -> bool:
        return self.finished and not self.ready()

    def next_window(self) -> tuple[np.ndarray, int, int]:
        """The next window's samples (float32, as received), the index of its first kept
        frame among the window's output frames, and how many frames it keeps."""
        if not self.ready():
            raise RuntimeError("no window is ready: accept() more samples or finish()")
        first = self.next_frame
        start = max(0, first - self.left) * self.stride
        end = min(self._end(first), self.samples_in)
        window = self._buffer[start - self._offset : end - self._offset]
        keep = self.chunk if not self.finished else min(self.chunk, self.total_frames - first)
        self.next_frame += self.chunk
        # Samples before the next window's start are never needed again.
        drop = max(0, self.next_frame - self.left) * self.stride - self._offset
        drop = min(max(drop, 0), len(self._buffer))
        self._buffer = self._buffer[drop:]
        self._offset += drop
        return np.ascontiguousarray(window), first - start // self.stride, keep
