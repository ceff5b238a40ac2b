"""Export a checkpoint to a model directory that the server loads as it is.

    model.onnx   offline graph: features (B, T, F) float32, lengths (B,) int64
                 -> log_probs (B, T', V) float32, out_lengths (B,) int64
    stream.onnx  one streaming step over B streams (streamable models only):
                 features (B, W, F), out_frames (B,) int64, state_h.{i} (1, B, H)
                 [+ state_c.{i} for LSTM] -> log_probs (B, C, V), next_state_h.{i} ...
    export.json  what the export checked (parity numbers), for people

With quantize="int8" the graphs are quantized after their parity is proved
(`echoic.model.nn.quantize`, whose docstring says what that covers and costs). With
weights="float16" the large weights are rounded to float16 and stored so, computed in
float32 (`echoic.model.nn.half`): half the file.

Both graphs carry the model card (`echoic.model.runtime.card`) in their metadata. The
features are the raw log spectrogram of `model.features`: the graphs normalise
with the training statistics themselves.

Nothing is written unless ONNX Runtime reproduces torch: the offline graph on
several batch sizes and lengths, and the streaming graph step by step (through
the same `Engine` and `WindowFeeder` the server uses) against the offline graph.
The files are built in a temporary directory beside `out_dir` and renamed into
place, so a failed export leaves nothing behind. The same checkpoint gives the
same bytes (with the same torch, onnx and onnxruntime).
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from echoic.model.core.configs import config_hash
from echoic.model.core.files import staged_directory, write_durably
from echoic.model.nn.half import WEIGHT_DTYPES, round_weights, store_half
from echoic.model.nn.network import DeepSpeech2, count_parameters
from echoic.model.nn.quantize import QUANTIZE_SCHEMES, QuantizeError, int8_card, quantize_graphs
from echoic.model.runtime.card import (
    BATCH,
    CARD_FORMAT,
    CARD_KEY,
    OFFLINE_FILE,
    REPORT_FILE,
    STREAM_FILE,
    ModelCard,
    StateSpec,
)
from echoic.model.runtime.repository import check_name

if TYPE_CHECKING:
    from echoic.model.nn.checkpoint import Checkpoint
    from echoic.model.runtime.engine import Engine

OPSET = 17
DEFAULT_STREAM_CHUNK = 16  # output frames per streaming step of a unidirectional model
PARITY_TOLERANCE = 1e-4  # max |log-prob difference| allowed over valid frames
# Utterance lengths (input frames) of the parity batches: batch 1 short and long, mixed.
PARITY_BATCHES: tuple[tuple[int, ...], ...] = ((23,), (150,), (61, 37, 5), (96, 96, 17, 1))


class ExportError(Exception):
    """The checkpoint cannot be exported, or its ONNX graphs do not reproduce it."""


# ---------------------------------------------------------------- the card


def build_card(
    model: DeepSpeech2, ckpt: Checkpoint, *, name: str, version: str, chunk: int
) -> ModelCard:
    """The card of `model` streamed with `chunk` output frames per step (0: not streamable)."""
    cfg = model.cfg
    parts = ("h", "c") if cfg.rnn_type == "lstm" else ("h",)
    states = tuple(
        StateSpec(f"state_{p}.{i}", f"next_state_{p}.{i}", (1, BATCH, cfg.rnn_hidden))
        for i in range(cfg.rnn_layers)
        for p in parts
    )
    return ModelCard(
        format=CARD_FORMAT,
        name=name,
        version=version,
        vocabulary=cfg.vocabulary,
        blank_id=0,
        features=cfg.features,
        sample_rate=cfg.features.sample_rate,
        hop_ms=cfg.features.hop_ms,
        num_features=cfg.features.num_features,
        time_stride=cfg.time_stride,
        output_frame_ms=cfg.features.hop_ms * cfg.time_stride,
        receptive_field=cfg.receptive_field,
        pad_left=cfg.pad_left,
        streamable=bool(chunk),
        chunk_frames=chunk,
        context_frames=cfg.context_frames,
        window_input_frames=cfg.window_input_frames(chunk) if chunk else 0,
        state_batch_axis=1,
        states=states if chunk else (),
        feature_mean=tuple(float(x) for x in model.feature_mean.tolist()),
        rnn_type=cfg.rnn_type,
        rnn_layers=cfg.rnn_layers,
        rnn_hidden=cfg.rnn_hidden,
        bidirectional=cfg.bidirectional,
        parameters=count_parameters(model),
        config_hash=ckpt.config_hash,
        model_config_hash=config_hash(cfg),
        training_step=ckpt.step,
        opset=OPSET,
    )


# ---------------------------------------------------------------- the graphs


class _StreamGraph(nn.Module):
    """`DeepSpeech2.step` with its state as flat tensors, one graph input each."""

    def __init__(self, model: DeepSpeech2) -> None:
        super().__init__()
        self.model = model
        self.per_layer = 2 if model.cfg.rnn_type == "lstm" else 1

    def forward(self, features: Tensor, out_frames: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        n = self.per_layer
        layers = [tuple(state[i : i + n]) for i in range(0, len(state), n)]
        log_probs, new = self.model.step(features, out_frames, layers)  # (B, C, V)
        return (log_probs, *(t for layer in new for t in layer))


Shapes = dict[str, list[int | str]]  # graph input/output name -> dims (str: symbolic)


def _trace(
    module: nn.Module,
    args: tuple[Tensor, ...],
    inputs: list[str],
    outputs: list[str],
    shapes: Shapes,
) -> bytes:
    """Export `module` with the TorchScript exporter; raise if the trace froze a shape."""
    buf = io.BytesIO()
    dynamic = {
        n: {i: d for i, d in enumerate(dims) if isinstance(d, str)} for n, dims in shapes.items()
    }
    with warnings.catch_warnings():
        # The exporter's own deprecation notices and nn.RNN's input checks are noise here;
        # a trace warning from echoic code means a value got frozen into the graph.
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", category=torch.jit.TracerWarning, module=r"echoic\.")
        try:
            torch.onnx.export(
                module.eval(),
                args,
                buf,
                input_names=inputs,
                output_names=outputs,
                dynamic_axes=dynamic,
                opset_version=OPSET,
                do_constant_folding=True,
                dynamo=False,
            )
        except torch.jit.TracerWarning as e:
            raise ExportError(
                f"the network does not trace to a shape-independent graph: {e}"
            ) from e
    return buf.getvalue()


def _finish_graph(onnx_bytes: bytes, card: ModelCard, graph: str, shapes: Shapes) -> bytes:
    """Name every input and output dimension as the card does, and add the card."""
    import onnx

    proto = onnx.load_from_string(onnx_bytes)
    for value in [*proto.graph.input, *proto.graph.output]:
        dims = value.type.tensor_type.shape.dim
        for dim, want in zip(dims, shapes[value.name], strict=True):
            dim.Clear()
            if isinstance(want, int):
                dim.dim_value = want
            else:
                dim.dim_param = want
    proto.doc_string = f"echoic model {card.name} version {card.version}: {graph} graph"
    del proto.metadata_props[:]
    meta = {
        CARD_KEY: card.to_json(),
        "echoic.format": CARD_FORMAT,
        "echoic.name": card.name,
        "echoic.version": card.version,
        "echoic.graph": graph,
    }
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def _export_offline(model: DeepSpeech2, card: ModelCard) -> bytes:
    cfg = model.cfg
    frames = 3 * max(cfg.chunk_frames, 4) * cfg.time_stride + 1  # several chunks
    features = model.feature_mean.expand(2, frames, -1).clone()
    lengths = torch.tensor([frames, frames // 2])
    shapes: Shapes = {
        "features": [BATCH, "frames", card.num_features],
        "lengths": [BATCH],
        "log_probs": [BATCH, "out_frames", len(card.vocabulary)],
        "out_lengths": [BATCH],
    }
    inputs, outputs = ["features", "lengths"], ["log_probs", "out_lengths"]
    onnx_bytes = _trace(model, (features, lengths), inputs, outputs, shapes)
    return _finish_graph(onnx_bytes, card, "offline", shapes)


def _export_stream(model: DeepSpeech2, card: ModelCard) -> bytes:
    window = model.feature_mean.expand(2, card.window_input_frames, -1).clone()
    out_frames = torch.tensor([card.chunk_frames + card.context_frames, 1])
    state = [torch.zeros(card.state_shape(s, 2)) for s in card.states]
    shapes: Shapes = {
        "features": [BATCH, card.window_input_frames, card.num_features],
        "out_frames": [BATCH],
        "log_probs": [BATCH, card.chunk_frames, len(card.vocabulary)],
        **{s.input: list(s.shape) for s in card.states},
        **{s.output: list(s.shape) for s in card.states},
    }
    inputs = ["features", "out_frames", *(s.input for s in card.states)]
    outputs = ["log_probs", *(s.output for s in card.states)]
    onnx_bytes = _trace(_StreamGraph(model), (window, out_frames, *state), inputs, outputs, shapes)
    return _finish_graph(onnx_bytes, card, "stream", shapes)


# ---------------------------------------------------------------- parity


@dataclass
class Parity:
    tolerance: float  # max |difference| allowed
    torch_finite: bool  # whether torch's own log-probs were all finite
    offline: list[dict[str, Any]]  # per batch: lengths, max_abs_diff (torch vs model.onnx)
    stream: dict[str, Any] | None  # lengths, steps, max_abs_diff (stream.onnx vs model.onnx)

    def failures(self) -> list[str]:
        if not self.torch_finite:
            return ["torch's own log-probs are not finite (a diverged or corrupt checkpoint?)"]
        bad = [
            f"offline lengths {case['lengths']}: max |diff| {case['max_abs_diff']:.3g}"
            for case in self.offline
            if not case["max_abs_diff"] <= self.tolerance  # NaN fails too
        ]
        if self.stream is not None and not self.stream["max_abs_diff"] <= self.tolerance:
            bad.append(f"streaming vs offline: max |diff| {self.stream['max_abs_diff']:.3g}")
        return bad


def _max_abs_diff(pairs: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Largest |a - b| over all pairs: inf if shapes differ, NaN if either side has a NaN."""
    worst = [np.max(np.abs(a - b), initial=0.0) if a.shape == b.shape else np.inf for a, b in pairs]
    return float(np.max(worst, initial=0.0))


