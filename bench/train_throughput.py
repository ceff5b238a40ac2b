"""Training throughput: audio seconds trained per wall-second, and the fraction of peak.

    python bench/train_throughput.py [--config training/recipes/default.toml] [--steps 6]

Runs full training steps (forward, CTC loss, backward, AdamW) of the recipe's
model on batches shaped like the recipe's (batch_seconds of audio, transcripts at
15 characters a second; the values are random, which does not change the cost),
once for the recipe's chunked model and once with full context, side by side.
It adds the achieved TFLOP/s (analytic count, training = 3x forward) as a fraction
of the device's dense bf16 peak on a GPU, and on a CPU of its float32 peak measured
first as a large matrix product on the same threads. On a GPU it also gives the
peak memory the steps held (weights, optimizer state, activations): what a
recipe's batch_seconds must fit.
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


def measure(
    cfg: ModelConfig,
    batch_seconds: float,
    max_batch: int,
    utt_seconds: float,
    steps: int,
    device: torch.device,
    bf16: bool,
) -> dict[str, float]:
    torch.manual_seed(0)
    model = DeepSpeech2(cfg).to(device).train()
    opt = make_optimizer(model, OptimConfig())
    b = max(1, min(max_batch, int(batch_seconds // utt_seconds)))
    frames = int(utt_seconds * 1000 / cfg.features.hop_ms)
    chars = int(utt_seconds * 15)
    x = torch.randn(b, frames, cfg.features.num_features, device=device)
    lengths = torch.full((b,), frames, device=device)
    targets = torch.randint(1, len(cfg.vocabulary), (b * chars,))
    target_len = torch.full((b,), chars)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            log_probs, out_len = model(x, lengths)
        loss = ctc_loss(log_probs.float().cpu(), out_len.cpu(), targets, target_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {
        "params_m": count_parameters(model) / 1e6,
        "batch": b,
        "step_s": step,
        "audio_s_per_s": b * utt_seconds / step,
        "tflops": 3 * b * forward_flops(cfg, frames) / step / 1e12,
        # GB the caching allocator held at most (weights, AdamW state, activations)
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="training/recipes/default.toml")
    p.add_argument("--steps", type=int, default=6, help="measured steps (median reported)")
    p.add_argument("--utt-seconds", type=float, default=4.0, help="utterance length, s")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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
    variants = [("recipe (chunked)", rc.model)]
    if rc.model.chunk_frames:
        variants.append(("full context", dataclasses.replace(
            rc.model, chunk_frames=0, context_frames=0)))  # fmt: skip
    print(f"device: {name}; {'bf16 autocast' if bf16 else 'fp32'}; {args.config}"
          + (f"; {peak_name} {peak:.3g} TFLOP/s" if peak else ""))  # fmt: skip
    header = f"{'model':<18} {'params':>7} {'batch':>5} {'step s':>7}"
    header += f" {'audio s/s':>10} {'TFLOP/s':>8} {'peak GB':>8}"
    print(header + (f" {'% of ' + peak_name:>14}" if peak else ""))
    for label, cfg in variants:
        r = measure(cfg, rc.data.batch_seconds, rc.data.max_batch, args.utt_seconds,
                    args.steps, device, bf16)  # fmt: skip
        peak_gb = f"{r['peak_gb']:.1f}" if r["peak_gb"] else "-"
        line = (f"{label:<18} {r['params_m']:>6.2f}M {r['batch']:>5d} {r['step_s']:>7.3f}"
                f" {r['audio_s_per_s']:>10.1f} {r['tflops']:>8.3f} {peak_gb:>8}")  # fmt: skip
        if peak:
            line += f" {100 * r['tflops'] / peak:>13.2f}%"
        print(line, flush=True)


if __name__ == "__main__":
    main()
