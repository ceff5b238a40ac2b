"""Triton kernels for persistent recurrent layers (Diamos et al. 2016).

One program per slice of BLOCK_H hidden units per direction. A program loads its
slice of the recurrent weights once, before the time loop, and keeps it in
registers for every step; per step it reads the whole previous state of its
direction (from L2), computes its units, writes them, and waits at a grid-wide
barrier of its direction. Both directions of a bidirectional layer run in one
launch, each with its own barrier counter and its own number of rows and steps.

Forward weights are W_hh viewed as (G, H, H) (gate, unit, input unit); backward
weights are the same matrices transposed, so both kernels hold rows of a
(G, H, H) tensor and share one matrix-vector helper. The state is exchanged in
float32 whatever the compute dtype; products and sums are float32.

Row n of a direction takes step s at time position `_position(s, L_n)`: s, or for
a reversed direction L_n - 1 - s while s < L_n (positions past the length stay
put), which is `flip, run, flip back` within each row's length in one pass.

The barrier (`_grid_barrier`) is a monotonic per-direction counter: each program
adds 1 with release semantics after a CTA barrier, then polls (atomic add of 0,
acquire, gpu scope; Triton issues it from one thread and broadcasts the value, so
the whole program takes the same branch) until the counter reaches (steps done) *
(programs of the direction). A wait that runs past `spin_limit` polls sets
`status[0] = 1` and adds POISON to the counter,
which releases every other program of that direction at once; all of them stop,
and the host sees the flag. Co-residency of the grid is the host's job (grid no
larger than SMs * resident blocks per SM, cooperative launch); the timeout makes
a mistake there a clean error instead of a hang.

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
POISON = tl.constexpr(1 << 30)  # added to a barrier counter when a program gives up waiting


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
def _grid_barrier(counter, status, target, spin_limit):
    """Wait until `target` arrivals at `counter`; returns 1 if the wait failed, else 0."""
    tl.debug_barrier()  # all threads' stores of this step come before the release
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")  # a poll that any Triton has
    spins = 0
    while (seen < target) & (spins < spin_limit):
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        spins += 1
    timed_out = seen < target
    if timed_out:
        tl.atomic_xchg(status, 1, sem="relaxed", scope="gpu")
        tl.atomic_add(counter, POISON, sem="relaxed", scope="gpu")
    tl.debug_barrier()
    return ((seen >= POISON) | timed_out).to(tl.int32)


@triton.jit
def _load_weights(w_ptr, H, rows, cols, mask, CELL: tl.constexpr):
    """The program's rows of each gate's matrix in a (G, H, H) tensor (one gate: thrice)."""
    offs = rows[:, None] * H + cols[None, :]
    w_a = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if CELL == GRU:
        w_b = tl.load(w_ptr + H * H + offs, mask=mask, other=0.0)
        w_c = tl.load(w_ptr + 2 * H * H + offs, mask=mask, other=0.0)
    else:
        w_b, w_c = w_a, w_a
    return w_a, w_b, w_c


@triton.jit
def _gates_matvec(g, w_a, w_b, w_c, H, cols, cmask, CELL: tl.constexpr, ASM: tl.constexpr):
    """sum over gates of W_g^T dg_g for one row of dgh (G*H floats at g)."""
    acc = _matvec(w_a, _shared(g + cols, cmask), ASM)
    if CELL == GRU:
        acc += _matvec(w_b, _shared(g + H + cols, cmask), ASM)
        acc += _matvec(w_c, _shared(g + 2 * H + cols, cmask), ASM)
    return acc


@triton.jit
def recurrence_forward_kernel(
    gi0, gi1,  # (N, T, G*H) input projections incl. the folded biases, compute dtype
    h00, h01,  # (N, H) float32 initial states
    len0, len1,  # (N,) int32 valid steps per row
    w0, w1,  # (G, H, H) recurrent weights, compute dtype
    bn0, bn1,  # (H,) float32 b_hn (GRU only)
    hs0, hs1,  # (N, T, H) float32 out: the state after each position
    sv0, sv1,  # (N, T, 4H) float32 out: r, z, n, W_hn h + b_hn (GRU, SAVE only)
    n_rows0, n_rows1, steps0, steps1, reverse0, reverse1,
    sync, status,  # int32 (2,) barrier counters (zeroed), int32 (1,) timeout flag
    H, clip, s_begin, s_end, spin_limit,
    CELL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    SAVE: tl.constexpr, BARRIER: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Steps s_begin to min(s_end, T) - 1 of each direction."""
    slices = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    d = pid // slices
    rows = (pid % slices) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_K)
    rmask, cmask = rows < H, cols < H
    gi, h0, lens = _pick(d, gi0, gi1), _pick(d, h00, h01), _pick(d, len0, len1)
    hs, sv, bn = _pick(d, hs0, hs1), _pick(d, sv0, sv1), _pick(d, bn0, bn1)
    n_rows, steps = _pick(d, n_rows0, n_rows1), _pick(d, steps0, steps1)
    reverse = _pick(d, reverse0, reverse1)
    G = 1 + 2 * CELL
    # Loaded once: the weight slice stays in registers for every step below.
    wmask = rmask[:, None] & cmask[None, :]
    w_a, w_b, w_c = _load_weights(_pick(d, w0, w1), H, rows, cols, wmask, CELL)
    b_n = tl.load(bn + rows, mask=rmask, other=0.0)

    s = s_begin
    s_stop = tl.minimum(s_end, steps)
    failed = tl.zeros((), tl.int32)
    while (s < s_stop) & (failed == 0):
        for b in range(n_rows):
            row = tl.cast(b, tl.int64)
            length = tl.load(lens + b)
            at = row * steps + _position(s, length, reverse)
            if s == 0:
                prev = h0 + row * H
            else:
                prev = hs + (row * steps + _position(s - 1, length, reverse)) * H
            h_all = _shared(prev + cols, cmask)  # the whole previous state
            x = gi + at * (G * H) + rows
            a = tl.load(x, mask=rmask, other=0.0).to(tl.float32) + _matvec(w_a, h_all, ASM)
            if CELL == GRU:
                r = tl.sigmoid(a)
                z = tl.load(x + H, mask=rmask, other=0.0).to(tl.float32)
                z = tl.sigmoid(z + _matvec(w_b, h_all, ASM))
                hn = _matvec(w_c, h_all, ASM) + b_n
                a_n = tl.load(x + 2 * H, mask=rmask, other=0.0).to(tl.float32) + r * hn
                n = 2.0 * tl.sigmoid(2.0 * a_n) - 1.0  # tanh
                h = (1.0 - z) * n + z * _shared(prev + rows, rmask)
                if SAVE:
                    keep = sv + at * (4 * H) + rows
                    tl.store(keep, r, mask=rmask)
                    tl.store(keep + H, z, mask=rmask)
                    tl.store(keep + 2 * H, n, mask=rmask)
                    tl.store(keep + 3 * H, hn, mask=rmask)
            else:
                h = tl.minimum(tl.maximum(a, 0.0), clip)
            tl.store(hs + at * H + rows, h, mask=rmask)
        if BARRIER:
            failed = _grid_barrier(sync + d, status, (s - s_begin + 1) * slices, spin_limit)
        s += 1


