"""The recurrences that the persistent kernels compute, as plain torch step loops.

This is the specification of the kernels (tests hold both to it), the backend the
autograd function uses on the CPU, and the formulas written once in readable form:

    clipped-ReLU RNN   h' = min(max(gi + W_hh h, 0), clip)      (gi holds b_ih + b_hh)
    GRU (PyTorch's)    r  = sigmoid(gi_r + W_hr h)               (gi_r holds b_ir + b_hr)
                       z  = sigmoid(gi_z + W_hz h)               (gi_z holds b_iz + b_hz)
                       hn = W_hn h + b_hn
                       n  = tanh(gi_n + r * hn)                  (gi_n holds b_in)
                       h' = (1 - z) * n + z * h

Backward through one step, given dh = dL/dh' (the output's gradient plus the
recurrent gradient from the step after):

    RNN   da = dh * (0 < h' < clip);  dgi = dgh = da;  dh_prev = W_hh^T da
    GRU   da_n = dh (1 - z)(1 - n^2);  da_r = da_n hn r (1 - r);  da_z = dh (h - n) z (1 - z)
          dgi = [da_r, da_z, da_n];  dgh = [da_r, da_z, da_n r]   (gradient of W_hh h + b_hh)
          dh_prev = dh z + W_hh^T dgh

dgi feeds the input GEMMs (dx = dgi W_ih, dW_ih = dgi^T x) and dgh the recurrent
weight GEMM (dW_hh = dgh^T h_prev), both outside the recurrence.

Row n takes step s at position `positions(...)[n, s]`: s, or for a reversed
direction lengths[n] - 1 - s while s < lengths[n], so that running a row reversed
within its length needs no copies. States are kept in float32 (float64 when the
inputs are float64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Cell = Literal["rnn", "gru"]
GATES = {"rnn": 1, "gru": 3}
SAVED = {"rnn": 0, "gru": 4}  # float32 values saved per unit and position: r, z, n, hn


@dataclass
class Direction:
    """One recurrence's inputs as the backends take them."""

    gi: Tensor | None  # (N, T, G*H) input projections incl. folded biases, compute dtype
    h0: Tensor  # (N, H) state dtype
    lengths: Tensor  # (N,) int32: steps of each row that reversing keeps in place
    w: Tensor  # (G, H, H) W_hh by gate, compute dtype
    b_hn: Tensor | None  # (H,) state dtype: the GRU's b_hn (zeros for the RNN)
    reverse: bool  # run each row backwards within its length


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def positions(lengths: Tensor, steps: int, reverse: bool) -> Tensor:
    """(N, T) long: the time position that step s of row n reads and writes."""
    s = torch.arange(steps, device=lengths.device).unsqueeze(0)  # (1, T)
    if not reverse:
        return s.expand(lengths.shape[0], steps)
    length = lengths.long().unsqueeze(1)  # (N, 1)
    return torch.where(s < length, length - 1 - s, s)


def previous_states(hs: Tensor, h0: Tensor, order: Tensor) -> Tensor:
    """(N, T, H): the state that the step writing each position started from.

    `order` (from `positions`) is its own inverse, so position p is written by step
    order[p], and the step before that wrote position order[order[p] - 1].
    """
    before = order.gather(1, (order - 1).clamp(min=0))  # (N, T)
    prev = hs.gather(1, _expand(before, hs))
    return torch.where((order == 0).unsqueeze(-1), h0.unsqueeze(1).to(hs.dtype), prev)


def _expand(index: Tensor, like: Tensor) -> Tensor:
    return index.unsqueeze(-1).expand(-1, -1, like.shape[-1])


def forward(
    cell: Cell, gi: Tensor, h0: Tensor, w_hh: Tensor, b_hn: Tensor | None, order: Tensor,
    clip: float, save: bool,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """States (N, T, H) and, for a GRU with `save`, the gates (N, T, 4H) for backward."""
    n_rows, steps, _ = gi.shape
    acc = state_dtype(gi.dtype)
    hidden = w_hh.shape[1]
    w = w_hh.to(acc)
    rows = torch.arange(n_rows, device=gi.device)
    hs = gi.new_empty(n_rows, steps, hidden, dtype=acc)
    saved = gi.new_empty(n_rows, steps, 4 * hidden, dtype=acc) if save and cell == "gru" else None
    h = h0.to(acc)
    for s in range(steps):
        t = order[:, s]
        x = gi[rows, t].to(acc)  # (N, G*H)
        gh = h @ w.T  # (N, G*H)
        if cell == "rnn":
            h = torch.clamp(x + gh, 0.0, clip)
        else:
            x_r, x_z, x_n = x.chunk(3, 1)
            g_r, g_z, g_n = gh.chunk(3, 1)
            hn = g_n + b_hn.to(acc)
            r, z = torch.sigmoid(x_r + g_r), torch.sigmoid(x_z + g_z)
            n = torch.tanh(x_n + r * hn)
            h = (1 - z) * n + z * h
            if saved is not None:
                saved[rows, t] = torch.cat([r, z, n, hn], 1)
        hs[rows, t] = h
    return hs, saved


def backward(
    cell: Cell, dout: Tensor, hs: Tensor, saved: Tensor | None, h0: Tensor, w_hh: Tensor,
    order: Tensor, clip: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dgi and dgh (N, T, G*H) and dL/dh0 (N, H), from dL/d(states) (N, T, H)."""
    n_rows, steps, hidden = hs.shape
    acc = hs.dtype
    w = w_hh.to(acc)
    rows = torch.arange(n_rows, device=hs.device)
    gates = GATES[cell]
    dgh = hs.new_zeros(n_rows, steps, gates * hidden)
    dgi = dgh if cell == "rnn" else torch.zeros_like(dgh)
    dh = hs.new_zeros(n_rows, hidden)  # dL/dh after the step just done
    z_next = hs.new_zeros(n_rows, hidden)  # z of the step after: the direct path dh * z
    dg_next = hs.new_zeros(n_rows, gates * hidden)
    for s in reversed(range(steps)):
        t = order[:, s]
        dh = dout[rows, t].to(acc) + dg_next @ w + z_next * dh
        if cell == "rnn":
            h = hs[rows, t]
            dg_next = dh * ((h > 0) & (h < clip))
            dgh[rows, t] = dg_next
            continue
        h_prev = h0.to(acc) if s == 0 else hs[rows, order[:, s - 1]]
        r, z, n, hn = saved[rows, t].chunk(4, 1)
        d_an = dh * (1 - z) * (1 - n * n)
        d_ar = d_an * hn * r * (1 - r)
        d_az = dh * (h_prev - n) * z * (1 - z)
        dgi[rows, t] = torch.cat([d_ar, d_az, d_an], 1)
        dg_next = torch.cat([d_ar, d_az, d_an * r], 1)
        dgh[rows, t] = dg_next
        z_next = z
    dh0 = dg_next @ w + z_next * dh
    return dgi, dgh, dh0
