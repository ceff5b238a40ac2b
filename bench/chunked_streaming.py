"""What streaming a full-context imported model by overlapped chunks costs.

    python bench/chunked_streaming.py MODEL_DIR [--manifest M] [--clips 6] [--seconds 8]

MODEL_DIR: a model directory from `echoic import-model` (a waveform model, or a NeMo
one, without stream.onnx). The audio: the first --clips utterances of a manifest (JSON lines with
audio_filepath), else --clips synthetic clips of --seconds (gliding tones and noise).

One row per chunk geometry (chunk / left / right context, ms): the most a word
waits before it can show up (chunk + right context), the compute per audio second
(real-time factor, lower is better; the model runs (L + C + R) / C times the audio),
and how far the streamed transcript is from the whole-utterance one (character error
rate of streamed against whole, and the share of clips that differ at all). The
first row is Recognize: the utterance whole; "x whole" is compute against it. One
ONNX thread (--threads), medians of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from echoic.model.core.audio import load_audio
from echoic.model.runtime.chunking import ChunkConfig
from echoic.model.runtime.engine import Engine
from echoic.model.runtime.recognizer import Recognizer

GEOMETRIES = (  # chunk, left, right, ms
    (2000.0, 2000.0, 1000.0),
    (1000.0, 2000.0, 1000.0),
    (1000.0, 1000.0, 500.0),  # echoic serve's default
    (500.0, 1000.0, 500.0),
    (500.0, 500.0, 250.0),
    (250.0, 500.0, 250.0),
)


def synthetic(seconds: float, seed: int, rate: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = 120 + 80 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t)
    voiced = np.sin(2 * np.pi * np.cumsum(pitch) / rate) * (0.5 + 0.5 * np.sin(7 * t))
    return (0.3 * voiced + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def streamed(recognizer: Recognizer, samples: np.ndarray, block: int) -> str:
    stream = recognizer.stream()
    for start in range(0, len(samples), block):
        stream.accept_audio(samples[start : start + block])
        while recognizer.step([stream]):
            pass
    stream.finish()
    while recognizer.step([stream]):
        pass
    return stream.result().text


def cer(ref: str, hyp: str) -> tuple[int, int]:
    """(edit distance, reference length) in characters."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i]
        for j, h in enumerate(hyp, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h)))
        prev = cur
    return prev[-1], len(ref)


def timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up: ONNX Runtime sizes its buffers on the first runs
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--manifest", type=Path)
    parser.add_argument("--clips", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    engine = Engine(args.model_dir, intra_op_threads=args.threads)
    rate = engine.card.sample_rate
    if args.manifest:
        rows = [json.loads(line) for line in args.manifest.read_text().splitlines()]
        clips = [load_audio(r["audio_filepath"], rate) for r in rows[: args.clips]]
    else:
        clips = [synthetic(args.seconds, seed, rate) for seed in range(args.clips)]
    audio_seconds = sum(len(c) for c in clips) / rate
    whole = Recognizer(engine)
    t_whole, refs = timed(lambda: [whole.transcribe([c])[0].text for c in clips], args.repeats)
    print(f"{engine.card.source}, {len(clips)} clips, {audio_seconds:.1f} s of audio, "
          f"{args.threads} ONNX thread(s), fed 100 ms at a time")  # fmt: skip
    print(f"{'chunk/left/right ms':>20} {'max wait ms':>12} {'RTF':>8} {'x whole':>8}"
          f" {'CER vs whole':>13} {'clips differ':>13}")  # fmt: skip
    rtf = t_whole / audio_seconds
    print(f"{'whole (Recognize)':>20} {'(end)':>12} {rtf:8.4f} {1:8.2f} {0:13.3%} {0:13.0%}")
    block = rate // 10  # 100 ms per accept_audio, as a live client sends
    for chunk, left, right in GEOMETRIES:
        rec = Recognizer(engine, chunking=ChunkConfig(chunk, left, right))
        t, hyps = timed(lambda r=rec: [streamed(r, c, block) for c in clips], args.repeats)
        errors = [cer(ref, hyp) for ref, hyp in zip(refs, hyps, strict=True)]
        rate_ = sum(e for e, _ in errors) / max(1, sum(n for _, n in errors))
        differ = sum(ref != hyp for ref, hyp in zip(refs, hyps, strict=True)) / len(clips)
        name = f"{chunk:g}/{left:g}/{right:g}"
        rtf, times = t / audio_seconds, t / t_whole
        print(
            f"{name:>20} {chunk + right:12g} {rtf:8.4f} {times:8.2f} {rate_:13.3%} {differ:13.0%}"
        )


if __name__ == "__main__":
    main()
