"""What fits on a chip: kernel configurations, register budgets and co-residency.

A persistent program keeps its weight slice in registers: G * BLOCK_H * H
weights (G = 1 for the clipped-ReLU RNN, 3 for the GRU), two 16-bit weights per
32-bit register or one float32, spread over num_warps * 32 threads, next to the
registers the step itself needs. The register file of an SM is 64K 32-bit
registers (256 KB); one thread may use at most 255, so a program of 8 warps can
take the whole file and a program of 16 warps at most 128 registers a thread.
The grid holds directions * ceil(H / BLOCK_H) programs, all resident at once,
one per SM by default: BLOCK_H is the smallest power of two that keeps the grid
within the SM count.

Whether a configuration fits is decided by compiling it, not by this arithmetic:
a kernel with register spills does not keep its weights on chip, and a grid
larger than SMs * resident programs per SM cannot meet at a barrier. `launch`
checks both before every persistent launch (on the GPU, from the compiled
kernel's n_regs, n_spills and shared memory and the device's SM count);
`weight_bytes` and `resident_blocks` are the arithmetic for those checks.

Compiled for sm_90 (Triton 3.9, ptxas -v; H100 SXM and H200, 132 SMs), the
largest H swept (512, 1024, 1536, 2048) whose kernels keep their weights in
registers without spills, one direction / both directions in one launch:

    cell  dtype       1 direction  2 directions   weights per SM at the limit (2 dirs)
    rnn   bf16, fp16  2048         1024            32 KB (block_h 16)
    rnn   fp32        2048         1024            64 KB
    gru   bf16, fp16  1024         1024            96 KB (block_h 16, 8 warps)
    gru   fp32        1024          512            48 KB

Both directions of a 16-bit RNN at H = 1536 or 2048 (block_h 32, 16 warps: 128
registers a thread) fitted with a single barrier counter; the flag barrier's wait
(a vector of flags polled and reduced across the program) costs the backward
kernel the last registers, and it spills about 1 KB, so those run as tiles (bf16)
or on cuDNN.

A GRU with H = 2048 in bf16 holds 24 MB of recurrent weights a direction: the
whole register file of an H100 is 33 MB, and the kernels spill at the 192 KB a
program that one direction needs. Such layers, and anything outside this table,
run on cuDNN (`auto` and `persistent` alike).

Tensor-core tiles (KernelConfig.block_b = 16, 16-bit weights): Triton stages the
weights of a `tl.dot` operand in shared memory and reads them from there every
step (still on chip, but not in registers), next to a (BLOCK_B, H) float32 tile of
the rows' states. What bounds them is shared memory, at most 227 KB a program on
sm_90; compiled the same way (no spills, shared memory within that):

    cell  dtype       1 direction  2 directions
    rnn   bf16        2048         2048   (193 KB of shared memory at 2 x 2048, 8 warps)
    rnn   fp16        2048         1024
    gru   bf16, fp16  1024         1024

bf16 reaches further than fp16 because it exchanges the state in bf16: the tile of
the rows' states that Triton stages in shared memory is half the size (fp16 runs
exchange float32, as its range is too narrow for dgh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echoic.model.nn.persistent.reference import GATES

SM90_SHARED_PER_PROGRAM = 232448  # bytes of shared memory one program may use on sm_90
BARRIER_TIMEOUT_S = 1.0  # s a program waits at a grid barrier before it aborts the launch;
# a step takes microseconds, so only a grid that is not co-resident waits that long
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256 (sm_70 to sm_90)
MAX_HIDDEN = 4096  # the kernels hold a whole state vector in one block of registers


class PersistentKernelError(RuntimeError):
    """A persistent launch cannot run here, or gave up waiting at its grid barrier."""


MMA_MIN = 16  # a tensor-core product needs each of its dimensions to be at least 16
TILE_DTYPES = ("bfloat16", "float16")  # weight dtypes (torch names) that tiles run with


def tile_dtype(dtype: object) -> bool:
    """Whether tensor-core tiles run with weights of this dtype (a torch.dtype)."""
    return str(dtype).removeprefix("torch.") in TILE_DTYPES


@dataclass(frozen=True)
class KernelConfig:
    block_h: int  # hidden units per program (a power of two)
    num_warps: int  # warps per program
    block_b: int = 1  # batch rows per product: 1 (matrix-vector) or >= 16 (tensor-core tiles)
    timeout_s: float = BARRIER_TIMEOUT_S  # s at one barrier before the launch aborts (GPU clock)

    def __post_init__(self) -> None:
        if self.block_b != 1 and (self.block_b < MMA_MIN or self.block_b & (self.block_b - 1)):
            raise ValueError(
                f"block_b must be 1 or a power of two >= {MMA_MIN}, not {self.block_b}"
            )

    @property
    def tiles(self) -> bool:
        return self.block_b > 1

    def programs(self, hidden: int, directions: int) -> int:
        return directions * math.ceil(hidden / self.block_h)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def block_h_for(hidden: int, directions: int, sms: int) -> int:
    """The smallest power of two whose grid (directions * ceil(H / block_h)) fits `sms`."""
    return next_power_of_2(math.ceil(directions * hidden / sms))


TILES_FIRST_ROWS = MMA_MIN  # up to this many rows, one tile holds the whole batch


def candidates(
    hidden: int, directions: int, sms: int, tiles: bool = False, tiles_first: bool = False
) -> list[KernelConfig]:
    """Configurations to try, in order: one program per SM, 8 warps, then 16 warps;
    with `tiles` (16-bit weights), the same with 16-row tensor-core tiles (at least 16
    units a program, so the grid may use fewer SMs): after the rows, or with
    `tiles_first` (a batch of at most TILES_FIRST_ROWS rows: one tile reads the state
    and runs the product once a step for the whole batch, rows once a row) before them."""
    block_h = block_h_for(hidden, directions, sms)
    rows = [KernelConfig(block_h, warps) for warps in (8, 16)]
    if not tiles:
        return rows
    tile = [KernelConfig(max(block_h, MMA_MIN), warps, MMA_MIN) for warps in (8, 16)]
    return tile + rows if tiles_first else rows + tile


def weight_bytes(cell: str, hidden: int, block_h: int, itemsize: int) -> int:
    """Bytes of recurrent weights that one program holds for all steps."""
    return GATES[cell] * min(block_h, hidden) * hidden * itemsize


def resident_blocks(n_regs: int, num_warps: int, shared: int, props) -> int:
    """Programs of one kernel that one SM holds at once (the occupancy calculation).

    `props` is a torch.cuda device-properties object; fields it lacks take the
    values of sm_80 to sm_90 parts.
    """
    per_warp = math.ceil(max(n_regs, 1) * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_regs = regs // per_warp // num_warps
    by_threads = threads // (num_warps * 32)
    by_smem = smem // (shared + 1024) if shared else by_threads  # 1 KB reserved per block
    return min(by_regs, by_threads, by_smem, 32)


# The table above: (cell, dtype) -> the largest H that fits (one direction, two),
# from compiling both kernels with `candidates(H, directions, SM90_SMS)` for sm_90.
# tests/test_persistent_rnn.py recompiles the edges of this table and checks them.
SM90_SMS = 132  # the SM count the tables were compiled for (H100 SXM, H200)
SM90_SWEPT_HIDDEN = (512, 1024, 1536, 2048)
SM90_MAX_HIDDEN: dict[tuple[str, str], tuple[int, int]] = {
    ("rnn", "bf16"): (2048, 1024),
    ("rnn", "fp16"): (2048, 1024),
    ("rnn", "fp32"): (2048, 1024),
    ("gru", "bf16"): (1024, 1024),
    ("gru", "fp16"): (1024, 1024),
    ("gru", "fp32"): (1024, 512),
}
SM90_MAX_HIDDEN_TILES: dict[tuple[str, str], tuple[int, int]] = {
    ("rnn", "bf16"): (2048, 2048),
    ("rnn", "fp16"): (2048, 1024),
    ("gru", "bf16"): (1024, 1024),
    ("gru", "fp16"): (1024, 1024),
}


def sm90_fits(cell: str, dtype: str, hidden: int, directions: int, tiles: bool = False) -> bool:
    """Whether the sm_90 tables say these kernels keep their weights on chip."""
    table = SM90_MAX_HIDDEN_TILES if tiles else SM90_MAX_HIDDEN
    return (cell, dtype) in table and hidden <= table[(cell, dtype)][directions - 1]


def sm90_expected(
    cell: str, dtype: str, hidden: int, directions: int, sms: int, tiles: bool = False
) -> bool | None:
    """What the sm_90 tables say of these kernels on an sm_90 chip with `sms` SMs:
    that they fit (True), that they do not (False), or nothing (None).

    The tables hold for SM90_SMS SMs, because the SM count sets the kernels: `plan`
    sizes the grid to one program per SM, so each program holds block_h_for(H,
    directions, sms) hidden units' weights. With the same block_h (H100 SXM and H200,
    and some shapes elsewhere) they are the same kernels. With a larger one (fewer SMs:
    the H100 PCIe has 114) each program holds more weights, so what does not fit with
    SM90_SMS SMs does not fit either, but what fits there may spill here; with a
    smaller one (more SMs) the converse.
    """
    fits = sm90_fits(cell, dtype, hidden, directions, tiles)
    least = MMA_MIN if tiles else 1  # a tile needs 16 units a program
    here, table = (max(block_h_for(hidden, directions, n), least) for n in (sms, SM90_SMS))
    if here == table or (here > table and not fits) or (here < table and fits):
        return fits
    return None
