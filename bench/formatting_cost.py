"""What formatting a final result costs, per utterance, in one thread (docs/formatting.md).

    python bench/formatting_cost.py [--repeats 200]

For utterances of 5 to 80 spoken words (sentences of the inverse-normalization test list,
tests/fixtures/inverse_text.tsv, joined), it times inverse text normalization alone and
the whole formatter (normalization, the tagger on ONNX Runtime with one thread, writing
the tags back), and prints ms per utterance: p50 and p95 over --repeats runs. A server
formats each final result once, in a worker thread, after the batch step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from echoic.model.runtime.formatting import Formatter, punctuator

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "inverse_text.tsv"


def utterance(words: int) -> list[str]:
    spoken = [line.split("\t")[1] for line in FIXTURE.read_text().splitlines()
              if line and not line.startswith("#")]  # fmt: skip
    out: list[str] = []
    for phrase in spoken:
        out += phrase.split()
        if len(out) >= words:
            return out[:words]
    return out


def timed(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    p50, p95 = np.percentile(times, [50, 95]) * 1000
    return float(p50), float(p95)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=200, help="runs per size, count")
    args = p.parse_args()
    punctuator()  # loaded once, as the server does at start
    inverse, full = Formatter(punctuation=False), Formatter()
    print(f"{'words':>5}  {'inverse ms p50/p95':>18}  {'formatting ms p50/p95':>21}")
    for n in (5, 10, 20, 40, 80):
        words = utterance(n)
        full.format(words)  # warm
        a = timed(lambda w=words: inverse.format(w), args.repeats)
        b = timed(lambda w=words: full.format(w), args.repeats)
        print(f"{n:>5}  {a[0]:>8.3f} / {a[1]:<7.3f}  {b[0]:>10.3f} / {b[1]:<8.3f}")


if __name__ == "__main__":
    main()
