"""Host side of the Triton kernels: buffers, grid sizing, co-residency, timeouts.

Needs triton; `echoic.model.nn.persistent` imports this module only when it is about
to run a kernel. Two modes:

- "persistent": one launch per direction pair and pass (forward, backward); the
  programs stay resident for all steps and meet at a grid barrier per step.
- "steps": one launch per step (and one more for dL/dh0). No grid barrier, so it
  cannot hang; the Triton interpreter checks the per-step math this way, and the
  backward pass falls back to it if a persistent backward launch times out.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Literal

import torch
import triton
from torch import Tensor

from echoic.model.nn.persistent import kernels
from echoic.model.nn.persistent.capacity import (
    MMA_MIN,
    KernelConfig,
    PersistentKernelError,
    next_power_of_2,
    resident_blocks,
    tile_dtype,
)
from echoic.model.nn.persistent.reference import GATES, Cell, Direction

Mode = Literal["persistent", "steps"]


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cell_id(cell: Cell) -> int:
    return (kernels.GRU if cell == "gru" else kernels.RNN).value


def _pair(items: list) -> list:
    """Two directions' worth of arguments; a single direction is passed twice (unused)."""
    return items if len(items) == 2 else items * 2


def _check_resources(compiled, programs: int, device: torch.device) -> None:
    """Raise unless the weights stay on chip (no spills) and the grid is co-resident."""
    compiled._init_handles()
    if compiled.n_spills:
        raise PersistentKernelError(
            f"{compiled.n_spills} register spills ({compiled.n_regs} registers): the weight"
            " slice does not fit in registers"
        )
    props = torch.cuda.get_device_properties(device)
    per_sm = resident_blocks(
        compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared, props
    )
    if programs > per_sm * props.multi_processor_count:
        raise PersistentKernelError(
            f"{programs} programs but only {per_sm} per SM x {props.multi_processor_count} SMs"
            " can be resident at once"
        )


_checked: set[tuple[str, int]] = set()  # (compiled kernel, grid) pairs known to fit


def _launch(kernel, programs: int, args: list, consts: dict, cfg: KernelConfig, persistent: bool):
    """Launch `kernel`; a persistent launch first proves that its grid can be co-resident.

    Whatever stops the kernel from running (a compile error, too few resources, a
    cooperative launch that the driver refuses because the grid cannot be co-resident
    now: another process on the SMs, MPS limits) raises PersistentKernelError with the
    reason, which the callers turn into a fallback to cuDNN.
    """
    options = _options(cfg, consts)
    if interpreted():
        kernel[(programs,)](*args, **options)
        return
    try:
        if persistent:
            options["launch_cooperative_grid"] = True  # the driver refuses a grid too large
            compiled = kernel.warmup(*args, grid=(programs,), **options)
            if (compiled.hash, programs) not in _checked:
                _check_resources(compiled, programs, args[0].device)
                _checked.add((compiled.hash, programs))
        kernel[(programs,)](*args, **options)
    except PersistentKernelError:
        raise
    except Exception as e:  # noqa: BLE001 - any compile, load or launch failure: cuDNN
        what = "persistent" if persistent else "per-step"
        raise PersistentKernelError(
            f"{what} launch of {programs} programs failed: {type(e).__name__}: {e}"
        ) from e


def _options(cfg: KernelConfig, consts: dict) -> dict:
    return dict(_compile_options(cfg), ASM=not interpreted(), **consts)


def _compile_options(cfg: KernelConfig) -> dict:
    # num_stages=1: no software pipelining of the loop over row tiles. It has a few
    # iterations at most, and each stage would keep another (BLOCK_B, H) float32 tile
    # in shared memory beside the weights (the backward tiles would not fit an SM).
    return dict(num_warps=cfg.num_warps, num_stages=1, enable_fp_fusion=True)