@triton.jit
def recurrence_backward_kernel(
    dout0, dout1,  # (N, T, H) gradient of the outputs, compute dtype
    hs0, hs1,  # (N, T, H) float32 states from the forward kernel
    sv0, sv1,  # (N, T, 4H) float32 saved gates (GRU)
    h00, h01,  # (N, H) float32 initial states
    len0, len1,  # (N,) int32
    wt0, wt1,  # (G, H, H) transposed recurrent weights, compute dtype
    dgh0, dgh1,  # (N, T, G*H) float32 out: gradient of W_hh h + b_hh
    dgi0, dgi1,  # (N, T, G*H) float32 out: gradient of the input projections (GRU)
    carry0, carry1,  # (N, H) float32 scratch: dL/dh after the step just done (GRU)
    dh00, dh01,  # (N, H) float32 out: gradient of the initial states (FINAL)
    n_rows0, n_rows1, steps0, steps1, reverse0, reverse1,
    sync, status,
    H, clip, s_hi, s_lo, spin_limit,
    CELL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BARRIER: tl.constexpr, FINAL: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Steps min(s_hi, T) - 1 down to s_lo; with FINAL, then the gradient of h0.

    Step s needs the whole of dgh at step s + 1 (written by every program of the
    direction during the previous iteration), so one barrier per step suffices.
    """
    slices = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    d = pid // slices
    rows = (pid % slices) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_K)
    rmask, cmask = rows < H, cols < H
    dout, hs, sv = _pick(d, dout0, dout1), _pick(d, hs0, hs1), _pick(d, sv0, sv1)
    h0, lens = _pick(d, h00, h01), _pick(d, len0, len1)
    dgh, dgi, carry = _pick(d, dgh0, dgh1), _pick(d, dgi0, dgi1), _pick(d, carry0, carry1)
    dh0 = _pick(d, dh00, dh01)
    n_rows, steps = _pick(d, n_rows0, n_rows1), _pick(d, steps0, steps1)
    reverse = _pick(d, reverse0, reverse1)
    G = 1 + 2 * CELL
    wmask = rmask[:, None] & cmask[None, :]
    w_a, w_b, w_c = _load_weights(_pick(d, wt0, wt1), H, rows, cols, wmask, CELL)

    s = tl.minimum(s_hi, steps) - 1
    done = 0
    failed = tl.zeros((), tl.int32)
    while (s >= s_lo) & (failed == 0):
        for b in range(n_rows):
            row = tl.cast(b, tl.int64)
            length = tl.load(lens + b)
            at = row * steps + _position(s, length, reverse)
            dh = tl.load(dout + at * H + rows, mask=rmask, other=0.0).to(tl.float32)
            if s + 1 < steps:  # the recurrent gradient from the step after
                nxt = row * steps + _position(s + 1, length, reverse)
                dh += _gates_matvec(dgh + nxt * (G * H), w_a, w_b, w_c, H, cols, cmask, CELL, ASM)
                if CELL == GRU:
                    z_next = tl.load(sv + nxt * (4 * H) + H + rows, mask=rmask, other=0.0)
                    dh += z_next * tl.load(carry + row * H + rows, mask=rmask, other=0.0)
            if CELL == GRU:
                tl.store(carry + row * H + rows, dh, mask=rmask)
                if s == 0:
                    prev = h0 + row * H
                else:
                    prev = hs + (row * steps + _position(s - 1, length, reverse)) * H
                h_prev = tl.load(prev + rows, mask=rmask, other=0.0)
                keep = sv + at * (4 * H) + rows
                r = tl.load(keep, mask=rmask, other=0.0)
                z = tl.load(keep + H, mask=rmask, other=0.0)
                n = tl.load(keep + 2 * H, mask=rmask, other=0.0)
                hn = tl.load(keep + 3 * H, mask=rmask, other=0.0)
                d_an = dh * (1.0 - z) * (1.0 - n * n)
                d_ar = d_an * hn * r * (1.0 - r)
                d_az = dh * (h_prev - n) * z * (1.0 - z)
                out_h = dgh + at * (3 * H) + rows
                tl.store(out_h, d_ar, mask=rmask)
                tl.store(out_h + H, d_az, mask=rmask)
                tl.store(out_h + 2 * H, d_an * r, mask=rmask)
                out_i = dgi + at * (3 * H) + rows
                tl.store(out_i, d_ar, mask=rmask)
                tl.store(out_i + H, d_az, mask=rmask)
                tl.store(out_i + 2 * H, d_an, mask=rmask)
            else:
                h = tl.load(hs + at * H + rows, mask=rmask, other=0.0)
                d_a = tl.where((h > 0.0) & (h < clip), dh, 0.0)
                tl.store(dgh + at * H + rows, d_a, mask=rmask)
        if BARRIER:
            done += 1
            failed = _grid_barrier(sync + d, status, done * slices, spin_limit)
        s -= 1

    if FINAL:  # dL/dh0 = W^T dgh(step 0) (+ z * dh for the GRU); skipped after a timeout
        for b in range(n_rows * (failed == 0).to(tl.int32)):
            row = tl.cast(b, tl.int64)
            first = row * steps + _position(0, tl.load(lens + b), reverse)
            acc = _gates_matvec(dgh + first * (G * H), w_a, w_b, w_c, H, cols, cmask, CELL, ASM)
            if CELL == GRU:
                z0 = tl.load(sv + first * (4 * H) + H + rows, mask=rmask, other=0.0)
                acc += z0 * tl.load(carry + row * H + rows, mask=rmask, other=0.0)
            tl.store(dh0 + row * H + rows, acc, mask=rmask)
