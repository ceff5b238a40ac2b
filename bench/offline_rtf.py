"""Inference speed of an exported model: offline real-time factor and streaming step cost.

    python bench/offline_rtf.py [--model DIR] [--config RECIPE] [--seconds 8] [--repeats 3]

Table 1: real-time factor (compute seconds per audio second, lower is better) of
whole utterances at batch 1, 8 and 32, ONNX Runtime (model.onnx) against torch
eager on the same architecture, side by side. torch runs the recipe's network
with random weights (speed does not depend on the weights).

Table 2: one streaming step (stream.onnx) for 1, 8, 32 and 64 streams run as one
batch, against the same streams run one at a time; per-stream cost and speed-up.

Both use all cores (`--threads 0`) unless told otherwise; medians of --repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echoic.model.engine import Engine  # noqa: E402
from echoic.model.recognizer import default_model_dir  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def offline_table(engine: Engine, recipe: str, seconds: float, repeats: int, threads: int):
    import torch

    from echoic.training.train import load_recipe

    card = engine.card
    frames = int(seconds * 1000 / card.hop_ms)
    rng = np.random.default_rng(0)
    cfg = load_recipe(recipe).model
    torch.manual_seed(0)
    from echoic.model.network import DeepSpeech2

    net = DeepSpeech2(cfg).eval()
    if threads:
        torch.set_num_threads(threads)
    print(f"offline, {seconds:g} s utterances; real-time factor (lower is better)")
    print(f"{'batch':>5} {'onnxruntime':>12} {'torch eager':>12} {'ort speed-up':>13}")
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
        print(f"{batch:>5} {ort_t / audio:>12.5f} {torch_t / audio:>12.5f} {speed_up:>12.2f}x")


def stream_table(engine: Engine, repeats: int) -> None:
    card = engine.card
    rng = np.random.default_rng(1)
    chunk_s = card.chunk_frames * card.output_frame_ms / 1000
    print(f"\nstreaming step ({card.chunk_frames} output frames = {chunk_s:.2f} s of audio)")
    print(f"{'streams':>7} {'batched ms':>11} {'one at a time ms':>17} {'ms/stream batched':>18}"
          f" {'speed-up':>9} {'real-time streams':>18}")  # fmt: skip
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
        print(f"{n:>7} {1000 * b:>11.2f} {1000 * s:>17.2f} {1000 * b / n:>18.3f}"
              f" {s / b:>8.2f}x {capacity:>18.0f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_dir()), help="exported model directory")
    p.add_argument("--config", default="training/recipes/default.toml", help="recipe (torch)")
    p.add_argument("--seconds", type=float, default=8.0, help="utterance length, s")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="0 = all cores")
    args = p.parse_args()
    engine = Engine(args.model, intra_op_threads=args.threads)
    print(f"model {engine.card.name}/{engine.card.version} ({engine.card.parameters / 1e6:.2f}M"
          f" parameters) on {os.cpu_count()} CPU cores")  # fmt: skip
    offline_table(engine, args.config, args.seconds, args.repeats, args.threads)
    if engine.streamable:
        stream_table(engine, args.repeats)


if __name__ == "__main__":
    main()
