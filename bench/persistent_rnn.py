"""Persistent RNN kernels vs cuDNN: us per time step and TFLOP/s, forward, backward, both.

    python bench/persistent_rnn.py [--steps 200] [--repeats 20] [--dtype bf16] [--quick]

Needs a CUDA GPU and triton; elsewhere it says so and exits. Three tables:

1. One recurrent layer (input size = H, as in every DS2 layer but the first), one
   or both directions, B in {1, 4, 16, 64}, H in {512, 1024, 2048}: the persistent
   kernels (one launch a pass, both directions in it) against nn.RNN(relu) /
   nn.GRU on cuDNN, under autocast in --dtype as in training. Two variants of the
   kernels, a line each: "rows" (one batch row at a time, matrix-vector products
   on the CUDA cores; what `plan` picks first above 16 rows) and "tiles" (16 rows at
   a time on the tensor cores; 16-bit dtypes; first up to 16 rows). Times are
   medians of --repeats runs (CUDA
   events, after warm-up); TFLOP/s counts the input GEMM and the recurrence
   (backward = 2x forward). A shape a variant does not fit says why instead.
2. fp16, one direction, one layer, B in {8, 16}, H in {512, 1024}: where PyTorch
   may choose cuDNN's own persistent algorithm (the "persist" column says whether
   cuDNN's kernel names show it).
3. One DS2 training step (the recipe's model, bf16 autocast, CTC, AdamW) with
   rnn_impl cudnn, persistent and auto: the first step's loss (must agree to
   float tolerance) and the median step time, as a ratio to cuDNN.

--quick prints table 1 for the bidirectional GRU alone (the issue-20 target: B = 4,
H = 1024, fwd+bwd, at least 3x cuDNN), in a few minutes, and skips tables 2 and 3.

Use the ratios to set auto_max_rows in echoic/model/nn/persistent/function.py, and
the order of rows and tiles in capacity.candidates.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def need_gpu() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/persistent_rnn.py: no CUDA GPU is visible; nothing to measure.")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("bench/persistent_rnn.py: triton is not installed (pip install triton).")


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def layer_flops(cell: str, hidden: int, batch: int, steps: int, directions: int) -> float:
    """Forward multiply-adds x 2: the input GEMM (D = H) and the recurrence."""
    gates = 3 if cell == "gru" else 1
    return directions * 2 * batch * steps * gates * hidden * (hidden + hidden)


def _module(cell: str, hidden: int, directions: int) -> nn.Module:
    kind = dict(batch_first=True, bidirectional=directions == 2)
    if cell == "gru":
        return nn.GRU(hidden, hidden, **kind)
    return nn.RNN(hidden, hidden, nonlinearity="relu", **kind)


def _phases(run: Callable[[], list[torch.Tensor]], leaves: list, repeats: int) -> dict:
    """Median seconds of forward, backward (from saved outputs) and both."""
    outs = run()
    grads = [torch.randn_like(o) for o in outs]

    def backward() -> None:
        torch.autograd.grad(outs, leaves, grads, retain_graph=True)

    def both() -> None:
        torch.autograd.grad(run(), leaves, grads)

    return {
        "fwd": median_seconds(run, repeats),
        "bwd": median_seconds(backward, repeats),
        "both": median_seconds(both, repeats),
    }


def _variants(cell: str, hidden: int, dtype, directions: int) -> dict:
    """The kernel configuration of each variant on this GPU, or why there is none."""
    from echoic.model.nn.persistent import capacity, launch, plan

    found = plan(cell, hidden, dtype, directions, 0)
    rows = found if isinstance(found, str) or not found.tiles else "plan chose tiles"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = capacity.candidates(hidden, directions, sms, tiles=True)[2]  # tiles, 8 warps
    try:
        launch.check(cell, dtype, hidden, directions, tiles, torch.device("cuda", 0))
    except Exception as e:  # noqa: BLE001 - any compile, load or resource failure
        tiles = f"{type(e).__name__}: {e}"
    return {"rows": rows, "tiles": tiles}


def _persistent(result: dict, variants: dict, cell: str, problems, leaves, autocast, repeats):
    """Time each variant that fits into result[variant], or say why it does not."""
    from echoic.model.nn.persistent import PersistentKernelError, recurrences

    for name, cfg in variants.items():
        if isinstance(cfg, str):
            result[name] = cfg
            continue

        def run(cfg=cfg) -> list[torch.Tensor]:
            with autocast():
                return recurrences(cell, problems, backend="triton", config=cfg)

        try:  # a launch refuses what `plan` accepted only where the two disagree: say so
            result[name] = _phases(run, leaves, repeats)
        except PersistentKernelError as e:
            result[name] = f"{type(e).__name__} at launch: {e}"


def layer_case(cell: str, hidden: int, batch: int, steps: int, directions: int, dtype, repeats):
    from echoic.model.nn.persistent import Problem

    torch.manual_seed(0)
    dev = torch.device("cuda")
    cudnn = _module(cell, hidden, directions).to(dev)
    x = torch.randn(batch, steps, hidden, device=dev, requires_grad=True)

    def autocast() -> torch.autocast:
        return torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32)

    def run_cudnn() -> list[torch.Tensor]:
        with autocast():
            return [cudnn(x)[0]]

    result = {"cudnn": _phases(run_cudnn, [x, *cudnn.parameters()], repeats)}
    dirs = [_module(cell, hidden, 1).to(dev) for _ in range(directions)]
    lengths = torch.full((batch,), steps, device=dev)
    problems = [Problem(dirs[0], x)]
    if directions == 2:
        problems.append(Problem(dirs[1], x, None, lengths, reverse=True))
    leaves = [x, *(p for m in dirs for p in m.parameters())]
    variants = _variants(cell, hidden, dtype, directions)
    _persistent(result, variants, cell, problems, leaves, autocast, repeats)
    return result


def cudnn_uses_persist(fn: Callable[[], object]) -> bool:
    """Whether any CUDA kernel that `fn` launches is named like cuDNN's persistent RNN."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return any("persist" in e.key.lower() for e in prof.key_averages())


