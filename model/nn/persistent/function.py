"""The autograd function behind `--rnn-impl persistent|auto`, and the choice of kernels.

A call runs one or two recurrences ("problems", e.g. the forward direction over
whole utterances and the backward direction over latency-controlled windows)
with the parameters of nn.RNN / nn.GRU / ClippedReLURNN modules, so modules,
parameter names and checkpoints are the same whichever implementation runs:

    forward   gi = x W_ih^T + b  (one GEMM over all steps)
              states = recurrence(gi, h0, W_hh)          (one persistent launch)
    backward  dgi, dgh, dh0 = recurrence backward          (one persistent launch)
              dx = dgi W_ih, dW_ih = dgi^T x, dW_hh = dgh^T h_prev  (GEMMs)

The recurrence runs on a backend: "triton" (persistent kernels), "triton-steps"
(the same kernels launched once per step: no grid barrier) or "reference" (torch
step loops, any device; the CPU path and the specification the kernels are
tested against).

Fallbacks: a layer that the kernels cannot run goes to the modules (cuDNN). With
`persistent`: an input that is not on a CUDA GPU (silently: the CPU path), or kernels
that do not fit this GPU (a RuntimeWarning, once); with `persistent` or `auto`: a
launch that fails (a RuntimeWarning; the shape stays on cuDNN). A persistent backward
launch that fails finishes one launch per step (a RuntimeWarning), and the shape stays
on cuDNN from the next step on, as after a failed forward launch. With
ECHOIC_PERSISTENT_STRICT=1 each of these raises PersistentKernelError instead, so that
`persistent` means the kernels or an error; the GPU tests run so, since a fallback's
result is cuDNN's own and would pass them. What `auto` leaves to cuDNN by its policy
(not sm_90, too many rows, does not fit) is no fallback; neither are LSTM layers and
TorchScript, which always run the modules.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from echoic.model.nn.persistent import capacity, reference
from echoic.model.nn.persistent.capacity import KernelConfig, PersistentKernelError
from echoic.model.nn.persistent.reference import GATES, Cell, Direction

Backend = Literal["reference", "triton", "triton-steps"]
Impl = Literal["auto", "cudnn", "persistent"]

# `auto` runs the persistent kernels on Hopper (sm_90) for layers whose largest
# direction has at most `auto_max_rows` rows (batch rows, or windows for the backward
# direction of a latency-controlled layer). Persistent RNNs win where the batch is small
# and the recurrent matrix is re-read every step (Diamos et al. 2016). The limits come
# from bench/persistent_rnn.py on an H200 (2026-11-27, T 200, fwd+bwd against cuDNN,
# H 512-2048; docs/gpu-runs/2026-11-27-h200): rows (matrix-vector) win up to 4 rows
# (1.30-3.70x in bf16, 1.85-2.51x in float32) and lose from 16 but for some plain RNNs
# (0.20-0.79x, float32 0.65x); tiles (16-bit weights) win up to 16 rows in both
# directions of a GRU or RNN and in one of a GRU (1.16-2.91x), and lose at 64 but in
# small bidirectional RNNs (0.40-0.96x). One direction of a plain RNN is where cuDNN
# runs its own persistent algorithm from 8 rows (fp16: 0.24-0.42x; bf16 at 16 rows:
# 0.45x): there `auto` stops at 4 rows. Float32 between 4 and 16 rows was not measured.
AUTO_ROWS, AUTO_TILES = 4, 16


def auto_max_rows(cell: Cell, directions: int, tiles: bool) -> int:
    """The most rows for which `auto` runs the kernels: `tiles` when the dtype has
    tensor-core tiles (16-bit weights)."""
    if not tiles or (cell == "rnn" and directions == 1):
        return AUTO_ROWS
    return AUTO_TILES


# A single row runs faster as rows (2.03-3.70x) than as a tile (1.51-3.18x); from 4
# rows a tile is as fast or faster in most shapes (1.34-3.19x against 1.30-3.01x):
# `plan` tries tiles first from this many rows up to capacity.TILES_FIRST_ROWS.
TILES_FIRST_MIN_ROWS = 2


@dataclass(frozen=True)
class Problem:
    """One recurrence: a module's parameters over inputs x (N, T, D)."""

    rnn: nn.Module  # nn.RNN / nn.GRU (one layer, batch_first) or ClippedReLURNN
    x: Tensor  # (N, T, D)
    h0: Tensor | None = None  # (N, H) initial state; None = zeros
    lengths: Tensor | None = None  # (N,) steps of each row that reversing keeps in place
    reverse: bool = False  # run each row backwards within its first lengths[n] steps


