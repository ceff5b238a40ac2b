"""A trainable network from an exported model directory, so that an export can be fine-tuned.

An export keeps every weight, in the form ONNX Runtime runs: each convolution's
batch norm folded into its weights and a bias, each sequence norm reduced to a
scale and a shift, each GRU's gates in ONNX order (z, r, h instead of torch's
r, z, n). `rebuild` reads them back by the name of the module each graph node
came from (`/rnns.1/bwd/GRU`, `/head_norm/Mul`, ...) into a `DeepSpeech2` whose
eval-mode function is the export's, and proves it: the same parity check that
export runs (torch against ONNX Runtime, offline and streaming) must pass.

What an export cannot give back is each norm's split into statistics and affine
parameters, which only matters in training mode (batch statistics): the rebuilt
norms are the identity with the scale and shift as affine parameters. Before
training, `recalibrate_norms` measures the statistics the norms will see on the
new data and re-expresses each norm with them, keeping the eval-mode function
unchanged, so that the first training steps start from the model as exported.

Bidirectional GRU models (the bundled model's kind) are supported; others are
fine-tuned from their training checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from echoic.model.core.configs import config_hash
from echoic.model.nn.half import unfold
from echoic.model.nn.network import DeepSpeech2, ModelConfig, SequenceBatchNorm
from echoic.model.runtime.card import OFFLINE_FILE, card_from_metadata
from echoic.model.runtime.repository import default_model_dir as bundled_model_dir

__all__ = ["RebuildError", "bundled_model_dir", "is_export", "rebuild", "recalibrate_norms"]


class RebuildError(ValueError):
    """An exported model whose torch network cannot be rebuilt (or not exactly)."""


def is_export(path: str | Path) -> bool:
    """Whether `path` is an export (`model.onnx` or a directory holding one)."""
    path = Path(path)
    return path.name == OFFLINE_FILE or (path.is_dir() and (path / OFFLINE_FILE).is_file())


def rebuild(path: str | Path) -> tuple[DeepSpeech2, dict[str, Any]]:
    """The network of an export (its directory or its `model.onnx`), in eval mode, and a
    checkpoint-like dict (`model_config`, `step`, `config_hash`, `source`, `parity`).

    Raises RebuildError when the graph is not one this can read, or when the rebuilt
    network does not reproduce the graphs within export's parity tolerance.
    """
    import onnx
    from onnx import numpy_helper

    from echoic.model.nn.export import check_parity

    path = Path(path)
    model_dir = path.parent if path.name == OFFLINE_FILE else path
    graph_path = model_dir / OFFLINE_FILE
    if not graph_path.is_file():
        raise FileNotFoundError(f"no exported model at {model_dir} (no {OFFLINE_FILE})")
    try:
        proto = onnx.load(str(graph_path))
    except Exception as e:  # noqa: BLE001 - any protobuf failure means a bad file
        raise RebuildError(f"{graph_path} is not a readable ONNX model: {e}") from e
    card = card_from_metadata({p.key: p.value for p in proto.metadata_props}, graph_path)
    if card.rnn_type != "gru" or not card.bidirectional:
        raise RebuildError(
            f"{model_dir}: rebuilding a network from an export supports bidirectional GRU"
            f" models; this one is {'bi' if card.bidirectional else 'uni'}directional"
            f" {card.rnn_type}: fine-tune from its training checkpoint instead"
        )
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    for node in proto.graph.node:  # small constants the exporter left as Constant nodes
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            weights[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    unfold(weights, proto)  # weights stored as float16 (export --weights float16)
    nodes = {node.name: node for node in proto.graph.node}
    graph = _Graph(model_dir, nodes, weights)

    cfg = _model_config(graph, card)
    model = DeepSpeech2(cfg)
    model.load_state_dict(_state_dict(graph, cfg, model.state_dict()))
    model.eval()
    try:
        parity = check_parity(model, model_dir)
    except ModuleNotFoundError as e:
        raise RebuildError(
            f"rebuilding a network from an export checks it against ONNX Runtime, which is not"
            f" installed ({e.name}): pip install 'echoic[serve]'"
        ) from e
    failures = parity.failures()
    if failures:
        raise RebuildError(
            f"{model_dir}: the network rebuilt from the export does not reproduce it"
            f" (tolerance {parity.tolerance:g}): " + "; ".join(failures)
        )
    worst = max(
        [c["max_abs_diff"] for c in parity.offline]
        + ([parity.stream["max_abs_diff"]] if parity.stream else [])
    )
    info = {
        "model_config": cfg,
        # False only if a training-only setting (dropout) differed from the default
        "model_config_matches": config_hash(cfg) == card.model_config_hash,
        "step": card.training_step,
        "config_hash": card.config_hash,
        "source": str(model_dir),
        "parity_max_abs_diff": worst,
    }
    return model, info


class _Graph:
    """The exported offline graph's nodes by module path, and its constant tensors."""

    def __init__(self, model_dir: Path, nodes: dict[str, Any], weights: dict[str, np.ndarray]):
        self.model_dir, self.nodes, self.weights = model_dir, nodes, weights

    def node(self, name: str) -> Any:
        if name not in self.nodes:
            raise RebuildError(
                f"{self.model_dir}: its graph has no node {name!r}; it was not exported by"
                " this version of echoic's exporter (re-export it from its checkpoint)"
            )
        return self.nodes[name]

    def input(self, name: str, index: int) -> np.ndarray:
        """The constant tensor at input `index` of node `name`."""
        node = self.node(name)
        if index >= len(node.input) or node.input[index] not in self.weights:
            raise RebuildError(f"{self.model_dir}: input {index} of {name!r} is not a constant")
        return self.weights[node.input[index]]

    def attribute(self, name: str, key: str) -> Any:
        from onnx import helper

        for a in self.node(name).attribute:
            if a.name == key:
                return helper.get_attribute_value(a)
        raise RebuildError(f"{self.model_dir}: node {name!r} has no attribute {key!r}")


