"""Weights stored as float16 in an export, computed in float32: half the file, the same
arithmetic.

`echoic export --weights float16` first rounds the network's large weights (`MIN_ELEMENTS`
values and more: the recurrent layers' matrices and the output layer's) to the nearest
float16, then exports and checks the graphs as always (ONNX Runtime against torch,
streaming against offline), and last stores each large float32 initializer that float16
holds exactly as a float16 initializer behind a `Cast` to float32. ONNX Runtime folds
those casts when it loads the graph, so the session runs the float32 arithmetic of the
rounded network, as fast as before. Small tensors (biases, norms, the feature
statistics), the convolutions (the export folds their batch norms into them, which
float16 would no longer hold exactly: they are left unrounded) and constants float16
cannot hold (the mel filterbank) stay float32.

What the rounding costs is measured, not assumed: the export report's `weights` entry
gives the largest change of any log-probability it made on the parity inputs.
`expand_half` gives the float32 graph back (int8 quantization starts from it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

WEIGHT_DTYPES = ("float32", "float16")
MIN_ELEMENTS = 1024  # smaller tensors stay float32: they are a few kB in all
SUFFIX = "/float16"  # a stored initializer's name: the float32 tensor's name + SUFFIX


def round_weights(model: nn.Module) -> int:
    """Round every floating parameter of `MIN_ELEMENTS` values or more, convolutions'
    aside, to the nearest float16, in place; returns how many values were rounded."""
    rounded = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.conv._ConvNd):
                continue  # folded with its batch norm at export: not stored as float16
            for param in module.parameters(recurse=False):
                if param.is_floating_point() and param.numel() >= MIN_ELEMENTS:
                    param.copy_(param.to(torch.float16).to(param.dtype))
                    rounded += param.numel()
    return rounded


def round_initializers(proto: Any) -> None:
    """`round_weights` for an exported graph: round each float32 initializer of
    `MIN_ELEMENTS` values or more to the nearest float16, in place (for graphs whose
    torch network is gone, such as exported taggers combined into an ensemble)."""
    from onnx import TensorProto, numpy_helper

    for tensor in proto.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT and int(np.prod(tensor.dims)) >= MIN_ELEMENTS:
            values = numpy_helper.to_array(tensor).astype(np.float16).astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))


def store_half(onnx_bytes: bytes) -> tuple[bytes, dict[str, int]]:
    """The graph with each large float32 initializer that float16 holds exactly stored as
    float16 behind a Cast (the same values at run time); returns it and how many tensors
    and values were stored so."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    proto = onnx.load_from_string(onnx_bytes)
    graph_inputs = {value.name for value in proto.graph.input}
    casts, values_stored = [], 0
    for tensor in proto.graph.initializer:
        if tensor.data_type != TensorProto.FLOAT or tensor.name in graph_inputs:
            continue
        if int(np.prod(tensor.dims)) < MIN_ELEMENTS:
            continue
        values = numpy_helper.to_array(tensor)
        half = values.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), values):
            continue  # not a rounded weight: float16 would change it
        name, values_stored = tensor.name, values_stored + half.size
        tensor.CopyFrom(numpy_helper.from_array(half, name + SUFFIX))
        casts.append(
            helper.make_node(
                "Cast", [name + SUFFIX], [name], name=name + SUFFIX, to=TensorProto.FLOAT
            )
        )
    # the casts first: nodes stay in topological order
    graph = _with_nodes(proto, [*casts, *proto.graph.node])
    return graph, {"tensors": len(casts), "values": values_stored}


def _stored(proto: Any) -> list[tuple[Any, Any]]:
    """(Cast node, float16 initializer) of each weight stored as float16."""
    from onnx import TensorProto

    halves = {t.name: t for t in proto.graph.initializer if t.data_type == TensorProto.FLOAT16}
    return [(node, halves[node.input[0]]) for node in proto.graph.node
            if node.op_type == "Cast" and node.input and node.input[0] in halves]  # fmt: skip


def half_weights(proto: Any) -> int:
    """How many of a graph's initializers are stored as float16 behind a Cast."""
    return len(_stored(proto))


def unfold(weights: dict[str, np.ndarray], proto: Any) -> None:
    """Add to `weights` (an initializer's name -> its values) the float32 tensors that the
    Casts of stored float16 initializers give, under the names the graph reads them by."""
    from onnx import numpy_helper

    for cast, tensor in _stored(proto):
        weights[cast.output[0]] = numpy_helper.to_array(tensor).astype(np.float32)


def expand_half(onnx_bytes: bytes) -> bytes:
    """The graph with each float16-stored initializer made float32 again under the name
    its Cast gave it, and the Cast gone: the graph `store_half` was given, value for value."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load_from_string(onnx_bytes)
    stored = _stored(proto)
    for cast, tensor in stored:
        values = numpy_helper.to_array(tensor).astype(np.float32)
        tensor.CopyFrom(numpy_helper.from_array(values, cast.output[0]))
    casts = {id(cast) for cast, _ in stored}
    return _with_nodes(proto, [n for n in proto.graph.node if id(n) not in casts])


def _with_nodes(proto: Any, nodes: list[Any]) -> bytes:
    """`proto` with `nodes` as its graph's nodes, checked and serialised."""
    import onnx

    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    onnx.checker.check_model(proto)
    return proto.SerializeToString()