def weights(rnn: nn.Module) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return rnn.weight_ih_l0, rnn.weight_hh_l0, rnn.bias_ih_l0, rnn.bias_hh_l0


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the GEMMs and weights: autocast's, where it is on, else x's."""
    kind = x.device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


@dataclass(frozen=True)
class _Spec:
    cell: Cell
    clip: float
    backend: Backend
    config: KernelConfig | None
    reverse: tuple[bool, ...]
    save: bool  # keep what backward needs (grad mode on and something requires grad)


_SLOTS = 7  # tensors per problem: x, h0, lengths, w_ih, w_hh, b_ih, b_hh


class _Recurrences(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, *flat: Tensor | None) -> tuple[Tensor, ...]:
        dtype = compute_dtype(flat[0])
        gates = GATES[spec.cell]
        dirs = []
        for i, reverse in enumerate(spec.reverse):
            x, h0, lengths, w_ih, w_hh, b_ih, b_hh = flat[i * _SLOTS : (i + 1) * _SLOTS]
            n_rows, steps, _ = x.shape
            hidden = w_hh.shape[1]
            acc = reference.state_dtype(dtype)
            if spec.cell == "rnn":
                bias = b_ih + b_hh
            else:  # b_hn stays inside: it is multiplied by r
                bias = b_ih + torch.cat([b_hh[: 2 * hidden], b_hh.new_zeros(hidden)])
            gi = F.linear(x.to(dtype), w_ih.to(dtype), bias.to(dtype)).contiguous()
            if h0 is None:
                h0 = x.new_zeros(n_rows, hidden, dtype=acc)
            if lengths is None:
                lengths = torch.full((n_rows,), steps, device=x.device)
            b_hn = b_hh[2 * hidden :] if spec.cell == "gru" else b_hh.new_zeros(hidden)
            dirs.append(
                Direction(
                    gi=gi,
                    h0=h0.to(acc).contiguous(),
                    lengths=lengths.to(torch.int32).contiguous(),
                    w=w_hh.to(dtype).reshape(gates, hidden, hidden).contiguous(),
                    b_hn=b_hn.to(acc).contiguous(),
                    reverse=reverse,
                )
            )
        states = _forward(spec, dirs, spec.save)
        ctx.spec, ctx.dtype = spec, dtype
        ctx.save_for_backward(
            *[t for i in range(len(dirs)) for t in flat[i * _SLOTS : (i + 1) * _SLOTS]],
            *[t for d in dirs for t in (d.h0, d.lengths)],
            *[t for hs, saved in states for t in (hs, saved)],
        )
        return tuple(hs.to(dtype) for hs, _ in states)

    @staticmethod
    def backward(ctx, *douts: Tensor) -> tuple[Tensor | None, ...]:
        spec, dtype = ctx.spec, ctx.dtype
        n = len(spec.reverse)
        saved = ctx.saved_tensors
        inputs = [saved[i * _SLOTS : (i + 1) * _SLOTS] for i in range(n)]
        extra = saved[n * _SLOTS :]
        starts = [(extra[2 * i], extra[2 * i + 1]) for i in range(n)]
        states = [(extra[2 * n + 2 * i], extra[2 * n + 2 * i + 1]) for i in range(n)]
        gates = GATES[spec.cell]
        dirs = []
        for (_, _, _, _, w_hh, _, _), (h0, lengths), reverse in zip(
            inputs, starts, spec.reverse, strict=True
        ):
            hidden = w_hh.shape[1]
            w = w_hh.to(dtype).reshape(gates, hidden, hidden)
            dirs.append(Direction(None, h0, lengths, w, None, reverse))
        douts = [g.contiguous() for g in douts]
        results = _backward(spec, dirs, douts, states)

        grads: list[Tensor | None] = [None]  # the spec
        for i, (dgi, dgh, dh0) in enumerate(results):
            grads += _gemm_grads(
                inputs[i], starts[i], states[i][0], dirs[i].reverse, dgi, dgh, dh0, dtype
            )
        return tuple(grads)


def _gemm_grads(inputs, start, hs, reverse, dgi, dgh, dh0, dtype) -> list[Tensor | None]:
    """Gradients of one problem's inputs, from what the recurrence's backward gave."""
    x, h0_in, _, w_ih, w_hh, b_ih, b_hh = inputs
    h0, lengths = start
    order = reference.positions(lengths, x.shape[1], reverse)
    h_prev = reference.previous_states(hs, h0, order)  # (N, T, H)
    dgi_flat, dgh_flat = dgi.flatten(0, 1).to(dtype), dgh.flatten(0, 1).to(dtype)
    dx = (dgi.to(dtype) @ w_ih.to(dtype)).to(x.dtype)  # (N, T, D)
    dw_ih = dgi_flat.T @ x.to(dtype).flatten(0, 1)  # (G*H, D)
    dw_hh = dgh_flat.T @ h_prev.flatten(0, 1).to(dtype)  # (G*H, H)
    return [
        dx,
        None if h0_in is None else dh0.reshape(h0_in.shape).to(h0_in.dtype),
        None,  # lengths
        dw_ih.to(w_ih.dtype),
        dw_hh.to(w_hh.dtype),
        dgi.sum((0, 1)).to(b_ih.dtype),
        dgh.sum((0, 1)).to(b_hh.dtype),
    ]


def _forward(spec: _Spec, dirs: list[Direction], save: bool) -> list:
    if spec.backend == "reference":
        out = []
        for d in dirs:
            n_rows, steps, _ = d.gi.shape
            order = reference.positions(d.lengths, steps, d.reverse)
            w = d.w.flatten(0, 1)
            out.append(reference.forward(spec.cell, d.gi, d.h0, w, d.b_hn, order, spec.clip, save))
        return out
    from echoic.model.nn.persistent import launch

    mode = "persistent" if spec.backend == "triton" else "steps"
    return launch.forward(spec.cell, spec.clip, dirs, save, mode, _config(spec, dirs))


def _backward(spec: _Spec, dirs: list[Direction], douts: list[Tensor], states: list) -> list:
    if spec.backend == "reference":
        out = []
        for d, g, (hs, saved) in zip(dirs, douts, states, strict=True):
            order = reference.positions(d.lengths, hs.shape[1], d.reverse)
            w = d.w.flatten(0, 1)
            out.append(reference.backward(spec.cell, g, hs, saved, d.h0, w, order, spec.clip))
        return out
    from echoic.model.nn.persistent import launch

    cfg = _config(spec, dirs)
    if spec.backend == "triton":
        try:
            return launch.backward(spec.cell, spec.clip, dirs, douts, states, "persistent", cfg)
        except PersistentKernelError as e:
            # The forward pass already ran on these kernels; finish on the barrier-free path,
            # and from the next step on run this layer shape on cuDNN, as after a failed
            # forward launch (a grid that timed out once would time out every step).
            _fall_back(("backward", spec.cell, cfg), str(e), "backward runs one launch per step")
            hidden = dirs[0].w.shape[-1]
            _broken.add(_shape_key(spec.cell, hidden, dirs[0].w.dtype, len(dirs), douts[0].device))
    return launch.backward(spec.cell, spec.clip, dirs, douts, states, "steps", cfg)


def _config(spec: _Spec, dirs: list[Direction]) -> KernelConfig:
    if spec.config is not None:
        return spec.config
    hidden = dirs[0].w.shape[-1]  # no device to size for: one program per direction
    return KernelConfig(block_h=capacity.next_power_of_2(hidden), num_warps=4)


def recurrences(
    cell: Cell,
    problems: Sequence[Problem],
    clip: float = float("inf"),
    backend: Backend = "reference",
    config: KernelConfig | None = None,
) -> list[Tensor]:
    """Outputs (N, T, H) of each problem, in time order, differentiable.

    `clip` is the ReLU ceiling of a clipped-ReLU RNN (inf: nn.RNN's relu). All
    problems share one cell type and hidden size; with a Triton backend, at most
    two (one launch, one barrier each).
    """
    if backend != "reference" and len(problems) > 2:
        raise ValueError("the kernels run at most two recurrences per launch")
    if any(p.x.shape[1] < 1 for p in problems):
        raise ValueError("every recurrence needs at least one step")
    flat: list[Tensor | None] = []
    for p in problems:
        h0 = None if p.h0 is None else p.h0.reshape(p.x.shape[0], -1)
        flat += [p.x, h0, p.lengths, *weights(p.rnn)]
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in flat)
    spec = _Spec(cell, float(clip), backend, config, tuple(p.reverse for p in problems), save)
    return list(_Recurrences.apply(spec, *flat))


# ---- choosing the implementation for a layer --------------------------------------

STRICT_ENV = "ECHOIC_PERSISTENT_STRICT"  # "1": a fallback raises instead

_warned: set = set()
_broken: set = set()  # configurations whose persistent launch failed: cuDNN from then on


def strict() -> bool:
    """Whether ECHOIC_PERSISTENT_STRICT=1: fallbacks from the kernels raise."""
    value = os.environ.get(STRICT_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{STRICT_ENV} must be 0 or 1, not {value!r}")
    return value == "1"


def _fall_back(key, problem: str, fallback: str) -> None:
    """Say once that `problem` makes a layer run without the kernels (`fallback`); in
    strict mode, raise PersistentKernelError instead (nothing is marked broken)."""
    if strict():
        raise PersistentKernelError(f"{problem} ({STRICT_ENV}=1: no fallback)")
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{problem}; {fallback}", RuntimeWarning, stacklevel=3)


@functools.cache
def plan(
    cell: Cell, hidden: int, dtype: torch.dtype, directions: int, device: int,
    tiles_first: bool = False,
) -> KernelConfig | str:  # fmt: skip
    """The kernel configuration for this GPU, or why there is none (a sentence);
    `tiles_first` for a batch that one tensor-core tile holds (capacity.candidates)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{dtype} is not a kernel dtype"
    if hidden > capacity.MAX_HIDDEN:
        return f"hidden size {hidden} > {capacity.MAX_HIDDEN}"
    try:
        from echoic.model.nn.persistent import launch  # noqa: F401 - needs triton
    except ImportError:
        return "triton is not installed (pip install triton)"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = capacity.candidates(hidden, directions, sms, capacity.tile_dtype(dtype), tiles_first)
    return first_fit(cell, hidden, dtype, directions, device, configs)


def first_fit(
    cell: Cell, hidden: int, dtype: torch.dtype, directions: int, device: int,
    configs: Sequence[KernelConfig],
) -> KernelConfig | str:  # fmt: skip
    """The first of `configs` whose kernels compile and fit this GPU, or why none does."""
    from echoic.model.nn.persistent import launch

    reasons = []
    for cfg in configs:
        try:
            launch.check(cell, dtype, hidden, directions, cfg, torch.device("cuda", device))
            return cfg
        except Exception as e:  # noqa: BLE001 - any compile, load or resource failure: cuDNN
            label = f"{cfg.num_warps} warps" + (f", {cfg.block_b}-row tiles" if cfg.tiles else "")
            reasons.append(f"{label}: {type(e).__name__}: {e}")
    return "; ".join(reasons)


def _shape_key(
    cell: Cell, hidden: int, dtype: torch.dtype, directions: int, device: torch.device
) -> tuple:
    """What `plan` and the broken set know a layer shape by."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (cell, hidden, dtype, directions, index)


def _key(cell: Cell, hidden: int, x: Tensor, directions: int) -> tuple:
    return _shape_key(cell, hidden, compute_dtype(x), directions, x.device)


def choose(
    impl: Impl, cell: Cell, hidden: int, x: Tensor, directions: int, rows: int
) -> tuple[Backend, KernelConfig | None] | None:
    """The backend and configuration to run a layer with, or None for the cuDNN modules
    (in strict mode, PersistentKernelError where `persistent` would fall back)."""
    if impl == "cudnn" or torch.jit.is_tracing() or torch.jit.is_scripting():
        return None
    if not x.is_cuda:
        if impl == "persistent" and strict():
            raise PersistentKernelError(
                f"the persistent kernels run on a CUDA GPU, not on {x.device.type}"
                f" ({STRICT_ENV}=1: no fallback)"
            )
        return None
    key = _key(cell, hidden, x, directions)
    if key in _broken:
        return None
    if impl == "auto":
        most = auto_max_rows(cell, directions, capacity.tile_dtype(key[2]))
        if torch.cuda.get_device_capability(key[-1]) != (9, 0) or rows > most:
            return None
    found = plan(*key, TILES_FIRST_MIN_ROWS <= rows <= capacity.TILES_FIRST_ROWS)
    if isinstance(found, str):
        if impl == "persistent":
            shape = f"{cell} H={hidden} {key[2]} x{directions}"
            _fall_back(key, f"persistent kernels do not fit {shape}: {found}", "using cuDNN")
        return None
    return "triton", found


def run_layer(
    layer: nn.Module,
    x: Tensor,
    state: tuple[Tensor, ...],
    win: Tensor | None,
    win_len: Tensor | None,
) -> tuple[Tensor, Tensor | None] | None:
    """Both directions of a RecurrentLayer in one persistent launch, or None for cuDNN.

    x (B, K*C, D) and state (h0,) with h0 (1, B, H) for the forward direction; win
    (B*K, C+R, D) and win_len (B*K,) for the backward one (None for a unidirectional
    layer), run reversed within each window's length. Returns the outputs (B, K*C, H)
    and (B*K, C+R, H) in time order.
    """
    cfg = layer.cfg
    impl = getattr(layer, "rnn_impl", "cudnn")
    if impl == "cudnn" or cfg.rnn_type == "lstm":
        return None
    cell: Cell = cfg.rnn_type  # type: ignore[assignment]
    directions = 1 if win is None else 2
    rows = max(x.shape[0], 0 if win is None else win.shape[0])
    choice = choose(impl, cell, cfg.rnn_hidden, x, directions, rows)
    if choice is None:
        return None
    problems = [Problem(layer.fwd, x, state[0][0])]
    if win is not None:
        problems.append(Problem(layer.bwd, win, None, win_len, reverse=True))
    clip = cfg.relu_clip if cell == "rnn" else float("inf")
    try:
        outs = recurrences(cell, problems, clip, *choice)
    except PersistentKernelError as e:
        key = _key(cell, cfg.rnn_hidden, x, directions)
        _fall_back(("failed",) + key, str(e), "this layer shape uses cuDNN from now on")
        _broken.add(key)
        return None
    return outs[0], (outs[1] if win is not None else None)