def _conv_names(layers: int) -> list[tuple[str, str]]:
    """(Conv node, Clip node) of each conv layer: Sequential(conv, norm, clip) per layer."""
    return [(f"/conv/conv.{3 * i}/Conv", f"/conv/conv.{3 * i + 2}/Clip") for i in range(layers)]


def _model_config(graph: _Graph, card: Any) -> ModelConfig:
    channels, k_freq, k_time, s_freq, s_time = [], [], [], [], []
    clip = None
    layers = sum(1 for n in graph.nodes if n.startswith("/conv/conv.") and n.endswith("/Conv"))
    for conv, relu in _conv_names(layers):
        cout, _, kf, kt = graph.input(conv, 1).shape
        sf, st = graph.attribute(conv, "strides")
        if list(graph.attribute(conv, "pads")) != [kf // 2, 0, kf // 2, 0]:
            raise RebuildError(f"{graph.model_dir}: unexpected padding in {conv!r}")
        channels.append(int(cout))
        k_freq.append(int(kf))
        k_time.append(int(kt))
        s_freq.append(int(sf))
        s_time.append(int(st))
        clip = float(graph.input(relu, 2))
    return ModelConfig(
        name=card.name,
        features=card.features,
        vocabulary=tuple(card.vocabulary),
        conv_channels=tuple(channels),
        conv_kernel_freq=tuple(k_freq),
        conv_kernel_time=tuple(k_time),
        conv_stride_freq=tuple(s_freq),
        conv_stride_time=tuple(s_time),
        rnn_type="gru",
        rnn_layers=card.rnn_layers,
        rnn_hidden=card.rnn_hidden,
        bidirectional=True,
        chunk_frames=card.chunk_frames,
        context_frames=card.context_frames,
        relu_clip=ModelConfig.relu_clip if clip is None else clip,
    )


def _gru_to_torch(w: np.ndarray, hidden: int) -> np.ndarray:
    """ONNX's gate order (z, r, h) along the first axis, as torch's (r, z, n)."""
    z, r, h = w[:hidden], w[hidden : 2 * hidden], w[2 * hidden :]
    return np.concatenate([r, z, h])


def _state_dict(graph: _Graph, cfg: ModelConfig, shapes: dict[str, Tensor]) -> dict[str, Tensor]:
    """The network's parameters and buffers from the graph's constants."""
    one = math.sqrt(1.0 + SequenceBatchNorm(1).eps)  # identity norm: var 1, weight sqrt(1+eps)
    out: dict[str, Any] = {
        "feature_mean": graph.weights.get("feature_mean"),
        "feature_std": graph.weights.get("feature_std"),
    }
    for i, (conv, _) in enumerate(_conv_names(len(cfg.conv_channels))):
        w, b = graph.input(conv, 1), graph.input(conv, 2)
        norm = f"conv.{3 * i + 1}"
        out[f"conv.{3 * i}.weight"] = w
        out.update({
            f"{norm}.weight": np.full_like(b, one),
            f"{norm}.bias": b,
            f"{norm}.running_mean": np.zeros_like(b),
            f"{norm}.running_var": np.ones_like(b),
            f"{norm}.num_batches_tracked": np.array(0, dtype=np.int64),
        })  # fmt: skip
    norms = [(f"rnns.{i}.norm", f"/rnns.{i}/norm") for i in range(cfg.rnn_layers)]
    for prefix, scope in [*norms, ("head_norm", "/head_norm")]:
        scale, shift = graph.input(f"{scope}/Mul", 1), graph.input(f"{scope}/Add", 1)
        out.update({
            f"{prefix}.weight": scale * np.float32(one),
            f"{prefix}.bias": shift,
            f"{prefix}.running_mean": np.zeros_like(scale),
            f"{prefix}.running_var": np.ones_like(scale),
        })  # fmt: skip
    h = cfg.rnn_hidden
    for i in range(cfg.rnn_layers):
        for direction in ("fwd", "bwd"):
            gru = f"/rnns.{i}/{direction}/GRU"
            if graph.attribute(gru, "linear_before_reset") != 1:
                raise RebuildError(f"{graph.model_dir}: {gru!r} is not torch's GRU")
            w, r, b = (graph.input(gru, k)[0] for k in (1, 2, 3))
            prefix = f"rnns.{i}.{direction}"
            out[f"{prefix}.weight_ih_l0"] = _gru_to_torch(w, h)
            out[f"{prefix}.weight_hh_l0"] = _gru_to_torch(r, h)
            out[f"{prefix}.bias_ih_l0"] = _gru_to_torch(b[: 3 * h], h)
            out[f"{prefix}.bias_hh_l0"] = _gru_to_torch(b[3 * h :], h)
    out["head.weight"] = graph.input("/head/MatMul", 1).T
    out["head.bias"] = graph.input("/head/Add", 0)
    state = {}
    for key, like in shapes.items():
        value = out.get(key)
        if value is None or tuple(np.shape(value)) != tuple(like.shape):
            got = "nothing" if value is None else f"shape {tuple(np.shape(value))}"
            raise RebuildError(
                f"{graph.model_dir}: {key} of shape {tuple(like.shape)} not found in the"
                f" graph (found {got})"
            )
        state[key] = torch.tensor(np.array(value), dtype=like.dtype)
    return state


# ---------------------------------------------------------------- training-mode norms


def recalibrate_norms(model: DeepSpeech2, batches: Iterable[tuple[Tensor, Tensor]]) -> int:
    """Give every norm the statistics its input has on `batches` (features, lengths),
    with its eval-mode function unchanged: each norm computes x * s + t in eval mode,
    and afterwards has running mean m and variance v measured here, weight s*sqrt(v+eps)
    and bias t + m*s. In training mode (batch statistics) the network then computes
    nearly what it does in eval mode on data like `batches`. Returns the output frames seen.
    """
    sums: dict[nn.Module, list[Tensor]] = {}

    def record(module: nn.Module, args: tuple) -> None:
        x = args[0].detach().double()
        if isinstance(module, SequenceBatchNorm):
            values = x[args[1]]  # valid positions, (N, D): what training-mode statistics use
        else:  # BatchNorm2d (B, C, F, T): every position, per channel
            values = x.transpose(0, 1).reshape(x.shape[1], -1).T
        acc = sums.setdefault(module, [torch.zeros(()), 0, 0])
        acc[0] = acc[0] + values.shape[0]
        acc[1] = acc[1] + values.sum(0)
        acc[2] = acc[2] + (values**2).sum(0)

    norms = [m for m in model.modules() if isinstance(m, (SequenceBatchNorm, nn.BatchNorm2d))]
    hooks = [m.register_forward_pre_hook(record) for m in norms]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for features, lengths in batches:
                model(features, lengths)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    frames = 0
    with torch.no_grad():
        for norm in norms:
            if norm not in sums:
                continue
            count, total, total_sq = sums[norm]
            if isinstance(norm, SequenceBatchNorm):
                frames = int(count)  # output frames (every sequence norm sees all of them)
            mean = total / count
            var = (total_sq / count - mean**2).clamp_min(0.0)
            scale = norm.weight.double() / torch.sqrt(norm.running_var.double() + norm.eps)
            shift = norm.bias.double() - norm.running_mean.double() * scale
            norm.running_mean.copy_(mean)
            norm.running_var.copy_(var)
            norm.weight.copy_(scale * torch.sqrt(var + norm.eps))
            norm.bias.copy_(shift + mean * scale)
    return frames
