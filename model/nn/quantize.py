"""int8 model directories: ONNX Runtime's static quantization of an exported model.

    quantize_model(src_dir, out_dir, audio)   an fp32 model directory -> an int8 one
                                              (`echoic quantize`)
    quantize_graphs(model_dir, card, audio)   the graphs of a directory being built
                                              (`echoic export --quantize int8`)

What is quantized: the weights of the convolutions and matrix products (`Conv`,
`MatMul`, `Gemm`: the front end and the output layer) become int8 per output channel,
and the activations around them uint8 with scales fixed once, from calibration audio
(min and max of each tensor over it), as QuantizeLinear/DequantizeLinear pairs that
ONNX Runtime fuses into its integer kernels (QDQ format). ONNX Runtime has no quantized
kernel for the ONNX `GRU` op, so the recurrent layers, which hold about 97% of the
default model's weights and take about 70% of its time, stay fp32.

Why static rather than ONNX Runtime's dynamic quantization (`quantize_dynamic`): the
dynamic kind computes an activation's scale per call over the whole input tensor, so a
row's log-probs depend on its batch-mates and a streamed window's on the window
(measured on the bundled model: a third of the held-out transcripts changed when run
alone rather than in a batch, and streaming differed from offline), and its
`ConvInteger` kernel made the model 2-3 times slower. With fixed scales a row is
computed the same whatever runs beside it, and `stream.onnx` gets `model.onnx`'s
scales (`_share_scales`), so streaming equals offline as it does in fp32.

The card says `precision: "int8"`; everything else in it is the source's, so an int8
directory is served, streamed and decoded exactly as its fp32 source is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from echoic.model.core.files import staged_directory, write_durably
from echoic.model.runtime.card import (
    CARD_KEY,
    OFFLINE_FILE,
    REPORT_FILE,
    STREAM_FILE,
    ModelCard,
    ModelError,
    read_card,
)
from echoic.model.runtime.repository import check_name

if TYPE_CHECKING:
    from echoic.model.runtime.engine import Engine

QUANTIZE_SCHEMES = ("int8",)
QUANTIZED_OPS = ("Conv", "MatMul", "Gemm")  # ops whose weights and activations become int8
CALIBRATION_UTTERANCES = 32  # utterances of calibration audio used (the first ones given)


class QuantizeError(Exception):
    """The model cannot be quantized (already int8, no calibration audio, ...)."""


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """onnxruntime.quantization logs advice on the root logger ("consider pre-processing",
    shape inference gaps on integer tensors) that a user cannot act on."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _calibration_feeds(engine: Engine, audio: Sequence[np.ndarray]) -> dict[str, list[dict]]:
    """Graph file -> the inputs of each call to it: every utterance alone through
    model.onnx, and streamed window by window through stream.onnx (fp32, batch 1)."""
    from echoic.model.runtime.recognizer import Recognizer

    recognizer = Recognizer(engine)
    card = engine.card
    offline, stream = [], []
    for samples in audio[:CALIBRATION_UTTERANCES]:
        x = recognizer.model_input(samples)
        if card.max_frames:  # a positional table's end (an imported Conformer): clip there
            m, stride = card.max_frames, card.time_stride  # as Engine._check_length counts
            x = x[
                : (m - 1) * stride + card.receptive_field
                if card.input == "waveform"
                else m * stride
            ]
        if len(x) < (card.receptive_field if card.input == "waveform" else 1):
            continue
        offline.append({card.input: x[None], "lengths": np.array([len(x)], dtype=np.int64)})
        if not engine.streamable:
            continue
        feeder, state = engine.feeder(), engine.initial_state(1)
        feeder.accept(x)
        feeder.finish()
        while feeder.ready():
            window, frames = feeder.next_window()
            feeds = {"features": window[None], "out_frames": np.array([frames], dtype=np.int64)}
            stream.append(feeds | state)
            _, state = engine.stream_step(window[None], np.array([frames]), state)
    if not offline:
        raise QuantizeError("no calibration audio long enough for one output frame")
    return {OFFLINE_FILE: offline, STREAM_FILE: stream}


