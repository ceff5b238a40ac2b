"""An NVIDIA NeMo CTC model (EncDecCTCModel, EncDecCTCModelBPE) as an echoic model directory.

The source is NeMo's ONNX export (`model.export("model.onnx")`, the graph

    audio_signal (B, F, T) float32 NeMo features, length (B,) int64 -> logprobs (B, T', V + 1)

with the blank last) and the model's config (`model_config.yaml`) with, for a BPE model,
its tokenizer's vocabulary. Both come from the `.nemo` file (a tar of
`model_config.yaml`, `model_weights.ckpt` and the tokenizer files), read with the
standard library and PyYAML; the ONNX is made from the `.nemo` by NeMo's own `export()`
when `nemo_toolkit` is installed, or given as the source with the `.nemo` (or the config)
beside it when it is not.

echoic then wraps NeMo's graph, unchanged inside, in its own offline signature

    model.onnx   features (B, T, F), lengths (B,) -> log_probs (B, T', V), out_lengths (B,)

- before it: the frames past each row's length set to NeMo's `pad_value`, and the time
  axis padded to what NeMo's preprocessor gives a batch (its STFT's one extra frame,
  then a multiple of `pad_to`), so a batch runs exactly as NeMo runs it;
- after it: echoic's vocabulary order, the blank first (NeMo's last) with any special
  token (`<unk>`, `<s>`, ...) folded into it, as the Hugging Face import does, and
  `out_lengths` from the encoder's time reduction (ceil(T / S): QuartzNet and Citrinet
  strides, Conformer's striding subsampling).

The features are NeMo's preprocessor's, computed by echoic in numpy
(`model/core/features.py:nemo_features`, the card's `feature_recipe` "nemo" and
`nemo_features`, read from the config's `preprocessor`). Characters are NeMo's
`labels`; BPE tokens are the SentencePiece pieces of the tokenizer (`tokenizer.vocab`,
or `vocab.txt`), with the card's `token_type` "bpe" (words begin at "▁").

Nothing is written unless ONNX Runtime runs the wrapped graph to NeMo's own log-probs:
against NeMo's ONNX on batches of echoic's features always, and against NeMo's torch
model (its preprocessor too) when nemo_toolkit is installed (`check_parity`).
"""

from __future__ import annotations

import hashlib
import json
import math
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from echoic.model.core.features import FeatureConfig, NemoFeatureConfig, nemo_features
from echoic.model.core.files import staged_directory, write_durably
from echoic.model.core.text import BLANK, WORD_START, TextError, Vocabulary
from echoic.model.nn.export import PARITY_TOLERANCE, ExportError, Shapes, _default_version
from echoic.model.runtime.card import (
    BATCH,
    CARD_FORMAT,
    FULL_CONTEXT,
    OFFLINE_FILE,
    REPORT_FILE,
    ModelCard,
)
from echoic.model.runtime.repository import check_name

SUPPORTED = ("EncDecCTCModel", "EncDecCTCModelBPE")  # the config's `target` class
# Encoders whose time reduction echoic knows: (config `_target_` suffix, how).
ENCODERS = ("ConvASREncoder", "ConformerEncoder")
NEMO_INPUTS = ("audio_signal", "length")  # "length" only where the graph uses it
NEMO_OUTPUT = "logprobs"
# Utterance lengths (samples) of the parity batches: alone, and a mixed batch.
PARITY_BATCHES: tuple[tuple[int, ...], ...] = ((16000,), (24000, 7123, 2011))


@dataclass(frozen=True)
class NemoSource:
    """What the importer read from a NeMo model's config (and tokenizer)."""

    config_file: str  # where the config came from, named in errors ("x.nemo:model_config.yaml")
    config: dict[str, Any]  # model_config.yaml
    model_class: str  # "EncDecCTCModel" or "EncDecCTCModelBPE"
    tokens: tuple[str, ...]  # NeMo's output tokens in id order, the blank (last id) not included
    special_tokens: tuple[str, ...]  # tokens that spell nothing (folded into the blank)
    features: NemoFeatureConfig
    pad_to: int  # the preprocessor pads frames to a multiple of this (0: no padding)
    pad_value: float  # the value of padded frames
    time_stride: int  # feature frames per output frame (the encoder's time reduction)
    batch_padding: str  # the card's: "masked" (Conformer), "alone" (ConvASR, see _time_stride)
    padding_reach: int  # last output frames of an utterance that padding changes in NeMo's
    # export (masked convolutions off) but not in NeMo's torch model: 0 for a Conformer
    nemo_file: Path | None = None  # the .nemo, when read from one
    files: dict[str, bytes] = field(default_factory=dict, repr=False)  # tar members read


