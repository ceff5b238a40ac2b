"""Training throughput: audio seconds trained per wall-second, and the fraction of peak.

    python bench/train_throughput.py [--config training/recipes/default.toml] [--steps 6]
    python bench/train_throughput.py --config librispeech --utt-seconds 16 --levers

Runs full training steps (forward, CTC loss, backward, AdamW) of the recipe's
model on batches shaped like the recipe's (batch_seconds of audio, transcripts at
15 characters a second; the values are random, which does not change the cost),
once for the recipe's chunked model and once with full context, side by side.
It adds the achieved TFLOP/s (analytic count, training = 3x forward) as a fraction
of the device's dense bf16 peak on a GPU, and on a CPU of its float32 peak measured
first as a large matrix product on the same threads. On a GPU it also gives the
peak memory the steps held (weights, optimizer state, activations): what a
recipe's batch_seconds must fit. Each step's time is split into its phases, measured
with the device synchronised between them: forward, the CTC loss (on the CPU, as
training computes it: the copy there included), backward (the gradient's copy back
included) and the optimizer.

--levers measures the recipe's chunked model again with one change at a time, side by
side: a larger batch (x2, x3: what the memory allows), the persistent RNN kernels
(`rnn_impl=auto` and `persistent`), and the CTC loss on the device (torch's CUDA CTC,
not deterministic: to measure what the CPU loss costs, not to train with). A lever
that does not fit is reported so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
from hardware import cpu_fp32_peak

from echoic.model.nn.network import (
    DeepSpeech2,
    ModelConfig,
    count_parameters,
    ctc_loss,
    forward_flops,
)
from echoic.training.optim import OptimConfig, make_optimizer
from echoic.training.train import load_recipe

# Dense bf16 tensor-core peaks, TFLOP/s (vendor datasheets, SXM parts, no sparsity).
BF16_PEAK = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0}


PHASES = ("forward", "loss", "backward", "optimizer")


def measure(
    cfg: ModelConfig,
    batch_seconds: float,
    max_batch: int,
    utt_seconds: float,
    steps: int,
    device: torch.device,
    bf16: bool,
    rnn_impl: str = "cudnn",
    loss_on_device: bool = False,
) -> dict[str, float]:
    torch.manual_seed(0)
    model = DeepSpeech2(cfg).to(device).train()
    model.set_rnn_impl(rnn_impl)
    opt = make_optimizer(model, OptimConfig())
    b = max(1, min(max_batch, int(batch_seconds // utt_seconds)))
    frames = int(utt_seconds * 1000 / cfg.features.hop_ms)
    chars = int(utt_seconds * 15)
    x = torch.randn(b, frames, cfg.features.num_features, device=device)
    lengths = torch.full((b,), frames, device=device)
    targets = torch.randint(1, len(cfg.vocabulary), (b * chars,))
    target_len = torch.full((b,), chars)
    if loss_on_device:
        targets, target_len = targets.to(device), target_len.to(device)

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    times: list[list[float]] = []  # per measured step: each phase's seconds
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(steps + 2):
        t0 = now()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            log_probs, out_len = model(x, lengths)
        t1 = now()
        if loss_on_device:
            loss = ctc_loss(log_probs.float(), out_len, targets, target_len)
        else:
            loss = ctc_loss(log_probs.float().cpu(), out_len.cpu(), targets, target_len)
        t2 = now()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = now()
        opt.step()
        t4 = now()
        if i >= 2:  # two warm-up steps
            times.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3])
    totals = [sum(t) for t in times]
    step = statistics.median(totals)
    median = times[totals.index(sorted(totals)[len(totals) // 2])]  # the median step's phases
    return {
        "params_m": count_parameters(model) / 1e6,
        "batch": b,
        "step_s": step,
        "audio_s_per_s": b * utt_seconds / step,
        "tflops": 3 * b * forward_flops(cfg, frames) / step / 1e12,
        # GB the caching allocator held at most (weights, AdamW state, activations)
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0,
        **{f"{name}_ms": 1e3 * t for name, t in zip(PHASES, median, strict=True)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="training/recipes/default.toml")
    p.add_argument("--steps", type=int, default=6, help="measured steps (median reported)")
    p.add_argument("--utt-seconds", type=float, default=4.0, help="utterance length, s")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--levers",
        action="store_true",
        help="the recipe's model again with one change at a time (see above)",
    )
    args = p.parse_args()
    rc = load_recipe(args.config)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(rc.threads or os.cpu_count() or 1)
    bf16 = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{os.cpu_count()}"
    if device.type == "cuda":
        peak, peak_name = next((v for k, v in BF16_PEAK.items() if k in name), None), "bf16 peak"
    else:  # measured here, on the training threads
        peak, peak_name = cpu_fp32_peak(torch.get_num_threads()) / 1e3, "fp32 peak"
    data = rc.data
    # (label, model config, batch seconds, max batch, measure's keyword arguments)
    variants = [("recipe (chunked)", rc.model, data.batch_seconds, data.max_batch, {})]
    if rc.model.chunk_frames:
        full = dataclasses.replace(rc.model, chunk_frames=0, context_frames=0)
        variants.append(("full context", full, data.batch_seconds, data.max_batch, {}))
    if args.levers:
        for k in (2, 3):
            variants.append(
                (f"batch x{k}", rc.model, k * data.batch_seconds, k * data.max_batch, {})
            )
        for impl in ("auto", "persistent"):
            variants.append((f"rnn_impl {impl}", rc.model, data.batch_seconds, data.max_batch,
                             {"rnn_impl": impl}))  # fmt: skip
        variants.append(("loss on device", rc.model, data.batch_seconds, data.max_batch,
                         {"loss_on_device": True}))  # fmt: skip
    print(f"device: {name}; {'bf16 autocast' if bf16 else 'fp32'}; {args.config}"
          + (f"; {peak_name} {peak:.3g} TFLOP/s" if peak else ""))  # fmt: skip
    header = f"{'model':<20} {'params':>7} {'batch':>5} {'step s':>7}"
    header += f" {'audio s/s':>10} {'TFLOP/s':>8} {'peak GB':>8}"
    header += f" {'% of ' + peak_name:>14}" if peak else ""
    header += "".join(f" {name[:8] + ' ms':>11}" for name in PHASES)
    print(header)
    for label, cfg, seconds, most, how in variants:
        try:
            r = measure(cfg, seconds, most, args.utt_seconds, args.steps, device, bf16, **how)
        except Exception as e:  # noqa: BLE001 - a lever that cannot run is a row, not the end
            reason = "out of memory" if "out of memory" in str(e) else f"{type(e).__name__}: {e}"
            print(f"{label:<20} does not run: {reason.splitlines()[0][:120]}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        peak_gb = f"{r['peak_gb']:.1f}" if r["peak_gb"] else "-"
        line = (f"{label:<20} {r['params_m']:>6.2f}M {r['batch']:>5d} {r['step_s']:>7.3f}"
                f" {r['audio_s_per_s']:>10.1f} {r['tflops']:>8.3f} {peak_gb:>8}")  # fmt: skip
        if peak:
            line += f" {100 * r['tflops'] / peak:>13.2f}%"
        line += "".join(f" {r[name + '_ms']:>11.1f}" for name in PHASES)
        print(line, flush=True)


if __name__ == "__main__":
    main()