def _torch_log_probs(model: DeepSpeech2, feats: list[np.ndarray]) -> list[np.ndarray]:
    """torch's log-probs of utterances run as one padded batch, each cut to its length."""
    with torch.no_grad():
        batch = torch.nn.utils.rnn.pad_sequence(
            [torch.from_numpy(f) for f in feats], batch_first=True
        )
        log_probs, lengths = model(batch, torch.tensor([len(f) for f in feats]))
    return [lp[: int(n)].numpy() for lp, n in zip(log_probs, lengths, strict=True)]


def _random_features(model: DeepSpeech2, frames: int, rng: np.random.Generator) -> np.ndarray:
    """Features in the range training saw: the feature mean plus noise of its spread."""
    mean, std = model.feature_mean.numpy(), model.feature_std.numpy()
    return (mean + std * rng.standard_normal((frames, mean.size))).astype(np.float32)


def _stream_all(
    engine: Engine, utterances: list[np.ndarray], rng: np.random.Generator
) -> tuple[list[np.ndarray], int]:
    """Stream all utterances at once, as the server does: frames arrive in uneven pieces,
    every step batches the streams that have a window ready. Returns log-probs, steps."""
    feeders = [engine.feeder() for _ in utterances]
    states = [engine.initial_state(1) for _ in utterances]
    outputs: list[list[np.ndarray]] = [[] for _ in utterances]
    fed = [0] * len(utterances)
    steps = 0
    while not all(f.done for f in feeders):
        for i, (feeder, x) in enumerate(zip(feeders, utterances, strict=True)):
            if not feeder.finished:
                n = int(rng.integers(1, engine.card.window_input_frames + 8))
                feeder.accept(x[fed[i] : fed[i] + n])
                fed[i] += n
                if fed[i] >= len(x):
                    feeder.finish()
        ready = [i for i, f in enumerate(feeders) if f.ready()]
        if not ready:
            continue
        windows, out_frames = zip(*(feeders[i].next_window() for i in ready), strict=True)
        batch_state = engine.gather_states([states[i] for i in ready])
        log_probs, new = engine.stream_step(np.stack(windows), np.array(out_frames), batch_state)
        for j, (i, state) in enumerate(zip(ready, engine.scatter_states(new), strict=True)):
            states[i] = state
            outputs[i].append(log_probs[j, : min(engine.card.chunk_frames, out_frames[j])])
        steps += 1
    vocab = len(engine.card.vocabulary)
    joined = [np.concatenate(o) if o else np.zeros((0, vocab), np.float32) for o in outputs]
    return joined, steps


