"""Triton kernels for persistent recurrent layers (Diamos et al. 2016).

One program per slice of BLOCK_H hidden units per direction. A program loads its
slice of the recurrent weights once, before the time loop, and keeps it in
registers for every step; per step it reads the whole previous state of its
direction (from L2), computes its units, writes them, and waits at a grid-wide
barrier of its direction. Both directions of a bidirectional layer run in one
launch, each with its own barrier flags and its own number of rows and steps.

Forward weights are W_hh viewed as (G, H, H) (gate, unit, input unit); backward
weights are the same matrices transposed, so both kernels hold rows of a
(G, H, H) tensor and share one product helper. Products and sums are float32.
What other programs read (the state forward, dgh backward) is exchanged in an
"exchange" buffer: in bfloat16 when the layer computes in bfloat16 (half the
bytes each program reads every step; the tiles round the state to bf16 for the
tensor cores anyway), else the float32 output buffer itself (XCOPY False). The
float32 states and dgh the host keeps are written as well; a program's own units
(the GRU's z * h, its carried gradient) are read back in float32.

A program computes its units for the batch rows in one of two ways (BLOCK_B):

- BLOCK_B = 1: one row at a time, a matrix-vector product on the CUDA cores
  (weights held as (BLOCK_H, H)), any dtype.
- BLOCK_B >= 16: BLOCK_B rows at once on the tensor cores (16-bit weights only).
  H is split into KS chunks, one per warp: the weights are held as a (KS, H/KS,
  BLOCK_H) operand, the rows' states are read as (KS, BLOCK_B, H/KS), one batched
  `tl.dot` gives (KS, BLOCK_B, BLOCK_H) partial sums and a sum over KS the product.
  Up to BLOCK_B rows cost one read of the state and one product instead of
  BLOCK_B of each, which is what a small batch needs (Diamos et al.'s regime).

Everything else (addressing, the cell's elementwise math, the barrier) is the same
code for both: a row index is a scalar in the first mode and a (BLOCK_B,) vector
in the second, and the helpers broadcast either way.

Row n of a direction takes step s at time position `_position(s, L_n)`: s, or for
a reversed direction L_n - 1 - s while s < L_n (positions past the length stay
put), which is `flip, run, flip back` within each row's length in one pass.

The barrier is split in two, after Diamos et al.: `_arrive` as soon as a
program's part of the exchanged data for the step is written (inside the loop
over row tiles, after the last tile's exchange stores and before the stores that
no other program reads: the GRU's saved gates, backward's dgi), and `_wait` after
the rest of the step. Each program has its own flag (int32, one per program of a
direction, side by side in one small buffer) that it sets to the number of steps
it has finished, with release semantics, by an atomic exchange: no two programs
write one address and nothing is added up, so nothing can overflow. A wait polls
the flags of its direction with one thread per program (a vector atomic load,
acquire, gpu scope) until every one has reached the step, then a CTA barrier
passes the result to the whole program.

A wait that has not completed `timeout_ns` after it began (the GPU's global
timer, %globaltimer) aborts: `status[0]` is set to 1 by an atomic max, which
stays 1 however many programs time out at once, and every wait polls that flag
too, so all other programs of the launch stop at their next poll instead of
running into their own timeouts; the host sees the flag. The Triton interpreter
runs no inline asm and has no clock: there each poll counts as
INTERPRETER_POLL_NS. Co-residency of the grid is the host's job (grid no larger
than SMs * resident blocks per SM, cooperative launch); the timeout makes a
mistake there a clean error instead of a hang.

`BARRIER=False` runs the steps [s_begin, s_end) without any barrier: the host
launches once per step and the launch boundary is the barrier. That mode holds
the same per-step math and is what the Triton interpreter checks (it runs
programs one after another, so a grid barrier across programs cannot complete).
"""

from __future__ import annotations

import triton
import triton.language as tl

RNN = tl.constexpr(0)  # CELL values
GRU = tl.constexpr(1)
INTERPRETER_POLL_NS = tl.constexpr(1000)  # what one barrier poll counts as without a clock

