"""The model card: everything a server needs to know about an exported model.

`echoic export` writes the card as JSON into the ONNX metadata (key
`echoic.model_card`) of both `model.onnx` and `stream.onnx`, so a model directory
describes itself and nothing is hard-coded on the serving side. This module reads
and checks it without torch: onnxruntime, which the server has anyway, parses the
metadata.

A card that does not match its graph (names, feature dimension, vocabulary size,
window and state shapes) is an error naming the file, never a guess.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from echoic.model.core.configs import ConfigError, from_dict, to_dict
from echoic.model.core.features import FeatureConfig, NemoFeatureConfig
from echoic.model.core.text import TextError, Vocabulary

CARD_KEY = "echoic.model_card"  # metadata_props key holding the card's JSON
CARD_FORMAT = "echoic-model-card-1"
OFFLINE_FILE = "model.onnx"
STREAM_FILE = "stream.onnx"
REPORT_FILE = "export.json"  # written last by `echoic export`: a version is complete with it
BATCH = "batch"  # the symbolic batch dimension of every graph input and output


# The card fields of an imported full-context model (a wav2vec2, a NeMo model): no
# stream.onnx, no recurrent state; it streams by overlapped chunks (`chunking.py`).
FULL_CONTEXT: dict[str, Any] = {
    "pad_left": 0,
    "streamable": False,
    "chunk_frames": 0,
    "context_frames": 0,
    "window_input_frames": 0,
    "state_batch_axis": 1,
    "states": (),
    "rnn_type": "none",
    "rnn_layers": 0,
    "rnn_hidden": 0,
    "bidirectional": True,
}


class ModelError(Exception):
    """A model directory or ONNX file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class StateSpec:
    input: str  # stream.onnx input carrying this state into a step, e.g. "state_h.0"
    output: str  # stream.onnx output carrying it out of the step, e.g. "next_state_h.0"
    shape: tuple[int | str, ...]  # (1, "batch", hidden units); streams stack on the "batch" axis


