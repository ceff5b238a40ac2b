"""fp32 against int8 (`echoic quantize`) of one model, side by side in one run.

    python bench/int8.py --int8 DIR [--model DIR] [--manifest HELDOUT.jsonl] [--threads 1]

Table 1 (with --manifest): WER and CER of greedy and beam decoding (the model
directory's lm.arpa) on a held-out manifest, fp32 and int8.
Table 2: offline real-time factor (compute s per audio s, lower is better) of 8 s
utterances at batch 1, 8 and 32. Table 3: one streaming step (stream.onnx) for 1, 8,
32 and 128 streams as one batch, ms.

Speed is measured with the server's thread setting (--threads 1 by default), the
two models alternating repeat by repeat so that a noisy machine affects both alike;
medians of --repeats. The ratio column is int8 time / fp32 time: below 1 int8 is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np

from echoic.model.runtime.engine import Engine
from echoic.model.runtime.recognizer import default_model_dir


def _paired_medians(fns: list, repeats: int) -> list[float]:
    """Median time of each fn, run alternately (after one warm-up each)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def wer_table(dirs: dict[str, Path], manifest: Path, threads: int) -> None:
    import jiwer

    from echoic.model.core.audio import load_audio
    from echoic.model.core.decoding import DecoderConfig
    from echoic.model.runtime.recognizer import Recognizer

    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    refs = [r["text"] for r in rows]
    audio = [load_audio(manifest.parent / r["audio_filepath"], 16000) for r in rows]
    seconds = sum(len(a) for a in audio) / 16000
    print(f"accuracy on {manifest} ({len(rows)} utterances, {seconds:.0f} s)")
    print(f"{'model':>6} {'WER greedy':>11} {'CER greedy':>11} {'WER beam':>9} {'CER beam':>9}")
    for label, d in dirs.items():
        cells = []
        for kind in ("greedy", "beam"):
            rec = Recognizer(d, DecoderConfig(kind=kind), intra_op_threads=threads)
            hyps = [t.text for t in rec.transcribe(audio)]
            cells += [100 * jiwer.wer(refs, hyps), 100 * jiwer.cer(refs, hyps)]
        widths = (10, 10, 8, 8)
        print(
            f"{label:>6} " + " ".join(f"{c:>{w}.1f}%" for c, w in zip(cells, widths, strict=True))
        )


def offline_table(engines: dict[str, Engine], seconds: float, repeats: int) -> None:
    fp32 = engines["fp32"]
    card = fp32.card
    frames = int(seconds * 1000 / card.hop_ms)
    rng = np.random.default_rng(0)
    mean, f = np.asarray(card.feature_mean, np.float32), card.num_features
    print(f"\noffline, {seconds:g} s utterances: real-time factor (lower is better)")
    print(f"{'batch':>5} {'fp32':>9} {'int8':>9} {'int8/fp32':>10}")
    for batch in (1, 8, 32):
        feats = list(mean + rng.normal(size=(batch, frames, f)).astype(np.float32))
        t = _paired_medians([partial(e.offline, feats) for e in engines.values()], repeats)
        audio = batch * seconds
        print(f"{batch:>5} {t[0] / audio:>9.5f} {t[1] / audio:>9.5f} {t[1] / t[0]:>9.2f}x")


def stream_table(engines: dict[str, Engine], repeats: int) -> None:
    card = engines["fp32"].card
    rng = np.random.default_rng(1)
    mean = np.asarray(card.feature_mean, np.float32)
    chunk_s = card.chunk_frames * card.output_frame_ms / 1000
    print(f"\nstreaming step ({card.chunk_frames} output frames = {chunk_s:.2f} s of audio), ms")
    print(f"{'streams':>7} {'fp32':>9} {'int8':>9} {'int8/fp32':>10} {'fp32 ms/stream':>15}")
    for n in (1, 8, 32, 128):
        win = mean + rng.normal(size=(n, card.window_input_frames, card.num_features))
        win = win.astype(np.float32)
        frames = np.full(n, card.chunk_frames + card.context_frames, dtype=np.int64)
        fns = [partial(e.stream_step, win, frames, e.initial_state(n)) for e in engines.values()]
        t = _paired_medians(fns, repeats)
        print(f"{n:>7} {1000 * t[0]:>9.2f} {1000 * t[1]:>9.2f} {t[1] / t[0]:>9.2f}x"
              f" {1000 * t[0] / n:>15.3f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=default_model_dir(), help="fp32 model directory")
    p.add_argument("--int8", type=Path, required=True, help="its int8 copy (echoic quantize)")
    p.add_argument("--manifest", type=Path, help="held-out manifest for WER (optional)")
    p.add_argument("--seconds", type=float, default=8.0, help="offline utterance length, s")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads (0 = all cores)")
    args = p.parse_args()
    dirs = {"fp32": args.model, "int8": args.int8}
    engines = {k: Engine(d, intra_op_threads=args.threads) for k, d in dirs.items()}
    if engines["int8"].card.precision != "int8" or engines["fp32"].card.precision != "fp32":
        raise SystemExit("--model must be an fp32 model directory and --int8 its int8 copy")
    card = engines["fp32"].card
    print(f"model {card.name}/{card.version} ({card.parameters / 1e6:.2f}M parameters) on "
          f"{os.cpu_count()} CPU cores, ONNX Runtime threads: {args.threads or 'all'}")  # fmt: skip
    if args.manifest:
        wer_table(dirs, args.manifest, args.threads)
    offline_table(engines, args.seconds, args.repeats)
    if engines["fp32"].streamable:
        stream_table(engines, args.repeats)


if __name__ == "__main__":
    main()