def check_parity(
    model: DeepSpeech2, model_dir: Path, tolerance: float = PARITY_TOLERANCE
) -> Parity:
    """Compare torch with the ONNX graphs in `model_dir`; the caller judges the numbers."""
    from echoic.model.runtime.engine import Engine

    engine = Engine(model_dir)
    rng = np.random.default_rng(0)
    offline = []
    utterances = []
    finite = True
    for lengths in PARITY_BATCHES:
        feats = [_random_features(model, n, rng) for n in lengths]
        utterances += feats
        pairs = list(zip(_torch_log_probs(model, feats), engine.offline(feats), strict=True))
        finite &= all(np.isfinite(w).all() for w, _ in pairs)
        offline.append({"lengths": list(lengths), "max_abs_diff": _max_abs_diff(pairs)})
    stream = None
    if engine.streamable:
        streamed, steps = _stream_all(engine, utterances, rng)
        pairs = list(zip(streamed, engine.offline(utterances), strict=True))
        lengths = [len(u) for u in utterances]
        stream = {"lengths": lengths, "steps": steps, "max_abs_diff": _max_abs_diff(pairs)}
    return Parity(tolerance, finite, offline, stream)


# ---------------------------------------------------------------- the directory


def _default_version(out_dir: Path) -> str:
    """MODEL_REPO/<name>/<version>/: a numbered directory names the version, else "1"."""
    return out_dir.name if out_dir.name.isascii() and out_dir.name.isdigit() else "1"