# ---------------------------------------------------------------- reading the source


def _yaml(text: str | bytes, where: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ExportError(f"{where}: not readable YAML ({e})") from e
    if not isinstance(data, dict):
        raise ExportError(f"{where}: expected a YAML mapping (a NeMo model config)")
    return data


def read_nemo_tar(path: Path) -> dict[str, bytes]:
    """The small members of a .nemo (everything but the weights), by base name."""
    if not path.is_file():
        raise ExportError(f"{path}: no such file (a .nemo from NeMo's save_to)")
    try:
        with tarfile.open(path, "r:*") as tar:
            files = {}
            for member in tar.getmembers():
                name = Path(member.name).name
                if member.isfile() and not name.endswith(".ckpt"):
                    handle = tar.extractfile(member)
                    if handle is not None:
                        files[name] = handle.read()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ExportError(f"{path}: not a .nemo file (a tar archive): {e}") from e
    if "model_config.yaml" not in files:
        raise ExportError(f"{path}: has no model_config.yaml; is it a NeMo model (.nemo)?")
    return files


def _member(files: dict[str, bytes], ref: Any) -> bytes | None:
    """A tokenizer file a config names ("nemo:<hash>_tokenizer.vocab", or a path)."""
    if not isinstance(ref, str) or not ref:
        return None
    name = Path(ref.removeprefix("nemo:")).name
    if name in files:
        return files[name]
    path = Path(ref)
    return path.read_bytes() if not ref.startswith("nemo:") and path.is_file() else None


def _spe_pieces(text: str) -> list[str]:
    """tokenizer.vocab (SentencePiece's: "piece<TAB>score" a line) -> the pieces."""
    return [line.split("\t")[0] for line in text.splitlines() if line]


def _vocab_txt_pieces(text: str) -> list[str]:
    """vocab.txt (NeMo's: "##piece" inside a word, "piece" beginning one) -> the pieces,
    in SentencePiece's spelling ("▁piece" begins a word)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [t[2:] if t.startswith("##") else WORD_START + t for t in lines]


def _tokens(config: dict[str, Any], files: dict[str, bytes], where: str, bpe: bool) -> list[str]:
    decoder = config.get("decoder") or {}
    listed = decoder.get("vocabulary") or config.get("labels") or []
    if not bpe:
        if not listed:
            raise ExportError(f"{where}: no labels (decoder.vocabulary or labels) in the config")
        return [str(t) for t in listed]
    tok = config.get("tokenizer") or {}
    spe = _member(files, tok.get("spe_tokenizer_vocab"))
    vocab_txt = _member(files, tok.get("vocab_path"))
    if spe is not None:
        pieces = _spe_pieces(spe.decode("utf-8"))
    elif vocab_txt is not None:
        pieces = _vocab_txt_pieces(vocab_txt.decode("utf-8"))
    else:
        named = tok.get("spe_tokenizer_vocab") or tok.get("vocab_path")
        found = "is not in the .nemo" if files else "needs the .nemo's files (none was given)"
        raise ExportError(
            f"{where}: the tokenizer's vocabulary (tokenizer.spe_tokenizer_vocab or "
            f"tokenizer.vocab_path: {named!r}) {found}; import with --nemo FILE.nemo, the "
            ".nemo that holds the tokenizer"
        )
    if listed and [str(t) for t in listed] != pieces:
        raise ExportError(
            f"{where}: decoder.vocabulary ({len(listed)} tokens) differs from the tokenizer's "
            f"vocabulary ({len(pieces)} pieces); the tokenizer files belong to another model"
        )
    return pieces


def _features(config: dict[str, Any], where: str) -> tuple[NemoFeatureConfig, int, float]:
    pre = config.get("preprocessor") or {}
    target = str(pre.get("_target_", ""))
    if not target.endswith("AudioToMelSpectrogramPreprocessor"):
        raise ExportError(
            f"{where}: preprocessor {target or '(none)'} is not AudioToMelSpectrogramPreprocessor, "
            "the one echoic computes"
        )
    rate = int(pre.get("sample_rate", config.get("sample_rate", 16000)))
    window = pre.get("n_window_size") or int(pre.get("window_size", 0.02) * rate)
    hop = pre.get("n_window_stride") or int(pre.get("window_stride", 0.01) * rate)
    unsupported = {
        "exact_pad": pre.get("exact_pad", False),
        "frame_splicing": pre.get("frame_splicing", 1) != 1,
        "stft_exact_pad": pre.get("stft_exact_pad", False),
    }
    bad = [k for k, v in unsupported.items() if v]
    normalize = pre.get("normalize", "per_feature")
    if bad or normalize not in ("per_feature", "all_features", "NA", "none", None, False):
        raise ExportError(
            f"{where}: preprocessor settings echoic does not compute: "
            f"{', '.join(bad) or f'normalize {normalize!r}'}"
        )
    guard = pre.get("log_zero_guard_value", 2.0**-24)
    guard = {"tiny": float(np.finfo(np.float32).tiny), "eps": float(np.finfo(np.float32).eps)}.get(
        guard, guard
    )
    mel_norm = pre.get("mel_norm", "slaney")
    try:
        cfg = NemoFeatureConfig(
            sample_rate=rate,
            window_samples=int(window),
            hop_samples=int(hop),
            n_fft=int(pre.get("n_fft") or 2 ** math.ceil(math.log2(window))),
            window=pre.get("window", "hann"),
            preemph=float(pre.get("preemph", 0.97) or 0.0),
            mel_bins=int(pre.get("features", 64)),
            low_hz=float(pre.get("lowfreq", 0) or 0),
            high_hz=float(pre.get("highfreq") or 0),
            mel_norm="slaney" if mel_norm == "slaney" else "none",
            mag_power=float(pre.get("mag_power", 2.0)),
            log=bool(pre.get("log", True)),
            log_guard=pre.get("log_zero_guard_type", "add"),
            log_guard_value=float(guard),
            normalize=normalize if normalize in ("per_feature", "all_features") else "none",
        )
    except (TypeError, ValueError) as e:
        raise ExportError(f"{where}: preprocessor: {e}") from e
    if cfg.window not in ("hann", "hamming", "blackman", "bartlett"):
        raise ExportError(f"{where}: preprocessor window {cfg.window!r} is not supported")
    pad_to = pre.get("pad_to", 16)
    if not isinstance(pad_to, int) or pad_to < 0:
        raise ExportError(f"{where}: preprocessor pad_to {pad_to!r}: echoic takes a whole number")
    return cfg, pad_to, float(pre.get("pad_value", 0.0))


def _time_stride(config: dict[str, Any], where: str) -> tuple[int, str]:
    """The encoder's time reduction, and how its export batches: a Conformer masks each
    row's padding ("masked"); NeMo exports a ConvASR encoder (QuartzNet, Citrinet) with
    its masked convolutions turned off, so padding reaches a row's last frames (and a
    squeeze-excitation's average, every frame): each utterance runs alone ("alone")."""
    encoder = config.get("encoder") or {}
    target = str(encoder.get("_target_", ""))
    if target.endswith("ConformerEncoder"):
        kind = encoder.get("subsampling", "striding")
        if kind not in ("striding", "dw_striding"):
            raise ExportError(f"{where}: Conformer subsampling {kind!r} is not supported")
        return int(encoder.get("subsampling_factor", 4)), "masked"
    if target.endswith("ConvASREncoder"):  # QuartzNet, Citrinet: each block's stride
        stride = 1
        for block in encoder.get("jasper") or []:
            stride *= int((block.get("stride") or [1])[0])
        return stride, "alone"
    raise ExportError(
        f"{where}: encoder {target or '(none)'} is not one echoic imports "
        f"({', '.join(ENCODERS)}: Conformer-CTC, Citrinet, QuartzNet)"
    )


def _padding_reach(config: dict[str, Any], time_stride: int) -> int:
    """Output frames at an utterance's end that NeMo's ConvASR export (its masked
    convolutions off) computes from padding where NeMo's torch model masks it: every
    convolution after the first (whose input padding is zero in both) reaches
    (kernel // 2) * dilation frames further, at its block's resolution."""
    encoder = config.get("encoder") or {}
    if not str(encoder.get("_target_", "")).endswith("ConvASREncoder"):
        return 0
    reach, stride, first = 0.0, 1, True
    for block in encoder.get("jasper") or []:
        k = int((block.get("kernel") or [1])[0])
        d = int((block.get("dilation") or [1])[0])
        for _ in range(int(block.get("repeat", 1))):
            if not first:
                reach += (k // 2) * d * stride / time_stride
            first = False
        stride *= int((block.get("stride") or [1])[0])
    return math.ceil(reach)


def read_source(config_path: Path | None = None, nemo_path: Path | None = None) -> NemoSource:
    """Read and check a NeMo model's config (from `config_path`, else from the .nemo)
    and its vocabulary (the tokenizer's files from the .nemo)."""
    files = read_nemo_tar(nemo_path) if nemo_path is not None else {}
    if config_path is not None:
        if not config_path.is_file():
            raise ExportError(f"{config_path}: no such file (a NeMo model_config.yaml)")
        where = str(config_path)
        config = _yaml(config_path.read_bytes(), where)
    elif nemo_path is not None:
        where = f"{nemo_path}:model_config.yaml"
        config = _yaml(files["model_config.yaml"], where)
    else:
        raise ExportError("a NeMo import needs the model's config: --config or --nemo")
    target = str(config.get("target", ""))
    model_class = target.rsplit(".", 1)[-1]
    decoder = str((config.get("decoder") or {}).get("_target_", ""))
    if "joint" in config or "RNNT" in target or "RNNT" in decoder:
        raise ExportError(
            f"{where}: {model_class or 'the model'} is a transducer (RNNT/TDT: a joint network "
            "and a prediction network), not a CTC model; echoic imports CTC models "
            f"({', '.join(SUPPORTED)})"
        )
    if not decoder.endswith("ConvASRDecoder"):
        raise ExportError(
            f"{where}: decoder {decoder or '(none)'} is not a CTC head (ConvASRDecoder); echoic "
            f"imports CTC models ({', '.join(SUPPORTED)})"
        )
    bpe = "tokenizer" in config or model_class.endswith("BPE")
    if model_class not in SUPPORTED:
        model_class = "EncDecCTCModelBPE" if bpe else "EncDecCTCModel"
    tokens = _tokens(config, files, str(nemo_path or where), bpe)
    specials = tuple(t for t in tokens if len(t) > 2 and t.startswith("<") and t.endswith(">"))
    features, pad_to, pad_value = _features(config, where)
    time_stride, batch_padding = _time_stride(config, where)
    reach = _padding_reach(config, time_stride)
    return NemoSource(
        config_file=where,
        config=config,
        model_class=model_class,
        tokens=tuple(tokens),
        special_tokens=specials,
        features=features,
        pad_to=pad_to,
        pad_value=pad_value,
        time_stride=time_stride,
        batch_padding=batch_padding,
        padding_reach=reach,
        nemo_file=nemo_path,
        files=files,
    )


def echoic_vocabulary(source: NemoSource) -> tuple[Vocabulary, list[int], list[int]]:
    """echoic's vocabulary, the NeMo id of each of its symbols after the blank, and the
    NeMo ids that make up the blank (NeMo's blank, the last id, and the special tokens)."""
    folded = [len(source.tokens), *(source.tokens.index(t) for t in source.special_tokens)]
    kept = [i for i in range(len(source.tokens)) if i not in folded]
    bpe = source.model_class == "EncDecCTCModelBPE"
    if bpe:
        symbols = [source.tokens[i] for i in kept]
    else:
        symbols = [t.lower() if len(t) == 1 else t for t in (source.tokens[i] for i in kept)]
    try:
        vocab = Vocabulary((BLANK, *symbols), "bpe" if bpe else "chars")
    except TextError as e:
        raise ExportError(
            f"{source.config_file}: its {'tokens' if bpe else 'labels'} do not map onto "
            f"echoic's vocabulary: {e}"
        ) from e
    return vocab, kept, folded


# ---------------------------------------------------------------- NeMo's ONNX


def nemo_export(nemo_path: Path, onnx_path: Path) -> str:
    """NeMo's own export of a .nemo to `onnx_path` (needs nemo_toolkit); its version."""
    try:
        import nemo
        from nemo.collections.asr.models import ASRModel
    except ImportError as e:
        raise ExportError(
            f"{nemo_path}: exporting a .nemo needs nemo_toolkit, which is not installed; "
            "export it where NeMo is (model.export('model.onnx')) and import that: "
            f"echoic import-model nemo model.onnx OUT --nemo {nemo_path}"
        ) from e
    model = ASRModel.restore_from(str(nemo_path), map_location="cpu").eval()
    model.export(str(onnx_path), check_trace=False, verbose=False)
    return str(nemo.__version__)


def check_nemo_graph(proto: Any, path: Path, source: NemoSource) -> None:
    """NeMo's CTC export signature, or an ExportError naming the file."""

    def dims(value: Any) -> list[int | str]:
        return [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]

    inputs = {v.name: v for v in proto.graph.input}
    init = {t.name for t in proto.graph.initializer}
    inputs = {k: v for k, v in inputs.items() if k not in init}
    outputs = {v.name: v for v in proto.graph.output}
    want = f"audio_signal (B, {source.features.mel_bins}, T), length (B,) -> logprobs"
    if not {"audio_signal"} <= set(inputs) <= set(NEMO_INPUTS) or NEMO_OUTPUT not in outputs:
        raise ExportError(
            f"{path}: inputs {sorted(inputs)} and outputs {sorted(outputs)} are not a NeMo CTC "
            f"export's ({want}); export the model with NeMo's model.export()"
        )
    signal, logprobs = dims(inputs["audio_signal"]), dims(outputs[NEMO_OUTPUT])
    if len(signal) != 3 or signal[1] != source.features.mel_bins:
        raise ExportError(
            f"{path}: audio_signal has shape {signal}; the config's preprocessor gives "
            f"{source.features.mel_bins} features per frame ({want})"
        )
    if len(logprobs) != 3 or logprobs[2] not in (len(source.tokens) + 1, ""):
        raise ExportError(
            f"{path}: logprobs has shape {logprobs}, but the config has {len(source.tokens)} "
            "tokens and the blank; the ONNX file and the config come from different models"
        )


def wrap_graph(nemo_onnx: bytes, source: NemoSource, kept: list[int], folded: list[int]) -> Any:
    """NeMo's graph inside echoic's offline signature (see the module docstring): an
    onnx ModelProto, its card not added yet."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    proto = onnx.load_from_string(nemo_onnx)
    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 17)
    consts = []

    def const(name: str, value: Any, dtype: Any = np.int64) -> str:
        consts.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), f"echoic/{name}"))
        return f"echoic/{name}"

    def node(op: str, ins: list[str], out: str, **attrs: Any) -> str:
        graph.node.append(helper.make_node(op, ins, [out], name=f"echoic/{out}", **attrs))
        return out

    # The signature's old inputs and output go; their names become internal tensors.
    length = next((v for v in graph.input if v.name == "length"), None)
    for v in [v for v in graph.input if v.name in NEMO_INPUTS]:
        graph.input.remove(v)
    del graph.output[:]
    nemo_nodes = list(graph.node)
    del graph.node[:]

    # Before NeMo's graph: (B, T, F) -> (B, F, T'), frames past a row's length = pad_value.
    frames = node("Shape", ["features"], "e_shape")
    frames = node("Gather", [frames, const("one", 1)], "e_frames", axis=0)  # T
    span = node("Range", [const("zero", 0), frames, const("one_step", 1)], "e_range")
    valid = node(
        "Less",
        [
            node("Unsqueeze", [span, const("axis0", [0])], "e_span"),
            node("Unsqueeze", ["lengths", const("axis1", [1])], "e_len_col"),
        ],
        "e_valid",
    )  # fmt: skip  (B, T)
    x = node("Transpose", ["features"], "e_x", perm=[0, 2, 1])  # (B, F, T)
    valid3 = node("Unsqueeze", [valid, const("axis1b", [1])], "e_valid3")  # (B, 1, T)
    pad_value = const("pad_value", source.pad_value, np.float32)
    x = node("Where", [valid3, x, pad_value], "e_x_masked")
    # NeMo's batch has max(T) + 1 frames (its STFT's last, masked), padded to pad_to.
    target = node("Add", [frames, const("one_more", 1)], "e_target")
    if source.pad_to > 0:
        p = const("pad_to", source.pad_to)
        up = node("Add", [target, const("pad_to_less_one", source.pad_to - 1)], "e_up")
        target = node("Mul", [node("Div", [up, p], "e_tiles"), p], "e_target_padded")
    extra = node("Sub", [target, frames], "e_extra")
    pads = node(
        "Concat",
        [const("pads_head", [0, 0, 0, 0, 0]), node("Unsqueeze", [extra, const("axis0b", [0])],
                                                   "e_extra1")],
        "e_pads",
        axis=0,
    )  # fmt: skip
    node("Pad", [x, pads, pad_value], "audio_signal", mode="constant")
    if length is not None:  # a graph that does not use it has none (ConvASR's export)
        node("Cast", ["lengths"], "length", to=length.type.tensor_type.elem_type)
    graph.node.extend(nemo_nodes)

    # After it: echoic's order, the blank (and special tokens) folded, first.
    kept_ids, folded_ids = const("kept", kept), const("folded", folded)
    others = node("Gather", [NEMO_OUTPUT, kept_ids], "e_kept", axis=2)
    blank_in = node("Gather", [NEMO_OUTPUT, folded_ids], "e_folded", axis=2)
    if opset >= 18:
        blank = node("ReduceLogSumExp", [blank_in, const("axis2", [2])], "e_blank", keepdims=1)
    else:
        blank = node("ReduceLogSumExp", [blank_in], "e_blank", axes=[2], keepdims=1)
    node("Concat", [blank, others], "log_probs", axis=2)
    s = source.time_stride
    up = node("Add", ["lengths", const("stride_less_one", s - 1)], "e_len_up")
    node("Div", [up, const("stride", s)], "out_lengths")

    graph.initializer.extend(consts)
    vocab = len(kept) + 1
    f = source.features.mel_bins
    graph.input.extend(
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, [BATCH, "frames", f]),
            helper.make_tensor_value_info("lengths", TensorProto.INT64, [BATCH]),
        ]
    )
    graph.output.extend(
        [
            helper.make_tensor_value_info(
                "log_probs", TensorProto.FLOAT, [BATCH, "out_frames", vocab]
            ),
            helper.make_tensor_value_info("out_lengths", TensorProto.INT64, [BATCH]),
        ]
    )
    return proto


# ---------------------------------------------------------------- the card and parity


def positional_frames(proto: Any, config: dict[str, Any]) -> int:
    """Encoder frames a Conformer export's positional table covers (0: not a Conformer,
    or no table found). NeMo exports the table (1, 2n - 1, d_model) of relative positions
    (n for absolute ones) as a constant: a longer input fails inside the graph."""
    encoder = config.get("encoder") or {}
    if not str(encoder.get("_target_", "")).endswith("ConformerEncoder"):
        return 0
    d_model = int(encoder.get("d_model", 0))
    relative = str(encoder.get("self_attention_model", "rel_pos")).startswith("rel_pos")
    tensors = [*proto.graph.initializer]
    tensors += [a.t for n in proto.graph.node if n.op_type == "Constant" for a in n.attribute
                if a.name == "value"]  # fmt: skip
    sizes = [
        int(t.dims[1]) for t in tensors
        if len(t.dims) == 3 and t.dims[0] == 1 and t.dims[2] == d_model
        and t.dims[1] > 1 and (t.dims[1] % 2 == 1 or not relative)
    ]  # fmt: skip
    if not sizes:
        return 0
    return (max(sizes) + 1) // 2 if relative else max(sizes)


def max_output_frames(positions: int, source: NemoSource) -> int:
    """The card's `max_frames` for a table of `positions` encoder frames: what the
    preprocessor's extra frame and its padding to `pad_to` leave of it (0: no limit)."""
    if not positions:
        return 0
    return positions - 1 - -(-max(source.pad_to, 1) // source.time_stride)


def build_card(
    source: NemoSource, vocab: Vocabulary, kept: list[int], *,
    name: str, version: str, parameters: int, opset: int, config_bytes: bytes,
    max_frames: int = 0,
) -> ModelCard:  # fmt: skip
    nf = source.features
    hop_ms = nf.hop_ms
    digest = hashlib.sha256(config_bytes).hexdigest()[:16]
    ids = {i: t for i, t in enumerate(source.tokens)}
    return ModelCard(
        format=CARD_FORMAT,
        name=name,
        version=version,
        vocabulary=vocab.symbols,
        blank_id=vocab.blank_id,
        # The nearest echoic feature config: rate, hop and sizes; the recipe is nemo_features.
        features=FeatureConfig(
            nf.sample_rate,
            window_ms=1000.0 * nf.window_samples / nf.sample_rate,
            hop_ms=hop_ms,
            n_fft=nf.n_fft,
            mel_bins=nf.mel_bins,
        ),
        sample_rate=nf.sample_rate,
        hop_ms=hop_ms,
        num_features=nf.mel_bins,
        time_stride=source.time_stride,
        output_frame_ms=hop_ms * source.time_stride,
        receptive_field=source.time_stride,  # full context: every frame sees the utterance
        feature_mean=(0.0,) * nf.mel_bins,
        **FULL_CONTEXT,
        parameters=parameters,
        config_hash=digest,
        model_config_hash=digest,
        training_step=0,
        opset=opset,
        input="features",
        batch_padding=source.batch_padding,
        token_type=vocab.token_type,
        feature_recipe="nemo",
        nemo_features=nf,
        source=f"nemo:{source.model_class}",
        source_tokens=("<blank>", *(ids[i] for i in kept)),
        max_frames=max_frames,
    )


def _nemo_batch(rows: list[np.ndarray], source: NemoSource) -> tuple[np.ndarray, np.ndarray]:
    """echoic's features of a batch laid out as NeMo's preprocessor lays them out:
    (B, F, T) with max(T) + 1 frames padded to pad_to, pad_value past each length."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    frames = int(lengths.max()) + 1
    if source.pad_to:
        frames = -(-frames // source.pad_to) * source.pad_to
    batch = np.full((len(rows), source.features.mel_bins, frames), source.pad_value, np.float32)
    for b, r in zip(batch, rows, strict=True):
        b[:, : len(r)] = r.T
    return batch, lengths


def _parity_audio(lengths: tuple[int, ...], rate: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for n in lengths:
        t = np.arange(n) / rate
        tone = np.sin(2 * np.pi * (150 + 60 * np.sin(3 * t)) * t)
        out.append((0.3 * tone + 0.05 * rng.standard_normal(n)).astype(np.float32))
    return out


def check_parity(
    model_dir: Path, nemo_onnx: Path, source: NemoSource, kept: list[int], folded: list[int],
    nemo_model: Any = None,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """echoic's engine (model.onnx on echoic's features) against NeMo: per batch the
    lengths and the largest |log-prob difference| over real frames, against NeMo's ONNX
    on the same features laid out as NeMo lays them out ("onnx"), and, given NeMo's torch
    model, against its preprocessor and forward on the same audio ("nemo"; all frames but
    each utterance's last `padding_reach`, which NeMo's own export computes otherwise)."""
    from echoic.model.runtime.card import open_session
    from echoic.model.runtime.engine import Engine

    engine = Engine(model_dir)
    session = open_session(nemo_onnx)
    takes_length = any(i.name == "length" for i in session.get_inputs())

    def nemo_onnx_rows(rows: list[np.ndarray]) -> list[np.ndarray]:
        if source.batch_padding == "alone" and len(rows) > 1:
            return [out for r in rows for out in nemo_onnx_rows([r])]
        batch, frame_lengths = _nemo_batch(rows, source)
        feed = {"audio_signal": batch} | ({"length": frame_lengths} if takes_length else {})
        return list(session.run([NEMO_OUTPUT], feed)[0])

    report: dict[str, list[dict[str, Any]]] = {"onnx": []}
    if nemo_model is not None:
        report["nemo"] = []
    for lengths in PARITY_BATCHES:
        audios = _parity_audio(lengths, source.features.sample_rate)
        rows = [nemo_features(a, source.features) for a in audios]
        got = engine.offline(rows)
        wants = {"onnx": nemo_onnx_rows(rows)}
        if nemo_model is not None:
            wants["nemo"] = _nemo_torch(nemo_model, audios)
        for key, w_rows in wants.items():
            diffs = []
            for g, w in zip(got, w_rows, strict=True):
                if key == "nemo" and source.padding_reach:
                    g = g[: max(len(g) - source.padding_reach, 0)]
                w = w[: len(g)]
                w = np.concatenate(
                    [np.logaddexp.reduce(w[:, folded], axis=1, keepdims=True), w[:, kept]], axis=1
                )
                ok = w.shape == g.shape and np.isfinite(g).all()
                diffs.append(
                    float(np.abs(w - g).max()) if ok and len(g) else 0.0 if ok else math.inf
                )
            report[key].append({"lengths": list(lengths), "max_abs_diff": max(diffs)})
    return report


def _nemo_torch(model: Any, audios: list[np.ndarray]) -> list[np.ndarray]:
    """NeMo's own log-probs of a batch of audio, each row trimmed to its frames."""
    import torch

    lengths = torch.tensor([len(a) for a in audios])
    batch = torch.zeros(len(audios), int(lengths.max()))
    for row, a in zip(batch, audios, strict=True):
        row[: len(a)] = torch.from_numpy(a)
    with torch.no_grad():
        log_probs, out_lengths, _ = model.forward(input_signal=batch, input_signal_length=lengths)
    return [lp[: int(n)].numpy() for lp, n in zip(log_probs, out_lengths, strict=True)]


# ---------------------------------------------------------------- the import


def import_nemo(
    src: str | Path,
    out_dir: str | Path,
    *,
    config: str | Path | None = None,
    nemo: str | Path | None = None,
    name: str | None = None,
    version: str | None = None,
    tolerance: float = PARITY_TOLERANCE,
) -> Path:
    """Import the NeMo model `src` (a .nemo, or NeMo's ONNX export with `config` or `nemo`
    giving its config and tokenizer) as the model directory `out_dir` (which must not
    exist, or be empty). Raises ExportError, writing nothing, when echoic's model.onnx
    on echoic's features does not give NeMo's log-probs within `tolerance`."""
    src, out_dir = Path(src), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} already exists; import each version to a new directory")
    if not src.is_file():
        raise ExportError(f"{src}: no such file (a .nemo, or NeMo's ONNX export)")
    onnx_given = src.suffix.lower() == ".onnx"
    nemo_path = Path(nemo) if nemo is not None else (None if onnx_given else src)
    if onnx_given and config is None and nemo_path is None:
        raise ExportError(
            f"{src}: NeMo's ONNX holds no config or vocabulary; give the model's "
            "--config model_config.yaml (and for a BPE model --nemo file.nemo for its tokenizer)"
        )
    source = read_source(Path(config) if config is not None else None, nemo_path)
    vocab, kept, folded = echoic_vocabulary(source)
    name = name or (nemo_path or src).stem
    version = version or _default_version(out_dir)
    try:
        check_name("name", name)
        check_name("version", version)
    except ValueError as e:
        raise ExportError(str(e)) from e

    import onnx

    nemo_version, nemo_model = None, None
    with tempfile.TemporaryDirectory() as tmp:
        nemo_onnx = Path(tmp) / "nemo.onnx"
        if onnx_given:
            nemo_onnx.write_bytes(src.read_bytes())
        else:
            nemo_version = nemo_export(src, nemo_onnx)
            from nemo.collections.asr.models import ASRModel

            nemo_model = ASRModel.restore_from(str(src), map_location="cpu").eval()
        try:
            proto = onnx.load_from_string(nemo_onnx.read_bytes())
        except Exception as e:  # noqa: BLE001 - onnx raises several unrelated types
            raise ExportError(f"{src}: not an ONNX model ({str(e).splitlines()[0]})") from e
        check_nemo_graph(proto, src, source)
        parameters = sum(int(np.prod(t.dims)) for t in proto.graph.initializer)
        opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
        card = build_card(
            source, vocab, kept, name=name, version=version, parameters=parameters,
            opset=opset,
            config_bytes=json.dumps(source.config, sort_keys=True, default=str).encode(),
            max_frames=max_output_frames(positional_frames(proto, source.config), source),
        )  # fmt: skip
        wrapped = wrap_graph(nemo_onnx.read_bytes(), source, kept, folded)
        shapes: Shapes = {
            "features": [BATCH, "frames", card.num_features],
            "lengths": [BATCH],
            "log_probs": [BATCH, "out_frames", len(card.vocabulary)],
            "out_lengths": [BATCH],
        }
        from echoic.model.nn.export import _finish_graph

        with staged_directory(out_dir) as stage:
            model_bytes = _finish_graph(wrapped.SerializeToString(), card, "offline", shapes)
            write_durably(stage / OFFLINE_FILE, model_bytes)
            parity = check_parity(stage, nemo_onnx, source, kept, folded, nemo_model)
            bad = [
                (k, p) for k, cases in parity.items() for p in cases
                if not p["max_abs_diff"] <= tolerance
            ]  # fmt: skip
            if bad:
                raise ExportError(
                    f"echoic's model.onnx does not reproduce NeMo (tolerance {tolerance:g}): "
                    + "; ".join(
                        f"{k} lengths {p['lengths']}: {p['max_abs_diff']:.3g}" for k, p in bad
                    )
                )
            report = {
                "model_card": json.loads(card.to_json()),
                "parity": {"tolerance": tolerance, **parity},
                "source": {
                    "path": str(src.resolve()),
                    "config": source.config_file,
                    "nemo_toolkit": nemo_version or source.config.get("nemo_version"),
                    "exported_here": not onnx_given,
                    "folded_into_blank": list(source.special_tokens),
                    "pad_to": source.pad_to,
                    "pad_value": source.pad_value,
                    "padding_reach": source.padding_reach,
                },
            }
            text = json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            write_durably(stage / REPORT_FILE, text.encode())
    return out_dir


__all__ = ["SUPPORTED", "NemoSource", "import_nemo", "read_source"]