def _quantize_file(src: Path, dst: Path, feeds: list[dict]) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._feeds = iter(feeds)

        def get_next(self) -> dict | None:
            return next(self._feeds, None)

    with _quiet_quantizer():
        quantize_static(
            src,
            dst,
            Reader(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(QUANTIZED_OPS),
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            # Weights in 7 bits: a CPU without VNNI (AVX2 alone) multiplies u8 by s8 in
            # pairs summed into int16 (VPMADDUBSW), which saturates with full-range
            # weights; on this model posteriors moved by up to 0.97 there.
            reduce_range=True,
            calibrate_method=CalibrationMethod.MinMax,
            calibration_providers=["CPUExecutionProvider"],
            extra_options={"CalibTensorRangeSymmetric": False},
        )


def _activation_scales(proto: Any) -> list[tuple[str, str, str]]:
    """(scale, zero point, role) of each activation a QuantizeLinear quantizes, in graph
    order; role = the ops around it (producer>consumers), to match two graphs' tensors."""
    weights = {t.name for t in proto.graph.initializer}
    producer = {o: n.op_type for n in proto.graph.node for o in n.output}
    consumers: dict[str, list[str]] = {}
    for n in proto.graph.node:
        if n.op_type != "DequantizeLinear":
            for name in n.input:
                consumers.setdefault(name, []).append(n.op_type)
    found = []
    for n in proto.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in weights:
            role = f"{producer.get(n.input[0], 'input')}>{','.join(consumers.get(n.input[0], []))}"
            found.append((n.input[1], n.input[2], role))
    return found


def _share_scales(offline: Any, stream: Any, path: Path) -> None:
    """Give `stream` (a ModelProto) the activation scales of `offline`, tensor by tensor:
    both graphs then quantize the same values the same way, as streaming == offline needs."""
    from onnx import numpy_helper

    want, have = _activation_scales(offline), _activation_scales(stream)
    if [r for *_, r in want] != [r for *_, r in have]:
        raise QuantizeError(
            f"{path}: its quantized activations {[r for *_, r in have]} do not match "
            f"{OFFLINE_FILE}'s {[r for *_, r in want]}; the two graphs cannot share scales"
        )
    values = {t.name: t for t in offline.graph.initializer}
    for t in stream.graph.initializer:
        for (o_scale, o_zero, _), (s_scale, s_zero, _) in zip(want, have, strict=True):
            if t.name in (s_scale, s_zero):
                source = values[o_scale if t.name == s_scale else o_zero]
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(source), t.name))


