"""Inference speed of an exported model: offline real-time factor and streaming step cost.

    python bench/offline_rtf.py [--model DIR] [--config RECIPE] [--seconds 8] [--repeats 3]

Table 1: real-time factor (compute seconds per audio second, lower is better) of
whole utterances at batch 1, 8 and 32, ONNX Runtime (model.onnx) against torch
eager on the same architecture, side by side. torch runs the recipe's network
with random weights (speed does not depend on the weights).

Table 2: one streaming step (stream.onnx) for 1, 8, 32 and 64 streams run as one
batch, against the same streams run one at a time; per-stream cost and speed-up.

Both use all cores (`--threads 0`) unless told otherwise; medians of --repeats.
Speeds are also given as GFLOP/s (the recipe's analytic count, `forward_flops`) and
as a percentage of this CPU's float32 peak, measured first as a large matrix product
on the same threads: batching can only gain what the unbatched run leaves of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from hardware import cpu_fp32_peak

from echoic.model.core.configs import config_hash
from echoic.model.nn.network import forward_flops
from echoic.model.runtime.engine import Engine
from echoic.model.runtime.recognizer import default_model_dir


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def offline_table(engine: Engine, cfg, seconds: float, repeats: int, threads: int, peak: float):
    import torch

    card = engine.card
    frames = int(seconds * 1000 / card.hop_ms)
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    from echoic.model.nn.network import DeepSpeech2

    net = DeepSpeech2(cfg).eval()
    if threads:
        torch.set_num_threads(threads)
    print(f"offline, {seconds:g} s utterances; real-time factor (lower is better)")
    print(f"{'batch':>5} {'onnxruntime':>12} {'torch eager':>12} {'ort speed-up':>13}"
          f" {'ort GFLOP/s':>12} {'% of peak':>10}")  # fmt: skip
    for batch in (1, 8, 32):
        feats = rng.normal(size=(batch, frames, card.num_features)).astype(np.float32) - 10
        ort_t = _median_time(lambda f=feats: engine.offline(list(f)), repeats)
        x, lengths = torch.from_numpy(feats), torch.full((batch,), frames)

        def eager(x=x, lengths=lengths) -> None:
            with torch.inference_mode():
                net(x, lengths)

        torch_t = _median_time(eager, repeats)
        audio = batch * seconds
        speed_up = torch_t / ort_t
        gflops = batch * forward_flops(cfg, frames) / ort_t / 1e9
        print(f"{batch:>5} {ort_t / audio:>12.5f} {torch_t / audio:>12.5f} {speed_up:>12.2f}x"
              f" {gflops:>12.1f} {100 * gflops / peak:>9.0f}%")  # fmt: skip


def stream_table(engine: Engine, cfg, repeats: int, peak: float) -> None:
    card = engine.card
    step_flops = forward_flops(cfg, card.window_input_frames, window=True)
    rng = np.random.default_rng(1)
    chunk_s = card.chunk_frames * card.output_frame_ms / 1000
    print(f"\nstreaming step ({card.chunk_frames} output frames = {chunk_s:.2f} s of audio)")
    print(f"{'streams':>7} {'batched ms':>11} {'one at a time ms':>17} {'ms/stream batched':>18}"
          f" {'speed-up':>9} {'real-time streams':>18} {'% of peak batched':>18}"
          f" {'one at a time':>14}")  # fmt: skip
    for n in (1, 8, 32, 64):
        win = rng.normal(size=(n, card.window_input_frames, card.num_features)).astype(np.float32)
        frames = np.full(n, card.chunk_frames + card.context_frames, dtype=np.int64)
        state = engine.initial_state(n)
        singles = engine.scatter_states(state)

        def batched(win=win, frames=frames, state=state) -> None:
            engine.stream_step(win, frames, state)

        def one_by_one(n=n, win=win, frames=frames, singles=singles) -> None:
            for i in range(n):
                engine.stream_step(win[i : i + 1], frames[i : i + 1], singles[i])

        b = _median_time(batched, repeats)
        s = _median_time(one_by_one, repeats)
        capacity = chunk_s / (b / n)  # streams one core-set keeps up with at this batch
        used = [100 * n * step_flops / t / 1e9 / peak for t in (b, s)]
        print(f"{n:>7} {1000 * b:>11.2f} {1000 * s:>17.2f} {1000 * b / n:>18.3f}"
              f" {s / b:>8.2f}x {capacity:>18.0f} {used[0]:>17.0f}% {used[1]:>13.0f}%")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_dir()), help="exported model directory")
    p.add_argument(
        "--config",
        default="training/recipes/gpu_default.toml",
        help="recipe of --model's network, for torch (default: the bundled model's)",
    )
    p.add_argument("--seconds", type=float, default=8.0, help="utterance length, s")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="0 = all cores")
    args = p.parse_args()
    from echoic.training.train import load_recipe

    engine = Engine(args.model, intra_op_threads=args.threads)
    cfg = load_recipe(args.config).model
    if config_hash(cfg) != engine.card.model_config_hash:
        sys.exit(f"--config {args.config} is not the architecture of {args.model}: pass its recipe")
    peak = cpu_fp32_peak(args.threads)
    print(f"model {engine.card.name}/{engine.card.version} ({engine.card.parameters / 1e6:.2f}M"
          f" parameters) on {os.cpu_count()} CPU cores; float32 peak here (matrix product,"
          f" {args.threads or 'all'} threads): {peak:.0f} GFLOP/s")  # fmt: skip
    offline_table(engine, cfg, args.seconds, args.repeats, args.threads, peak)
    if engine.streamable:
        stream_table(engine, cfg, args.repeats, peak)


if __name__ == "__main__":
    main()