@dataclass(frozen=True)
class ModelCard:
    format: str  # CARD_FORMAT
    name: str  # model name, as in MODEL_REPO/<name>/<version>/
    version: str  # model version, as in MODEL_REPO/<name>/<version>/
    vocabulary: tuple[str, ...]  # output symbols in id order
    blank_id: int  # CTC blank's id in the vocabulary
    features: FeatureConfig  # the feature config the model was trained with (model.features)
    sample_rate: int  # Hz, audio rate the features expect (= features.sample_rate)
    hop_ms: float  # feature frame shift, ms (= features.hop_ms)
    num_features: int  # F, feature values per frame (= features.num_features)
    time_stride: int  # S, input frames per output frame
    output_frame_ms: float  # duration of one output frame, ms (= hop_ms * time_stride)
    receptive_field: int  # input frames one output frame sees
    pad_left: int  # frames of feature_mean a client puts before the first real frame
    streamable: bool  # whether stream.onnx exists for this model
    chunk_frames: int  # C, output frames per streaming step (0: not streamable)
    context_frames: int  # R, output frames of right context (lookahead) per step
    window_input_frames: int  # W, input frames per streaming step (0: not streamable)
    state_batch_axis: int  # axis of each state tensor along which streams stack
    states: tuple[StateSpec, ...]  # recurrent state tensors of stream.onnx, in layer order
    feature_mean: tuple[float, ...]  # raw feature value whose normalised value is exactly 0
    rnn_type: str  # "gru", "lstm" or "rnn" (clipped ReLU)
    rnn_layers: int  # recurrent layers
    rnn_hidden: int  # hidden units per direction
    bidirectional: bool  # BiRNN (chunked for streaming) or forward-only with lookahead
    parameters: int  # trainable parameters of the network
    config_hash: str  # hash of the training settings that change the weights (checkpoint)
    model_config_hash: str  # hash of the model config alone
    training_step: int  # optimizer steps the checkpoint had taken
    opset: int  # ONNX opset of both graphs
    # What an imported model (`echoic import-model`) needs said; echoic's own models keep
    # the defaults, which `to_json` leaves out, so their cards are the bytes they were.
    input: Literal["features", "waveform"] = "features"  # what model.onnx takes: "features"
    # (B, T, F) frames of `features` with lengths in frames; "waveform": (B, S) samples at
    # sample_rate with lengths in samples (`features` then frames single samples: F = 1)
    normalize: Literal["none", "utterance"] = "none"  # waveform scaling before the model:
    # "utterance" = zero mean and unit variance over each utterance's own samples
    batch_padding: Literal["masked", "alone"] = "masked"  # "masked": the graph masks each
    # row's padding (lengths), so batch-mates never change a row; "alone": it cannot (a
    # wav2vec2 with group norm), so each utterance runs as a batch of one
    token_type: Literal["chars", "bpe"] = "chars"  # "chars": each vocabulary symbol is one
    # character; "bpe": a SentencePiece token, a word beginning at each "▁" (`Vocabulary`)
    feature_recipe: Literal["echoic", "nemo"] = "echoic"  # how an input "features" model's
    # features are computed: echoic's log-mel (`features`), or NeMo's preprocessor
    # (`nemo_features`; `features` then only gives the sizes: rate, hop, mel bins)
    nemo_features: NemoFeatureConfig | None = None  # NeMo's preprocessor settings
    source: str = "echoic"  # the weights' origin: "echoic", "huggingface:<class>" or
    # "nemo:<class>"
    source_tokens: tuple[str, ...] = ()  # the source model's token for each vocabulary id,
    # e.g. "<pad>" for the blank and "|" (its word delimiter) for " "; () for echoic's own
    max_frames: int = 0  # most output frames one model.onnx call can give an utterance (a
    # Conformer's positional table holds so many; longer audio runs in windows,
    # `chunking.py`); 0: no fixed limit
    precision: Literal["fp32", "int8"] = "fp32"  # the graphs' weights: "int8" = ONNX Runtime's
    # static quantization of the convolutions and matrix products (`echoic quantize`; the
    # recurrent layers stay fp32), activation scales fixed by calibration audio

    def __post_init__(self) -> None:
        if self.format != CARD_FORMAT:
            raise ValueError(f"card format {self.format!r} is not {CARD_FORMAT!r}")
        vocab = self.vocab  # raises TextError on a bad vocabulary
        f = self.features
        checks = [
            (self.blank_id == vocab.blank_id, f"blank_id must be {vocab.blank_id}"),
            (self.sample_rate == f.sample_rate, "sample_rate differs from features"),
            (self.hop_ms == f.hop_ms, "hop_ms differs from features"),
            (self.num_features == f.num_features, "num_features differs from features"),
            (len(self.feature_mean) == f.num_features, "feature_mean needs num_features values"),
            (self.time_stride >= 1 and self.receptive_field >= 1, "bad time_stride/field"),
            (self.output_frame_ms == self.hop_ms * self.time_stride, "bad output_frame_ms"),
            (0 <= self.pad_left < self.receptive_field, "pad_left must be < receptive_field"),
            (self.max_frames >= 0, "max_frames must be 0 (no limit) or positive"),
            (
                not self.source_tokens or len(self.source_tokens) == len(self.vocabulary),
                "source_tokens needs one token per vocabulary symbol",
            ),
        ]
        if self.input == "waveform":
            one_sample = f.window_samples == f.hop_samples == 1
            checks += [
                (one_sample and self.num_features == 1, "a waveform input frames single samples"),
                (not self.streamable, "a waveform-input model has no stream.onnx (yet)"),
            ]
        else:
            checks.append((self.normalize == "none", "normalize applies to waveform input only"))
        nemo = self.nemo_features
        checks.append(
            (
                (self.feature_recipe == "nemo") == (nemo is not None),
                "nemo_features is given exactly when feature_recipe is 'nemo'",
            )
        )
        if nemo is not None:
            checks += [
                (self.input == "features", "the nemo feature recipe needs input 'features'"),
                (nemo.sample_rate == self.sample_rate, "nemo_features' sample_rate differs"),
                (nemo.hop_ms == self.hop_ms, "nemo_features' hop differs from hop_ms"),
                (nemo.mel_bins == self.num_features, "nemo_features' mel_bins != num_features"),
                (not self.streamable, "a nemo-recipe model has no stream.onnx"),
            ]
        if self.streamable:
            w = (self.chunk_frames + self.context_frames - 1) * self.time_stride
            w += self.receptive_field
            checks += [
                (self.chunk_frames >= 1, "a streamable model needs chunk_frames >= 1"),
                (self.window_input_frames == w, f"window_input_frames must be {w}"),
                (len(self.states) >= 1, "a streamable model needs states"),
            ]
        for spec in self.states:
            sizes = [d for d in spec.shape if isinstance(d, int)]
            ok = spec.shape[self.state_batch_axis] == BATCH and all(d >= 1 for d in sizes)
            checks.append((ok, f"state {spec.input} has a bad shape {list(spec.shape)}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def vocab(self) -> Vocabulary:
        return Vocabulary(self.vocabulary, self.token_type)

    def state_shape(self, spec: StateSpec, batch: int) -> tuple[int, ...]:
        """The concrete shape of a state tensor for `batch` streams."""
        return tuple(batch if d == BATCH else int(d) for d in spec.shape)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): the same card always gives the same bytes."""
        data = to_dict(self)
        for name, default in _LATER_DEFAULTS.items():
            if data[name] == default:
                del data[name]
        return json.dumps(data, sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str, source: str | Path = "model card") -> ModelCard:
        """Parse and check a card; ModelError names `source` and what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ModelError(f"{source}: the model card is not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ModelError(f"{source}: the model card is not a JSON object")
        if data.get("format") != CARD_FORMAT:
            raise ModelError(
                f"{source}: model card format {data.get('format')!r} is not supported "
                f"(this echoic reads {CARD_FORMAT!r}); re-export the model with this version"
            )
        try:
            return from_dict(cls, data)
        except (ConfigError, TextError, ValueError) as e:
            raise ModelError(f"{source}: invalid model card: {e}") from e


# The fields added after the first cards (imported models, quantization), at the values
# an fp32 echoic model has: left out of the JSON there, so such cards keep their bytes.
_LATER_FIELDS = (
    "input", "normalize", "batch_padding", "token_type", "feature_recipe", "nemo_features",
    "source", "source_tokens", "precision", "max_frames",
)  # fmt: skip
_LATER_DEFAULTS = {
    f.name: json.loads(json.dumps(f.default))  # as to_dict writes it: () becomes []
    for f in dataclasses.fields(ModelCard)
    if f.name in _LATER_FIELDS
}


# ---------------------------------------------------------------- reading from ONNX


def card_from_metadata(metadata: dict[str, str], source: str | Path) -> ModelCard:
    if CARD_KEY not in metadata:
        raise ModelError(
            f"{source}: no model card (metadata key {CARD_KEY!r}); "
            "was this file written by `echoic export`?"
        )
    return ModelCard.from_json(metadata[CARD_KEY], source)


def open_session(
    path: Path, options: Any = None, providers: Sequence[str] = ("CPUExecutionProvider",)
) -> Any:
    """An onnxruntime InferenceSession of `path`; ModelError naming the file if it fails."""
    import onnxruntime as ort

    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    if options is None:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only
    try:
        return ort.InferenceSession(str(path), options, providers=list(providers))
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
        text = str(e).strip()
        first_line = text.splitlines()[0] if text else type(e).__name__
        raise ModelError(f"{path}: not a loadable ONNX model ({first_line})") from e


def read_card(onnx_path: str | Path) -> ModelCard:
    """The card of an exported `model.onnx` or `stream.onnx`, checked against its graph."""
    path = Path(onnx_path)
    session = open_session(path)
    card = card_from_metadata(session.get_modelmeta().custom_metadata_map, path)
    stream = any(a.name == "out_frames" for a in session.get_inputs())
    check_graph(card, session, path, stream=stream)
    return card


# ---------------------------------------------------------------- card vs graph


def check_graph(card: ModelCard, session: Any, path: str | Path, *, stream: bool) -> None:
    """Raise ModelError naming `path` unless the session's graph is the one the card
    describes: offline (`model.onnx`, on features or a waveform) or streaming
    (`stream.onnx`) inputs and outputs."""
    inputs = {a.name: a for a in session.get_inputs()}
    outputs = {a.name: a for a in session.get_outputs()}
    v, f = len(card.vocabulary), card.num_features
    if stream:
        want_in = {"features", "out_frames", *(s.input for s in card.states)}
        want_out = {"log_probs", *(s.output for s in card.states)}
        shapes = {
            "features": [BATCH, card.window_input_frames, f],
            "log_probs": [BATCH, card.chunk_frames, v],
        }
        shapes |= {s.input: list(s.shape) for s in card.states}
        shapes |= {s.output: list(s.shape) for s in card.states}
    elif card.input == "waveform":
        want_in, want_out = {"waveform", "lengths"}, {"log_probs", "out_lengths"}
        shapes = {"waveform": [BATCH, "samples"], "log_probs": [BATCH, "out_frames", v]}
    else:
        want_in, want_out = {"features", "lengths"}, {"log_probs", "out_lengths"}
        shapes = {"features": [BATCH, "frames", f], "log_probs": [BATCH, "out_frames", v]}
    if set(inputs) != want_in or set(outputs) != want_out:
        raise ModelError(
            f"{path}: graph inputs {sorted(inputs)} and outputs {sorted(outputs)} do not match "
            f"its model card ({sorted(want_in)} -> {sorted(want_out)})"
        )
    args = inputs | outputs
    for name, want in shapes.items():
        got = list(args[name].shape)
        # Only sizes that are fixed on both sides can disagree; symbolic ones are free.
        fixed = [(g, w) for g, w in zip(got, want, strict=False) if isinstance(w, int)]
        if len(got) != len(want) or any(isinstance(g, int) and g != w for g, w in fixed):
            raise ModelError(
                f"{path}: {name} has shape {got} but the model card says {want} "
                f"({v} vocabulary symbols, {f} features per frame"
                + (f", windows of {card.window_input_frames} frames)" if stream else ")")
            )