def _rescale_biases(proto: Any) -> None:
    """Re-quantize each int32 Conv/Gemm bias of `proto` for the input scale it has now.
    The quantizer stored a bias as round(b / (x_scale * w_scale)) with the graph's own
    input scale; once `_share_scales` changed x_scale, a fused QLinearConv would read the
    old integers against the new scale (off by their ratio)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    dq = {n.output[0]: n for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    for node in proto.graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 3:
            continue
        x, w, b = (dq.get(name) for name in node.input[:3])
        if x is None or w is None or b is None or b.input[0] not in inits:
            continue
        bias = numpy_helper.to_array(inits[b.input[0]])
        if bias.dtype != np.int32:
            continue
        old_scale = numpy_helper.to_array(inits[b.input[1]])
        x_scale = numpy_helper.to_array(inits[x.input[1]]).astype(np.float64)
        w_scale = numpy_helper.to_array(inits[w.input[1]]).astype(np.float64)
        new_scale = (x_scale * w_scale).astype(old_scale.dtype)
        values = bias.astype(np.float64) * old_scale.astype(np.float64)
        info = np.iinfo(np.int32)
        fresh = np.clip(np.round(values / new_scale), info.min, info.max).astype(np.int32)
        inits[b.input[0]].CopyFrom(numpy_helper.from_array(fresh, b.input[0]))
        inits[b.input[1]].CopyFrom(numpy_helper.from_array(new_scale, b.input[1]))


def quantize_graphs(
    model_dir: Path, card: ModelCard, audio: Sequence[np.ndarray], src_dir: Path | None = None
) -> dict[str, Any]:
    """Quantize the fp32 graphs of `src_dir` (default: `model_dir` itself, in place) into
    `model_dir`, carrying the int8 `card`, calibrated on `audio` (float32 samples at the
    model's rate); returns the report's "quantization" section.

    The result is loaded back (`Engine`: card and graphs agree) and run once; output
    that is not finite is a QuantizeError.
    """
    import onnx

    from echoic.model.runtime.engine import Engine

    src_dir = src_dir or model_dir
    source = Engine(src_dir)
    feeds = _calibration_feeds(source, audio)
    protos, graphs = {}, {}
    with tempfile.TemporaryDirectory(dir=model_dir, prefix=".quantize.") as scratch:
        for name in (OFFLINE_FILE, STREAM_FILE):
            if not (src_dir / name).is_file():
                continue
            out = Path(scratch) / name
            _quantize_file(src_dir / name, out, feeds[name])
            protos[name] = onnx.load(out)
            before = Counter(n.op_type for n in onnx.load(src_dir / name).graph.node)
            after = Counter(n.op_type for n in protos[name].graph.node)
            graphs[name] = {
                "quantized": {op: before[op] for op in QUANTIZED_OPS if before[op]},
                "left_fp32": {op: after[op] for op in ("GRU", "LSTM", "RNN") if after[op]},
                "activations": len(_activation_scales(protos[name])),
                "bytes": {"fp32": (src_dir / name).stat().st_size},
            }
    if STREAM_FILE in protos:
        _share_scales(protos[OFFLINE_FILE], protos[STREAM_FILE], src_dir / STREAM_FILE)
        _rescale_biases(protos[STREAM_FILE])
    for name, proto in protos.items():
        for entry in proto.metadata_props:
            if entry.key == CARD_KEY:
                entry.value = card.to_json()
        proto.doc_string += " (int8: static quantization, QDQ)"
        onnx.checker.check_model(proto)
        write_durably(model_dir / name, proto.SerializeToString())
        graphs[name]["bytes"]["int8"] = (model_dir / name).stat().st_size
    _check_finite(Engine(model_dir))
    return {
        "scheme": "int8",
        "method": "static, QDQ, per-channel weights, min-max calibration",
        "ops": list(QUANTIZED_OPS),
        "calibration_utterances": len(feeds[OFFLINE_FILE]),
        "graphs": graphs,
    }


def _check_finite(engine: Engine) -> None:
    card = engine.card
    rng = np.random.default_rng(0)
    if card.input == "waveform":
        probe = [rng.standard_normal(card.receptive_field * 4).astype(np.float32)]
    else:
        mean = np.asarray(card.feature_mean, dtype=np.float32)
        probe = [mean + rng.standard_normal((97, card.num_features)).astype(np.float32)]
    outputs = engine.offline(probe)
    if engine.streamable:
        feeder = engine.feeder()
        feeder.accept(probe[0])
        feeder.finish()
        window, frames = feeder.next_window()
        log_probs, _ = engine.stream_step(window[None], np.array([frames]), engine.initial_state(1))
        outputs.append(log_probs)
    if not all(np.isfinite(x).all() for x in outputs):
        raise QuantizeError(f"{engine.model_dir}: the int8 graphs give non-finite log-probs")


def int8_card(card: ModelCard, *, name: str | None = None, version: str | None = None) -> ModelCard:
    """The card of `card`'s model quantized to int8 (QuantizeError if it already is)."""
    if card.precision != "fp32":
        raise QuantizeError(f"model {card.name!r} is already {card.precision}")
    return dataclasses.replace(
        card, precision="int8", name=name or card.name, version=version or card.version
    )


@contextlib.contextmanager
def _float32_source(src_dir: Path, scratch_in: Path) -> Iterator[Path]:
    """`src_dir`, or, when its graphs store their weights as float16 (`echoic export
    --weights float16`), a scratch copy of them with float32 weights (the same values):
    static quantization reads float32 weights."""
    import onnx

    from echoic.model.nn.half import expand_half, half_weights

    if not half_weights(onnx.load(str(src_dir / OFFLINE_FILE))):
        yield src_dir
        return
    with tempfile.TemporaryDirectory(dir=scratch_in, prefix=".float32.") as scratch:
        for name in (OFFLINE_FILE, STREAM_FILE):
            if (src_dir / name).is_file():
                (Path(scratch) / name).write_bytes(expand_half((src_dir / name).read_bytes()))
        yield Path(scratch)


def quantize_model(
    src_dir: str | Path,
    out_dir: str | Path,
    audio: Sequence[np.ndarray],
    *,
    scheme: str = "int8",
    name: str | None = None,
    version: str | None = None,
) -> Path:
    """Write an int8 copy of the fp32 model directory `src_dir` to `out_dir`, calibrated
    on `audio` (float32 samples at the model's rate, the first CALIBRATION_UTTERANCES).

    `out_dir` must not exist (or be empty); other files of `src_dir` (the word LM) are
    copied. name and version default to the source's (version: `out_dir`'s name when it
    is a number, as `echoic export` does). Nothing is left behind on failure.
    """
    if scheme not in QUANTIZE_SCHEMES:
        raise QuantizeError(f"unknown quantization {scheme!r}; choose from {QUANTIZE_SCHEMES}")
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise QuantizeError(f"{out_dir} already exists; write the int8 model to a new directory")
    try:  # the card; quantize_graphs loads the graphs (and checks them against it)
        source_card = read_card(src_dir / OFFLINE_FILE)
    except ModelError as e:
        raise QuantizeError(str(e)) from e
    if version is None and out_dir.name.isascii() and out_dir.name.isdigit():
        version = out_dir.name
    try:
        for what, value in (("name", name), ("version", version)):
            if value is not None:
                check_name(what, value)
    except ValueError as e:
        raise QuantizeError(str(e)) from e
    card = int8_card(source_card, name=name, version=version)
    graphs = {OFFLINE_FILE, STREAM_FILE, REPORT_FILE}
    with staged_directory(out_dir) as tmp:
        try:
            with _float32_source(src_dir, tmp) as source:
                quantization = quantize_graphs(tmp, card, audio, source)
        except ModelError as e:  # graphs that do not match their card, or do not load
            raise QuantizeError(str(e)) from e
        for extra in sorted(src_dir.iterdir()):
            if extra.is_file() and extra.name not in graphs and not extra.name.startswith("."):
                shutil.copy2(extra, tmp / extra.name)
        report: dict[str, Any] = {"model_card": json.loads(card.to_json())}
        if (src_dir / REPORT_FILE).is_file():
            # torch vs the fp32 graphs, as measured when the source was exported
            report["parity"] = json.loads((src_dir / REPORT_FILE).read_text()).get("parity")
        report["quantization"] = {"source": str(src_dir), **quantization}
        text = json.dumps(report, indent=2, sort_keys=True) + "\n"
        write_durably(tmp / REPORT_FILE, text.encode())
    return out_dir