# The integer arguments that change from launch to launch (rows, steps, the step range,
# the timeout, the direction flags). Triton would otherwise compile a variant per value
# class (1, a multiple of 16, anything else), and `launch.check`, which compiles with
# small placeholder values, would prove a variant that is not the one launched: on an
# H200 the placeholders' variant kept its weights in registers and the launched one
# spilled. One variant for all values makes the check, the launch and the offline
# sm_90 tables (`launch.compile_for_target`, plain i32) compile the same code. H stays
# specialised (the same value in all three; its multiple of 16 aligns the loads).
RUNTIME_INTS = (
    "n_rows0", "n_rows1", "steps0", "steps1", "reverse0", "reverse1", "timeout_ns",
)  # fmt: skip


@triton.jit
def _pick(d, a, b):
    """Argument a for direction 0, b for direction 1."""
    if d == 0:
        out = a
    else:
        out = b
    return out


@triton.jit
def _position(s, length, reverse):
    """Time position of step s in a row of the given length (see the module docstring)."""
    return tl.where((reverse != 0) & (s < length), length - 1 - s, s)


@triton.jit
def _widen(w, ASM: tl.constexpr):
    """w as float32, converted where it is used.

    A plain `w.to(float32)` of loop-invariant weights is hoisted out of the time
    loop by the compiler, which then holds float32 copies: twice the registers of
    16-bit weights. The conversion is therefore an inline-asm op with side effects,
    which nothing hoists (the interpreter, which runs no asm, gets `.to`).
    """
    if ASM and w.dtype == tl.bfloat16:  # two bf16 per register: shift, mask
        out = tl.inline_asm_elementwise(
            "shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;",
            "=r,=r,r", [w], dtype=tl.float32, is_pure=False, pack=2,
        )  # fmt: skip
    elif ASM and w.dtype == tl.float16:
        out = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            "=r,=r,r", [w], dtype=tl.float32, is_pure=False, pack=2,
        )  # fmt: skip
    else:
        out = w.to(tl.float32)
    return out


@triton.jit
def _matvec(w, v, ASM: tl.constexpr):
    """(BLOCK_H, BLOCK_K) weights of any float dtype times (BLOCK_K,) float32 -> (BLOCK_H,)."""
    return tl.sum(_widen(w, ASM) * v[None, :], axis=1)


@triton.jit
def _shared(ptr, mask):
    """Load what other programs of this launch wrote: from L2 (.cg), as L1 is not coherent."""
    return tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def _now(polls, ASM: tl.constexpr):
    """ns on the GPU's global timer; in the interpreter, `polls` * INTERPRETER_POLL_NS."""
    if ASM:
        out = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        out = polls.to(tl.int64) * INTERPRETER_POLL_NS
    return out


@triton.jit
def _arrive(flag, step):
    """This program has finished `step` steps (1, 2, ...): its flag says so, after every
    thread's stores of the step (the CTA barrier) and with release semantics."""
    tl.debug_barrier()
    tl.atomic_xchg(flag, step, sem="release", scope="gpu")


@triton.jit
def _abort(status):
    """Flag a failed wait: an atomic max to 1, the same whether one or every program
    calls it (never an addition that can wrap round)."""
    tl.atomic_max(status, 1, sem="relaxed", scope="gpu")


@triton.jit
def _wait(flags, count, status, step, timeout_ns, SLICES: tl.constexpr, ASM: tl.constexpr):
    """Wait until all `count` flags from `flags` on have reached `step` (one thread a
    flag), the launch is aborted, or `timeout_ns` have passed (then abort it).
    Returns (failed: 1 or 0, polls after the first look)."""
    lanes = tl.arange(0, SLICES)
    mask = lanes < count
    seen = tl.atomic_add(flags + lanes, 0, mask=mask, sem="acquire", scope="gpu")
    done = (tl.min(tl.where(mask, seen, step), axis=0) >= step).to(tl.int32)
    aborted = tl.atomic_add(status, 0, sem="relaxed", scope="gpu")
    polls = tl.zeros((), tl.int32)
    start = _now(polls, ASM)
    waited = _now(polls, ASM) - start
    while (done == 0) & (aborted == 0) & (waited < timeout_ns):
        seen = tl.atomic_add(flags + lanes, 0, mask=mask, sem="acquire", scope="gpu")
        done = (tl.min(tl.where(mask, seen, step), axis=0) >= step).to(tl.int32)
        aborted = tl.atomic_add(status, 0, sem="relaxed", scope="gpu")
        polls += 1
        waited = _now(polls, ASM) - start
    if (done == 0) & (aborted == 0):
        _abort(status)
    tl.debug_barrier()  # no thread reads the step's data before the whole wait is over
    return 1 - done, polls