def export_model(
    checkpoint_path: str | Path,
    out_dir: str | Path,
    *,
    name: str | None = None,
    version: str | None = None,
    stream_chunk: int | None = None,
    tolerance: float = PARITY_TOLERANCE,
    quantize: str | None = None,
    calibration: Sequence[np.ndarray] = (),
    weights: str = "float32",
) -> Path:
    """Export a checkpoint to `out_dir` (which must not exist, or be empty).

    name defaults to the model config's name; version to `out_dir`'s name when it is
    a number (MODEL_REPO/<name>/<version>/), else "1". stream_chunk: output frames per
    streaming step of a unidirectional model (default 16); a chunked BiRNN streams
    with the chunk it was trained with. Raises ExportError, writing nothing, when the
    ONNX graphs differ from torch by more than `tolerance`. quantize="int8": the graphs,
    once their fp32 parity is proved, are quantized (`echoic.model.nn.quantize`) with
    activation scales from `calibration` (float32 samples at the model's rate).
    weights="float16": the large weights rounded to float16 and stored so
    (`echoic.model.nn.half`); the parity check judges the graphs against the rounded
    network, and the report says how far the rounding moved the log-probabilities.
    """
    from echoic.model.nn.checkpoint import load_model

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} already exists; export each version to a new directory")
    try:
        model, ckpt = load_model(checkpoint_path)
    except ValueError as e:
        raise ExportError(str(e)) from e
    cfg = model.cfg
    chunk = _stream_chunk(model, stream_chunk)
    name = name or cfg.name
    version = version or _default_version(out_dir)
    try:
        check_name("name", name)
        check_name("version", version)
    except ValueError as e:
        raise ExportError(str(e)) from e
    card = build_card(model, ckpt, name=name, version=version, chunk=chunk)
    if quantize not in (None, *QUANTIZE_SCHEMES):
        raise ExportError(f"unknown quantization {quantize!r}; choose from {QUANTIZE_SCHEMES}")
    if quantize and not calibration:
        raise ExportError("quantization needs calibration audio (--calibration MANIFEST)")
    if weights not in WEIGHT_DTYPES:
        raise ExportError(f"unknown weights {weights!r}; choose from {WEIGHT_DTYPES}")
    if quantize and weights != "float32":
        raise ExportError("--quantize int8 quantizes float32 weights: drop --weights float16")
    half = _round_to_half(model) if weights == "float16" else None

    with staged_directory(out_dir) as tmp:
        graphs = {OFFLINE_FILE: _export_offline(model, card)}
        if card.streamable:
            graphs[STREAM_FILE] = _export_stream(model, card)
        for file, graph in graphs.items():
            if half is not None:
                graph, half["stored"][file] = store_half(graph)
            write_durably(tmp / file, graph)
        parity = check_parity(model, tmp, tolerance)
        failures = parity.failures()
        if failures:
            raise ExportError(
                f"ONNX Runtime does not reproduce the checkpoint (tolerance {tolerance:g}): "
                + "; ".join(failures)
            )
        report: dict[str, Any] = {"parity": asdict(parity)}
        if half is not None:
            report["weights"] = half
        if quantize:
            card = int8_card(card)
            try:
                report["quantization"] = quantize_graphs(tmp, card, calibration)
            except QuantizeError as e:
                raise ExportError(str(e)) from e
        report["model_card"] = json.loads(card.to_json())
        report_text = json.dumps(report, indent=2, sort_keys=True) + "\n"
        write_durably(tmp / REPORT_FILE, report_text.encode())
    return out_dir


