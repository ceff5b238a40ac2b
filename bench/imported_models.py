"""What serving an imported model costs against echoic's default model, offline.

    python bench/imported_models.py [MODEL_DIR ...] [--seconds 8] [--repeats 3] [--threads 1]

With no MODEL_DIR: the default model and the NeMo test fixtures (tests/fixtures/nemo/,
imported here into a temporary directory: a QuartzNet-style character model and a
Conformer BPE model, tiny and randomly initialised).

One row per model and batch size: compute seconds per audio second (real-time factor,
lower is better) of Recognizer.log_probs on synthetic clips of --seconds (features and
one model.onnx batch, as Recognize runs them), the share of it spent on features (numpy:
echoic's log-mel, or NeMo's recipe), and the cost against the default model at the same
batch. One ONNX thread (the server's default), medians of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from echoic.model.runtime.recognizer import Recognizer, default_model_dir

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nemo"
BATCHES = (1, 8)


def clip(seconds: float, seed: int, rate: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = 120 + 80 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t)
    voiced = np.sin(2 * np.pi * np.cumsum(pitch) / rate) * (0.5 + 0.5 * np.sin(7 * t))
    return (0.3 * voiced + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def median_seconds(work, repeats: int) -> float:  # noqa: ANN001
    work()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model_dir: Path, seconds: float, repeats: int, threads: int) -> list[tuple]:
    recognizer = Recognizer(model_dir, intra_op_threads=threads)
    rows = []
    for batch in BATCHES:
        audios = [clip(seconds, i, recognizer.sample_rate) for i in range(batch)]
        total = median_seconds(lambda a=audios: recognizer.log_probs(a), repeats)
        features = median_seconds(lambda a=audios: [recognizer.model_input(x) for x in a], repeats)
        rows.append((recognizer.card, batch, total / (batch * seconds), features / total))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model_dirs", nargs="*", type=Path)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = args.model_dirs
        if not dirs:
            from echoic.model.nn.nemo_import import import_nemo

            dirs = [default_model_dir()] + [
                import_nemo(
                    FIXTURES / f"{k}.onnx", Path(tmp) / k / "1", nemo=FIXTURES / f"{k}.nemo"
                )
                for k in ("chars", "bpe")
            ]
        results = [r for d in dirs for r in measure(d, args.seconds, args.repeats, args.threads)]
    base = {b: rtf for card, b, rtf, _ in results[: len(BATCHES)]}
    print(f"{args.seconds:g} s clips, {args.threads} ONNX thread(s), median of {args.repeats}\n")
    print("| model | source | parameters | batch | real-time factor | features share | vs first |")
    print("|---|---|---|---|---|---|---|")
    for card, batch, rtf, share in results:
        print(
            f"| {card.name} | {card.source} | {card.parameters / 1e3:.1f} k | {batch} | "
            f"{rtf:.4f} | {share:.0%} | {rtf / base[batch]:.2f}x |"
        )


if __name__ == "__main__":
    main()