@triton.jit
def _spin(ns, ASM: tl.constexpr):
    """Busy-wait about `ns` on the GPU (nothing in the interpreter)."""
    if ASM:
        start = _now(0, ASM)
        while _now(0, ASM) - start < ns:
            pass


@triton.jit
def barrier_oracle_kernel(
    slots,  # int32 (2, SLICES) scratch: each program's id, a row per round parity
    missing,  # int32 (programs,) out: ids this program did not see after the barrier
    polls,  # int32 (programs,) out: polls the last wait took (0: it passed at once)
    flags, status,  # int32 (programs,) zeroed, int32 (1,) zeroed: as in the kernels
    rounds, timeout_ns, delay_ns,
    SLICES: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """The barrier's test: each round, each program writes its id (and the round) into
    its slot, meets the others at the barrier, and reads every slot; a slot without the
    id it should hold is a program the barrier did not wait for. One program a round
    (round % programs) sleeps `delay_ns` first, so a barrier that does not wait loses."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    lanes = tl.arange(0, SLICES)
    mask = lanes < n
    lost = tl.zeros((), tl.int32)
    failed = tl.zeros((), tl.int32)
    waits = tl.zeros((), tl.int32)
    r = 0
    while (r < rounds) & (failed == 0):
        if r % n == pid:
            _spin(delay_ns, ASM)
        row = slots + (r % 2) * SLICES
        tl.store(row + pid, r * n + pid)
        _arrive(flags + pid, r + 1)
        failed, waits = _wait(flags, n, status, r + 1, timeout_ns, SLICES, ASM)
        got = tl.load(row + lanes, mask=mask, other=-1, cache_modifier=".cg")
        lost += tl.sum(((got != r * n + lanes) & mask & (failed == 0)).to(tl.int32), axis=0)
        r += 1
    tl.store(missing + pid, lost)
    tl.store(polls + pid, waits)


@triton.jit
def barrier_abort_kernel(status, flags, polls, timeout_ns, SLICES: tl.constexpr,
                         ASM: tl.constexpr):  # fmt: skip
    """Every program aborts the launch, then waits at a barrier that nobody else reaches:
    with the launch aborted, each wait must end at its first look (0 polls)."""
    pid = tl.program_id(0)
    _abort(status)
    _abort(status)
    _arrive(flags + pid, 1)
    failed, waits = _wait(flags, tl.num_programs(0), status, 2, timeout_ns, SLICES, ASM)
    tl.store(polls + pid, waits * failed)


@triton.jit
def _load_weights(w_ptr, H, units, umask, BLOCK_K: tl.constexpr, KS: tl.constexpr,
                  BLOCK_B: tl.constexpr, CELL: tl.constexpr):  # fmt: skip
    """The program's units' rows of each gate's matrix in a (G, H, H) tensor (one gate:
    thrice): (BLOCK_H, BLOCK_K) for matrix-vector products, (KS, BLOCK_K / KS, BLOCK_H)
    (the chunks of H by unit, a dot's right operand) for tensor-core tiles."""
    if BLOCK_B == 1:
        cols = tl.arange(0, BLOCK_K)
        offs = units[:, None] * H + cols[None, :]
        mask = umask[:, None] & (cols < H)[None, :]
    else:
        k = tl.arange(0, KS)[:, None, None] * (BLOCK_K // KS)
        k += tl.arange(0, BLOCK_K // KS)[None, :, None]  # (KS, KC, 1)
        offs = units[None, None, :] * H + k
        mask = umask[None, None, :] & (k < H)
    w_a = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if CELL == GRU:
        w_b = tl.load(w_ptr + H * H + offs, mask=mask, other=0.0)
        w_c = tl.load(w_ptr + 2 * H * H + offs, mask=mask, other=0.0)
    else:
        w_b, w_c = w_a, w_a
    return w_a, w_b, w_c


@triton.jit
def _rows(first, n_rows, lens, BLOCK_B: tl.constexpr):
    """The batch rows from `first` on that one pass computes: (row, length, valid), as
    scalars (BLOCK_B = 1) or (BLOCK_B,) vectors."""
    if BLOCK_B == 1:
        row = tl.cast(first, tl.int64)
        length = tl.load(lens + first)
        valid = first < n_rows
    else:
        row = first + tl.arange(0, BLOCK_B)
        valid = row < n_rows
        length = tl.load(lens + row, mask=valid, other=0)
        row = row.to(tl.int64)
    return row, length, valid


@triton.jit
def _by_unit(x, BLOCK_B: tl.constexpr):
    """A per-row value (scalar or (BLOCK_B,)) made to broadcast against the units."""
    if BLOCK_B == 1:
        out = x
    else:
        out = x[:, None]
    return out


@triton.jit
def _tile_mask(valid, umask, BLOCK_B: tl.constexpr):
    """Which (row, unit) elements exist: (BLOCK_H,) or (BLOCK_B, BLOCK_H)."""
    if BLOCK_B == 1:
        out = umask
    else:
        out = valid[:, None] & umask[None, :]
    return out


@triton.jit
def _source(base, valid, H, w, BLOCK_K: tl.constexpr, KS: tl.constexpr, BLOCK_B: tl.constexpr):
    """A whole H-vector per row that other programs wrote (from L2, the exchange buffer),
    as the product with w needs it: (BLOCK_K,) float32, or (KS, BLOCK_B, BLOCK_K / KS)
    in w's dtype."""
    if BLOCK_B == 1:
        cols = tl.arange(0, BLOCK_K)
        out = _shared(base + cols, cols < H).to(tl.float32)
    else:
        k = tl.arange(0, KS)[:, None, None] * (BLOCK_K // KS)
        k += tl.arange(0, BLOCK_K // KS)[None, None, :]  # (KS, 1, KC)
        mask = valid[None, :, None] & (k < H)
        out = _shared(base[None, :, None] + k, mask).to(w.dtype)
    return out


@triton.jit
def _product(src, w, ASM: tl.constexpr, BLOCK_B: tl.constexpr):
    """W_slice times each row's vector: (BLOCK_H,) or (BLOCK_B, BLOCK_H) float32."""
    if BLOCK_B == 1:
        out = _matvec(w, src, ASM)
    else:
        out = tl.sum(tl.dot(src, w), axis=0)  # (KS, BLOCK_B, BLOCK_H) partial sums over H
    return out


@triton.jit
def _gates_product(g, valid, w_a, w_b, w_c, H, BLOCK_K: tl.constexpr, KS: tl.constexpr,
                   CELL: tl.constexpr, ASM: tl.constexpr, BLOCK_B: tl.constexpr):  # fmt: skip
    """sum over gates of W_g^T dg_g for each row's dgh (G*H floats from g)."""
    acc = _product(_source(g, valid, H, w_a, BLOCK_K, KS, BLOCK_B), w_a, ASM, BLOCK_B)
    if CELL == GRU:
        acc += _product(_source(g + H, valid, H, w_b, BLOCK_K, KS, BLOCK_B), w_b, ASM, BLOCK_B)
        acc += _product(_source(g + 2 * H, valid, H, w_c, BLOCK_K, KS, BLOCK_B), w_c, ASM, BLOCK_B)
    return acc


@triton.jit
def _store_gates(out_h, out_x, g_a, g_b, g_c, H, mask, CELL: tl.constexpr, XCOPY: tl.constexpr):
    """One step's dgh (one gate, or three) in float32 and, with XCOPY, in the exchange dtype."""
    tl.store(out_h, g_a, mask=mask)
    if CELL == GRU:
        tl.store(out_h + H, g_b, mask=mask)
        tl.store(out_h + 2 * H, g_c, mask=mask)
    if XCOPY:
        kind = out_x.dtype.element_ty
        tl.store(out_x, g_a.to(kind), mask=mask)
        if CELL == GRU:
            tl.store(out_x + H, g_b.to(kind), mask=mask)
            tl.store(out_x + 2 * H, g_c.to(kind), mask=mask)


@triton.jit(do_not_specialize=(*RUNTIME_INTS, "s_begin", "s_end"))
def recurrence_forward_kernel(
    gi0, gi1,  # (N, T, G*H) input projections incl. the folded biases, compute dtype
    h00, h01,  # (N, H) float32 initial states
    x00, x01,  # (N, H) initial states in the exchange dtype (h00, h01 without XCOPY)
    len0, len1,  # (N,) int32 valid steps per row
    w0, w1,  # (G, H, H) recurrent weights, compute dtype
    bn0, bn1,  # (H,) float32 b_hn (GRU only)
    hs0, hs1,  # (N, T, H) float32 out: the state after each position
    xs0, xs1,  # (N, T, H) out: the same states in the exchange dtype (hs0, hs1 without XCOPY)
    sv0, sv1,  # (N, T, 4H) float32 out: r, z, n, W_hn h + b_hn (GRU, SAVE only)
    n_rows0, n_rows1, steps0, steps1, reverse0, reverse1,
    flags, status,  # int32 (programs,) barrier flags (zeroed), int32 (1,) abort flag
    H, clip, s_begin, s_end, timeout_ns,
    CELL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr, KS: tl.constexpr, SLICES: tl.constexpr,
    SAVE: tl.constexpr, BARRIER: tl.constexpr, XCOPY: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Steps s_begin to min(s_end, T) - 1 of each direction."""
    slices = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    d = pid // slices
    units = (pid % slices) * BLOCK_H + tl.arange(0, BLOCK_H)
    umask = units < H
    gi, h0, lens = _pick(d, gi0, gi1), _pick(d, h00, h01), _pick(d, len0, len1)
    x0, xs = _pick(d, x00, x01), _pick(d, xs0, xs1)
    hs, sv, bn = _pick(d, hs0, hs1), _pick(d, sv0, sv1), _pick(d, bn0, bn1)
    n_rows, steps = _pick(d, n_rows0, n_rows1), _pick(d, steps0, steps1)
    reverse = _pick(d, reverse0, reverse1)
    mine = flags + d * slices  # this direction's flags
    G = 1 + 2 * CELL
    # Loaded once: the weight slice stays in registers for every step below.
    w = _pick(d, w0, w1)
    w_a, w_b, w_c = _load_weights(w, H, units, umask, BLOCK_K, KS, BLOCK_B, CELL)
    b_n = tl.load(bn + units, mask=umask, other=0.0)

    s = s_begin
    s_stop = tl.minimum(s_end, steps)
    failed = tl.zeros((), tl.int32)
    while (s < s_stop) & (failed == 0):
        for first in range(0, n_rows, BLOCK_B):
            row, length, valid = _rows(first, n_rows, lens, BLOCK_B)
            at = row * steps + _position(s, length, reverse)
            if s == 0:
                prev = h0 + row * H
                prev_x = x0 + row * H
            else:
                before = (row * steps + _position(s - 1, length, reverse)) * H
                prev = hs + before
                prev_x = xs + before
            src = _source(prev_x, valid, H, w_a, BLOCK_K, KS, BLOCK_B)  # the previous states
            mask = _tile_mask(valid, umask, BLOCK_B)
            at_u = _by_unit(at, BLOCK_B)
            x = gi + at_u * (G * H) + units
            a = tl.load(x, mask=mask, other=0.0).to(tl.float32) + _product(src, w_a, ASM, BLOCK_B)
            if CELL == GRU:
                r = tl.sigmoid(a)
                z = tl.load(x + H, mask=mask, other=0.0).to(tl.float32)
                z = tl.sigmoid(z + _product(src, w_b, ASM, BLOCK_B))
                hn = _product(src, w_c, ASM, BLOCK_B) + b_n
                a_n = tl.load(x + 2 * H, mask=mask, other=0.0).to(tl.float32) + r * hn
                n = 2.0 * tl.sigmoid(2.0 * a_n) - 1.0  # tanh
                h = (1.0 - z) * n + z * _shared(_by_unit(prev, BLOCK_B) + units, mask)
            else:
                h = tl.minimum(tl.maximum(a, 0.0), clip)
            tl.store(hs + at_u * H + units, h, mask=mask)
            if XCOPY:
                tl.store(xs + at_u * H + units, h.to(xs.dtype.element_ty), mask=mask)
            if BARRIER:
                if first + BLOCK_B >= n_rows:  # the program's last rows: its part is out
                    _arrive(mine + pid % slices, s - s_begin + 1)
            if CELL == GRU:
                if SAVE:  # read by backward only, so after the arrival
                    keep = sv + at_u * (4 * H) + units
                    tl.store(keep, r, mask=mask)
                    tl.store(keep + H, z, mask=mask)
                    tl.store(keep + 2 * H, n, mask=mask)
                    tl.store(keep + 3 * H, hn, mask=mask)
        if BARRIER:
            failed, _ = _wait(mine, slices, status, s - s_begin + 1, timeout_ns, SLICES, ASM)
        s += 1


@triton.jit(do_not_specialize=(*RUNTIME_INTS, "s_hi", "s_lo"))
def recurrence_backward_kernel(
    dout0, dout1,  # (N, T, H) gradient of the outputs, compute dtype
    hs0, hs1,  # (N, T, H) float32 states from the forward kernel
    sv0, sv1,  # (N, T, 4H) float32 saved gates (GRU)
    h00, h01,  # (N, H) float32 initial states
    len0, len1,  # (N,) int32
    wt0, wt1,  # (G, H, H) transposed recurrent weights, compute dtype
    dgh0, dgh1,  # (N, T, G*H) float32 out: gradient of W_hh h + b_hh
    dgx0, dgx1,  # (N, T, G*H) out: dgh in the exchange dtype (dgh0, dgh1 without XCOPY)
    dgi0, dgi1,  # (N, T, G*H) float32 out: gradient of the input projections (GRU)
    carry0, carry1,  # (N, H) float32 scratch: dL/dh after the step just done (GRU)
    dh00, dh01,  # (N, H) float32 out: gradient of the initial states (FINAL)
    n_rows0, n_rows1, steps0, steps1, reverse0, reverse1,
    flags, status,
    H, clip, s_hi, s_lo, timeout_ns,
    CELL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr, KS: tl.constexpr, SLICES: tl.constexpr,
    BARRIER: tl.constexpr, FINAL: tl.constexpr, XCOPY: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Steps min(s_hi, T) - 1 down to s_lo; with FINAL, then the gradient of h0.

    Step s needs the whole of dgh at step s + 1 (written by every program of the
    direction during the previous iteration), so one barrier per step suffices.
    """
    slices = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    d = pid // slices
    units = (pid % slices) * BLOCK_H + tl.arange(0, BLOCK_H)
    umask = units < H
    dout, hs, sv = _pick(d, dout0, dout1), _pick(d, hs0, hs1), _pick(d, sv0, sv1)
    h0, lens = _pick(d, h00, h01), _pick(d, len0, len1)
    dgh, dgi, carry = _pick(d, dgh0, dgh1), _pick(d, dgi0, dgi1), _pick(d, carry0, carry1)
    dgx = _pick(d, dgx0, dgx1)
    dh0 = _pick(d, dh00, dh01)
    n_rows, steps = _pick(d, n_rows0, n_rows1), _pick(d, steps0, steps1)
    reverse = _pick(d, reverse0, reverse1)
    mine = flags + d * slices
    G = 1 + 2 * CELL
    wt = _pick(d, wt0, wt1)
    w_a, w_b, w_c = _load_weights(wt, H, units, umask, BLOCK_K, KS, BLOCK_B, CELL)

    s = tl.minimum(s_hi, steps) - 1
    done = 0
    failed = tl.zeros((), tl.int32)
    while (s >= s_lo) & (failed == 0):
        for first in range(0, n_rows, BLOCK_B):
            row, length, valid = _rows(first, n_rows, lens, BLOCK_B)
            mask = _tile_mask(valid, umask, BLOCK_B)
            row_u = _by_unit(row, BLOCK_B) * H + units  # this program's units of a row's H
            at = row * steps + _position(s, length, reverse)
            at_u = _by_unit(at, BLOCK_B)
            dh = tl.load(dout + at_u * H + units, mask=mask, other=0.0).to(tl.float32)
            if s + 1 < steps:  # the recurrent gradient from the step after
                nxt = row * steps + _position(s + 1, length, reverse)
                dh += _gates_product(
                    dgx + nxt * (G * H), valid, w_a, w_b, w_c, H, BLOCK_K, KS, CELL, ASM, BLOCK_B
                )
                if CELL == GRU:
                    z_next = tl.load(
                        sv + _by_unit(nxt, BLOCK_B) * (4 * H) + H + units, mask=mask, other=0.0
                    )
                    dh += z_next * tl.load(carry + row_u, mask=mask, other=0.0)
            out_h = dgh + at_u * (G * H) + units
            out_x = dgx + at_u * (G * H) + units
            if CELL == GRU:
                tl.store(carry + row_u, dh, mask=mask)
                if s == 0:
                    prev = h0 + row * H
                else:
                    prev = hs + (row * steps + _position(s - 1, length, reverse)) * H
                h_prev = tl.load(_by_unit(prev, BLOCK_B) + units, mask=mask, other=0.0)
                keep = sv + at_u * (4 * H) + units
                r = tl.load(keep, mask=mask, other=0.0)
                z = tl.load(keep + H, mask=mask, other=0.0)
                n = tl.load(keep + 2 * H, mask=mask, other=0.0)
                hn = tl.load(keep + 3 * H, mask=mask, other=0.0)
                d_an = dh * (1.0 - z) * (1.0 - n * n)
                d_ar = d_an * hn * r * (1.0 - r)
                d_az = dh * (h_prev - n) * z * (1.0 - z)
                _store_gates(out_h, out_x, d_ar, d_az, d_an * r, H, mask, CELL, XCOPY)
            else:
                h = tl.load(hs + at_u * H + units, mask=mask, other=0.0)
                d_a = tl.where((h > 0.0) & (h < clip), dh, 0.0)
                _store_gates(out_h, out_x, d_a, d_a, d_a, H, mask, CELL, XCOPY)
            if BARRIER:
                if first + BLOCK_B >= n_rows:  # the program's last rows: its part is out
                    _arrive(mine + pid % slices, done + 1)
            if CELL == GRU:  # dgi: read by the host's GEMMs only, so after the arrival
                out_i = dgi + at_u * (3 * H) + units
                tl.store(out_i, d_ar, mask=mask)
                tl.store(out_i + H, d_az, mask=mask)
                tl.store(out_i + 2 * H, d_an, mask=mask)
        if BARRIER:
            done += 1
            failed, _ = _wait(mine, slices, status, done, timeout_ns, SLICES, ASM)
        s -= 1

    if FINAL:  # dL/dh0 = W^T dgh(step 0) (+ z * dh for the GRU); skipped after a timeout
        for first in range(0, n_rows * (failed == 0).to(tl.int32), BLOCK_B):
            row, length, valid = _rows(first, n_rows, lens, BLOCK_B)
            mask = _tile_mask(valid, umask, BLOCK_B)
            row_u = _by_unit(row, BLOCK_B) * H + units
            at = row * steps + _position(0, length, reverse)
            acc = _gates_product(
                dgx + at * (G * H), valid, w_a, w_b, w_c, H, BLOCK_K, KS, CELL, ASM, BLOCK_B
            )
            if CELL == GRU:
                z0 = tl.load(sv + _by_unit(at, BLOCK_B) * (4 * H) + H + units, mask=mask, other=0.0)
                acc += z0 * tl.load(carry + row_u, mask=mask, other=0.0)
            tl.store(dh0 + row_u, acc, mask=mask)