def _round_to_half(model: DeepSpeech2) -> dict[str, Any]:
    """Round the model's large weights to float16 (in place); what that changed: the
    values rounded, and the largest log-probability change on random features of the
    parity check's largest batch."""
    rng = np.random.default_rng(0)
    feats = [_random_features(model, n, rng) for n in max(PARITY_BATCHES, key=len)]
    before = _torch_log_probs(model, feats)
    rounded = round_weights(model)
    after = _torch_log_probs(model, feats)
    return {
        "dtype": "float16",
        "values_rounded": rounded,
        "max_abs_log_prob_change": _max_abs_diff(list(zip(before, after, strict=True))),
        "stored": {},  # graph file -> the tensors and values stored as float16
    }


def _stream_chunk(model: DeepSpeech2, requested: int | None) -> int:
    """Output frames per streaming step, or 0 for a model that cannot stream."""
    cfg = model.cfg
    if not cfg.streamable:
        if requested:
            raise ExportError(
                "this model is a full-context BiRNN (chunk_frames = 0) and cannot stream; "
                "drop --stream-chunk (model.onnx alone is exported)"
            )
        return 0
    if cfg.bidirectional:
        if requested not in (None, cfg.chunk_frames):
            raise ExportError(
                f"a chunked BiRNN streams only with the chunk it was trained with "
                f"({cfg.chunk_frames} output frames), not {requested}"
            )
        return cfg.chunk_frames
    chunk = DEFAULT_STREAM_CHUNK if requested is None else requested
    if chunk < 1:
        raise ExportError(f"stream chunk must be at least 1 output frame, got {chunk}")
    return chunk


def read_report(model_dir: str | Path) -> dict[str, Any]:
    """The export report written beside the graphs (parity numbers, the card)."""
    return json.loads((Path(model_dir) / REPORT_FILE).read_text())