def _tiling(cfg: KernelConfig, hidden: int, dtype: torch.dtype) -> dict:
    """The kernels' BLOCK_H, BLOCK_B and KS (chunks of H, one a warp, for tiles)."""
    if cfg.tiles and not tile_dtype(dtype):
        raise PersistentKernelError(f"tensor-core tiles need bf16 or fp16 weights, not {dtype}")
    if cfg.tiles and cfg.block_h < MMA_MIN:
        raise PersistentKernelError(f"tensor-core tiles need block_h >= {MMA_MIN}")
    chunks = min(cfg.num_warps, max(next_power_of_2(hidden) // MMA_MIN, 1)) if cfg.tiles else 1
    slices = next_power_of_2(-(-hidden // cfg.block_h))  # a barrier's flags, one lane each
    return dict(BLOCK_H=cfg.block_h, BLOCK_B=cfg.block_b, KS=chunks, SLICES=slices)


def exchange_dtype(dtype: torch.dtype) -> torch.dtype:
    """What programs exchange the state (forward) and dgh (backward) in: bf16 when the
    layer computes in bf16, float32 otherwise (fp16's range is too narrow for dgh)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _exchanged(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A buffer like `t` (float32) in the exchange dtype: `t` itself when that is float32."""
    return t if dtype == torch.float32 else torch.empty_like(t, dtype=dtype)


def _barrier_flags(device: torch.device, programs: int) -> tuple[Tensor, Tensor]:
    flags = torch.zeros(programs, dtype=torch.int32, device=device)  # one a program
    return flags, torch.zeros(1, dtype=torch.int32, device=device)  # the abort flag


def _timeout_ns(cfg: KernelConfig) -> int:
    return round(cfg.timeout_s * 1e9)


def _forward_args(
    cell: Cell, clip: float, dirs: list[Direction], outs: list, save: bool, programs: int
):
    hidden = dirs[0].w.shape[-1]
    kind = exchange_dtype(dirs[0].w.dtype)
    p = _pair(dirs)
    o = _pair([(hs, hs if sv is None else sv) for hs, sv in outs])
    x0 = _pair([d.h0.to(kind) for d in dirs])  # the initial states, as the exchange holds them
    xs = _pair([_exchanged(hs, kind) for hs, _ in outs])
    flags, status = _barrier_flags(dirs[0].gi.device, programs)
    args = [
        p[0].gi, p[1].gi, p[0].h0, p[1].h0, x0[0], x0[1], p[0].lengths, p[1].lengths,
        p[0].w, p[1].w, p[0].b_hn, p[1].b_hn, o[0][0], o[1][0], xs[0], xs[1], o[0][1], o[1][1],
        p[0].gi.shape[0], p[1].gi.shape[0], p[0].gi.shape[1], p[1].gi.shape[1],
        int(p[0].reverse), int(p[1].reverse), flags, status, hidden, float(clip),
    ]  # fmt: skip
    consts = dict(
        CELL=_cell_id(cell),
        BLOCK_K=next_power_of_2(hidden),
        SAVE=bool(cell == "gru" and save),
        XCOPY=kind != torch.float32,
    )
    return args, consts, status


def _backward_args(
    cell: Cell, clip: float, dirs: list[Direction], douts: list, states, bufs, programs: int
):
    hidden = dirs[0].w.shape[-1]
    kind = exchange_dtype(dirs[0].w.dtype)
    p, g, b = _pair(dirs), _pair(douts), _pair(bufs)
    st = _pair([(hs, hs if sv is None else sv) for hs, sv in states])
    dgx = _pair([_exchanged(dgh, kind) for dgh, _, _, _ in bufs])
    flags, status = _barrier_flags(douts[0].device, programs)
    args = [
        g[0], g[1], st[0][0], st[1][0], st[0][1], st[1][1], p[0].h0, p[1].h0,
        p[0].lengths, p[1].lengths, p[0].w, p[1].w,
        b[0][0], b[1][0], dgx[0], dgx[1], b[0][1], b[1][1], b[0][2], b[1][2], b[0][3], b[1][3],
        g[0].shape[0], g[1].shape[0], g[0].shape[1], g[1].shape[1],
        int(p[0].reverse), int(p[1].reverse), flags, status, hidden, float(clip),
    ]  # fmt: skip
    consts = dict(CELL=_cell_id(cell), BLOCK_K=next_power_of_2(hidden), XCOPY=kind != torch.float32)
    return args, consts, status


def _forward_buffers(cell: Cell, dirs: list[Direction], save: bool) -> list:
    hidden = dirs[0].w.shape[-1]
    outs = []
    for d in dirs:
        n_rows, steps, _ = d.gi.shape
        hs = d.gi.new_empty(n_rows, steps, hidden, dtype=torch.float32)
        sv = hs.new_empty(n_rows, steps, 4 * hidden) if cell == "gru" and save else None
        outs.append((hs, sv))
    return outs


def _backward_buffers(cell: Cell, states: list) -> list:
    bufs = []
    for hs, _ in states:
        n_rows, steps, hidden = hs.shape
        dgh = hs.new_empty(n_rows, steps, GATES[cell] * hidden)
        dgi = torch.empty_like(dgh) if cell == "gru" else dgh
        bufs.append((dgh, dgi, hs.new_empty(n_rows, hidden), hs.new_empty(n_rows, hidden)))
    return bufs


def forward(
    cell: Cell, clip: float, dirs: list[Direction], save: bool, mode: Mode, cfg: KernelConfig
) -> list[tuple[Tensor, Tensor | None]]:
    """States (N, T, H) float32 and, with `save`, the GRU gates (N, T, 4H) per direction."""
    outs = _forward_buffers(cell, dirs, save)
    hidden = dirs[0].w.shape[-1]
    programs = cfg.programs(hidden, len(dirs))
    args, consts, status = _forward_args(cell, clip, dirs, outs, save, programs)
    consts.update(_tiling(cfg, hidden, dirs[0].w.dtype))
    steps = max(d.gi.shape[1] for d in dirs)
    kernel = kernels.recurrence_forward_kernel
    timeout = _timeout_ns(cfg)
    if mode == "persistent":
        run = [*args, 0, steps, timeout]
        _launch(kernel, programs, run, dict(consts, BARRIER=True), cfg, True)
        _raise_on_timeout(status, "forward")
    else:
        for s in range(steps):
            run = [*args, s, s + 1, timeout]
            _launch(kernel, programs, run, dict(consts, BARRIER=False), cfg, False)
    return outs


def backward(
    cell: Cell, clip: float, dirs: list[Direction], douts: list[Tensor],
    states: list[tuple[Tensor, Tensor | None]], mode: Mode, cfg: KernelConfig,
) -> list[tuple[Tensor, Tensor, Tensor]]:  # fmt: skip
    """dgi, dgh (N, T, G*H) and dL/dh0 (N, H), float32, per direction (douts contiguous)."""
    bufs = _backward_buffers(cell, states)
    dirs = [dataclasses.replace(d, w=d.w.transpose(1, 2).contiguous()) for d in dirs]  # W_hh^T
    hidden = dirs[0].w.shape[-1]
    programs = cfg.programs(hidden, len(dirs))
    args, consts, status = _backward_args(cell, clip, dirs, douts, states, bufs, programs)
    consts.update(_tiling(cfg, hidden, dirs[0].w.dtype))
    steps = max(d.shape[1] for d in douts)
    kernel = kernels.recurrence_backward_kernel
    timeout = _timeout_ns(cfg)
    if mode == "persistent":
        run = [*args, steps, 0, timeout]
        _launch(kernel, programs, run, dict(consts, BARRIER=True, FINAL=True), cfg, True)
        _raise_on_timeout(status, "backward")
    else:
        for s in reversed(range(steps)):
            run = [*args, s + 1, s, timeout]
            _launch(kernel, programs, run, dict(consts, BARRIER=False, FINAL=False), cfg, False)
        run = [*args, 0, 0, timeout]
        _launch(kernel, programs, run, dict(consts, BARRIER=False, FINAL=True), cfg, False)
    return [(dgi, dgh, dh0) for dgh, dgi, _, dh0 in bufs]


def _raise_on_timeout(status: Tensor, what: str) -> None:
    if int(status.item()):  # the one host sync per launch: the result is unusable if set
        raise PersistentKernelError(
            f"persistent {what} launch timed out at its grid barrier (programs not co-resident?)"
        )


# ---- the barrier on its own (tests, scripts/gpu_check.sh) ------------------------------


def barrier_oracle(
    programs: int, rounds: int, device, timeout_s: float = 1.0, delay_ns: int = 0
) -> dict:
    """Run kernels.barrier_oracle_kernel with `programs` co-resident programs: what each
    program missed (a list, all 0 for a barrier that works), the polls of each one's
    last wait, and whether the launch aborted."""
    cfg = KernelConfig(block_h=1, num_warps=4, timeout_s=timeout_s)
    slices = next_power_of_2(programs)
    slots = torch.full((2 * slices,), -1, dtype=torch.int32, device=device)
    missing = torch.zeros(programs, dtype=torch.int32, device=device)
    polls = torch.zeros(programs, dtype=torch.int32, device=device)
    flags, status = _barrier_flags(torch.device(device), programs)
    args = [slots, missing, polls, flags, status, rounds, _timeout_ns(cfg), delay_ns]
    _launch(kernels.barrier_oracle_kernel, programs, args, dict(SLICES=slices), cfg, True)
    return {"missing": missing.tolist(), "polls": polls.tolist(), "aborted": int(status.item())}


def barrier_abort(programs: int, device, timeout_s: float = 1.0) -> dict:
    """Run kernels.barrier_abort_kernel: every program aborts the launch (twice), then
    waits at a barrier that cannot complete. The abort flag must read 1 and every wait
    end at its first look (0 polls); an abort that added to the flag would wrap to 0
    with 4 programs x 2 x 2**30 and leave each wait to its full timeout."""
    cfg = KernelConfig(block_h=1, num_warps=4, timeout_s=timeout_s)
    flags, status = _barrier_flags(torch.device(device), programs)
    polls = torch.zeros(programs, dtype=torch.int32, device=device)
    args = [status, flags, polls, _timeout_ns(cfg)]
    slices = dict(SLICES=next_power_of_2(programs))
    _launch(kernels.barrier_abort_kernel, programs, args, slices, cfg, True)
    return {"status": int(status.item()), "polls": polls.tolist()}


# ---- resources: on the GPU before a launch, or offline for a target --------------


def _placeholders(
    cell: Cell, dtype: torch.dtype, hidden: int, directions: int, device, programs: int, n=2
):
    """Small inputs of the right dtypes for compiling both kernels of one configuration."""
    g = GATES[cell]
    f32 = dict(dtype=torch.float32, device=device)
    dirs = [
        Direction(
            gi=torch.zeros(n, n, g * hidden, dtype=dtype, device=device),
            h0=torch.zeros(n, hidden, **f32),
            lengths=torch.full((n,), n, dtype=torch.int32, device=device),
            w=torch.zeros(g, hidden, hidden, dtype=dtype, device=device),
            b_hn=torch.zeros(hidden, **f32),
            reverse=bool(i),
        )
        for i in range(directions)
    ]
    states = _forward_buffers(cell, dirs, True)
    douts = [torch.zeros(n, n, hidden, dtype=dtype, device=device) for _ in dirs]
    fwd, fc, _ = _forward_args(cell, 20.0, dirs, states, True, programs)
    bufs = _backward_buffers(cell, states)
    bwd, bc, _ = _backward_args(cell, 20.0, dirs, douts, states, bufs, programs)
    return [
        (kernels.recurrence_forward_kernel, [*fwd, 0, n, 1], dict(fc, BARRIER=True)),
        (kernels.recurrence_backward_kernel, [*bwd, n, 0, 1], dict(bc, BARRIER=True, FINAL=True)),
    ]


def check(cell: Cell, dtype: torch.dtype, hidden: int, directions: int, cfg: KernelConfig,
          device: torch.device) -> None:  # fmt: skip
    """Compile both kernels for this GPU and raise PersistentKernelError unless they fit."""
    programs = cfg.programs(hidden, directions)
    for kernel, args, consts in _placeholders(cell, dtype, hidden, directions, device, programs):
        options = _options(cfg, dict(consts, **_tiling(cfg, hidden, dtype)))
        compiled = kernel.warmup(*args, grid=(programs,), launch_cooperative_grid=True, **options)
        _check_resources(compiled, programs, device)


@dataclass(frozen=True)
class Resources:
    kernel: str
    n_regs: int  # registers per thread
    spill_bytes: int  # spill stores + loads per thread, bytes (0: everything stays on chip)
    stack_bytes: int  # stack frame per thread, bytes
    shared: int  # shared memory per program, bytes
    mma: int  # tensor-core instructions in the PTX (mma.sync, wgmma)
    clock_reads: int  # reads of the GPU's global timer in the PTX (the barrier's timeout)


_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                 torch.int32: "i32"}  # fmt: skip


def compile_for_target(cell: Cell, dtype: torch.dtype, hidden: int, directions: int,
                       cfg: KernelConfig, arch: int = 90) -> list[Resources]:  # fmt: skip
    """Compile both kernels for an NVIDIA target without a GPU; resources from `ptxas -v`.

    Pointers and multiples of 16 are specialised as at run time (16-byte aligned).
    """
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    out = []
    programs = cfg.programs(hidden, directions)
    for kernel, args, consts in _placeholders(cell, dtype, hidden, directions, "cpu", programs):
        consts = dict(consts, ASM=True, **_tiling(cfg, hidden, dtype))
        runtime = dict(zip(kernel.arg_names, args, strict=False))  # the rest are constexprs
        signature, attrs = {}, {}
        for i, name in enumerate(kernel.arg_names):
            value = runtime.get(name)
            if name not in runtime:
                signature[name] = "constexpr"
                continue
            if isinstance(value, Tensor):
                signature[name] = "*" + _TRITON_TYPES[value.dtype]
            else:
                signature[name] = "fp32" if isinstance(value, float) else "i32"
            if isinstance(value, Tensor) or name == "H" and hidden % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(kernel, signature, constexprs=consts, attrs=attrs)
        compiled = triton.compile(
            src, target=GPUTarget("cuda", arch, 32), options=_compile_options(cfg)
        )
        target = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "kernel.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            report = subprocess.run(
                [get_ptxas(arch).path, f"-arch={target}", "-v", ptx, "-o", ptx + ".cubin"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
        info = report.stdout + report.stderr
        spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", info)
        stack = re.search(r"(\d+) bytes (?:cumulative )?stack", info)
        out.append(
            Resources(
                kernel=kernel.fn.__name__,
                n_regs=int(re.search(r"Used (\d+) registers", info).group(1)),
                spill_bytes=sum(int(x) for x in spills),
                stack_bytes=int(stack.group(1)) if stack else 0,
                shared=compiled.metadata.shared,
                mma=len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\.", compiled.asm["ptx"])),
                clock_reads=compiled.asm["ptx"].count("%globaltimer"),
            )
        )
    return out