def fp16_persist_case(cell: str, hidden: int, batch: int, steps: int, repeats: int) -> dict:
    from contextlib import nullcontext

    from echoic.model.nn.persistent import Problem

    torch.manual_seed(0)
    dev = torch.device("cuda")
    cudnn = _module(cell, hidden, 1).to(dev).half()
    x = torch.randn(batch, steps, hidden, device=dev, dtype=torch.half, requires_grad=True)

    def run_cudnn() -> list[torch.Tensor]:
        return [cudnn(x)[0]]

    result = {
        "cudnn": _phases(run_cudnn, [x, *cudnn.parameters()], repeats),
        "persist": cudnn_uses_persist(run_cudnn),
    }
    mine = _module(cell, hidden, 1).to(dev).half()
    variants = _variants(cell, hidden, torch.float16, 1)
    _persistent(result, variants, cell, [Problem(mine, x)], [x, *mine.parameters()],
                nullcontext, repeats)  # fmt: skip
    return result


HEADER = (
    "{label} | impl    | fwd us/step  vs cuDNN | bwd us/step  vs cuDNN"
    " | both us/step  vs cuDNN | TFLOP/s"
)


def _rows(label: str, r: dict, steps: int, flops: float) -> list[str]:
    """One line per implementation: cuDNN, then each variant of the kernels."""
    base = r["cudnn"]
    lines = []
    for impl in ("cudnn", "rows", "tiles"):
        cells = [label, f"{impl:<7}"]
        if isinstance(r[impl], str):
            lines.append(" | ".join(cells) + f" | does not fit: {r[impl][:90]}")
            continue
        for phase in ("fwd", "bwd", "both"):
            us, us_base = r[impl][phase] / steps * 1e6, base[phase] / steps * 1e6
            cells.append(f"{us:>11.1f} {us_base / us:>8.2f}x")
        cells.append(f"{3 * flops / r[impl]['both'] / 1e12:>7.2f}")
        lines.append(" | ".join(cells))
    return lines


