"""Persistent RNN kernels (Diamos et al. 2016) for training on Hopper GPUs.

Modules, one concept each:

- `reference`: the recurrences (clipped-ReLU RNN, PyTorch's GRU), forward and
  backward, as torch step loops: the specification and the CPU backend.
- `kernels`: the Triton kernels; recurrent weights stay in registers for all
  steps, a grid-wide barrier per step (a flag per program, release/acquire, a
  wall-clock timeout that aborts the launch), and the barrier's own test kernels.
- `launch`: buffers, grid sizing, co-residency and timeout checks, launch failures
  as PersistentKernelError, offline compilation for sm_90 (resources from ptxas).
- `capacity`: which (cell, H, dtype, directions) fit on the chip.
- `function`: the autograd function (nn.RNN / nn.GRU parameter names, so
  checkpoints are the same with either implementation), `--rnn-impl`'s choice,
  and its fallbacks to cuDNN (errors with ECHOIC_PERSISTENT_STRICT=1).

Triton is optional: everything here imports without it, and without it (or
without a GPU) `auto` and `persistent` run the cuDNN modules (in strict mode,
`persistent` raises PersistentKernelError instead).
"""

from echoic.model.nn.persistent.capacity import KernelConfig, PersistentKernelError
from echoic.model.nn.persistent.function import (
    Problem,
    auto_max_rows,
    choose,
    plan,
    recurrences,
    run_layer,
)

__all__ = [
    "auto_max_rows",
    "KernelConfig",
    "PersistentKernelError",
    "Problem",
    "choose",
    "plan",
    "recurrences",
    "run_layer",
]