def ds2_step(impl: str, batch: int, seconds: float, repeats: int) -> dict:
    """The first step's loss and the median step time of the recipe's model."""
    from echoic.model.nn.network import DeepSpeech2, ctc_loss
    from echoic.training.optim import OptimConfig, make_optimizer
    from echoic.training.train import load_recipe

    cfg = load_recipe(Path(__file__).resolve().parents[1] / "training/recipes/default.toml").model
    dev = torch.device("cuda")
    frames = int(seconds * 1000 / cfg.features.hop_ms)
    chars = int(seconds * 15)
    torch.manual_seed(0)
    model = DeepSpeech2(cfg).to(dev).train()
    model.set_rnn_impl(impl)
    opt = make_optimizer(model, OptimConfig())
    torch.manual_seed(1)
    x = torch.randn(batch, frames, cfg.features.num_features, device=dev)
    lengths = torch.full((batch,), frames, device=dev)
    targets = torch.randint(1, len(cfg.vocabulary), (batch * chars,))
    target_len = torch.full((batch,), chars)
    losses = []

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            log_probs, out_len = model(x, lengths)
        loss = ctc_loss(log_probs.float().cpu(), out_len.cpu(), targets, target_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    step()
    return {"loss": losses[0], "step_s": median_seconds(step, repeats, warmup=2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="time steps per sequence")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per case (median)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="autocast dtype")
    p.add_argument("--quick", action="store_true", help="table 1 for the bidirectional GRU only")
    p.add_argument("--ds2-batch", type=int, default=16, help="utterances per DS2 step")
    args = p.parse_args()
    need_gpu()
    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name} ({props.multi_processor_count} SMs, sm_{props.major}{props.minor});"
        f" torch {torch.__version__}; {args.dtype}; T = {args.steps}; median of {args.repeats}"
    )
    dtype = DTYPES[args.dtype]
    hiddens = (512, 1024, 2048)
    batches = (1, 4, 16, 64)
    shapes = [("gru", 2)] if args.quick else [(c, d) for c in ("rnn", "gru") for d in (1, 2)]
    for cell, directions in shapes:
        print(f"\n{cell}, {directions} direction(s)", flush=True)
        print(HEADER.format(label=f"{'H':>5} {'B':>3}"))
        for hidden in hiddens:
            for batch in batches:
                r = layer_case(cell, hidden, batch, args.steps, directions, dtype, args.repeats)
                flops = layer_flops(cell, hidden, batch, args.steps, directions)
                lines = _rows(f"{hidden:>5} {batch:>3}", r, args.steps, flops)
                print(*lines, sep="\n", flush=True)
    if args.quick:
        return

    print("\nfp16, one direction, one layer: where cuDNN may use its persistent algorithm")
    print(HEADER.format(label=f"{'cell':>4} {'H':>5} {'B':>3} persist"))
    for cell in ("rnn", "gru"):
        for hidden in (512, 1024):
            for batch in (8, 16):
                r = fp16_persist_case(cell, hidden, batch, args.steps, args.repeats)
                flops = layer_flops(cell, hidden, batch, args.steps, 1)
                label = f"{cell:>4} {hidden:>5} {batch:>3} {'yes' if r['persist'] else 'no':>7}"
                print(*_rows(label, r, args.steps, flops), sep="\n", flush=True)

    print(f"\nDS2 training step (recipe model, bf16, B = {args.ds2_batch}, 4 s utterances)")
    steps = {
        impl: ds2_step(impl, args.ds2_batch, 4.0, max(args.repeats, 20))
        for impl in ("cudnn", "persistent", "auto")
    }
    base = steps["cudnn"]
    print(f"{'rnn_impl':<11} {'first loss':>12} {'rel. diff':>10} {'step ms':>8} {'vs cuDNN':>9}")
    for impl, r in steps.items():
        diff = abs(r["loss"] - base["loss"]) / abs(base["loss"])
        print(
            f"{impl:<11} {r['loss']:>12.4f} {diff:>10.2e} {r['step_s'] * 1e3:>8.2f}"
            f" {base['step_s'] / r['step_s']:>8.2f}x"
        )


if __name__ == "__main__":
    main()
