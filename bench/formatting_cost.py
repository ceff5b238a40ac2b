"""What formatting a final result costs, per utterance, in one thread (docs/formatting.md).

    python bench/formatting_cost.py [--repeats 200] [--tagger FILE ...]

For utterances of 5 to 80 spoken words (sentences of the inverse-normalization test list,
tests/fixtures/inverse_text.tsv, joined), it times inverse text normalization alone and
the whole formatter (normalization, the tagger on ONNX Runtime with one thread, writing
the tags back), and prints ms per utterance: p50 and p95 over --repeats runs. With
several --tagger files (default: the bundled one) the whole formatter is timed with each,
each round in a shuffled order, so that a busy machine weighs on them alike. A server formats
each final result once, after the batch step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from echoic.model.runtime.formatting import PUNCT_FILE, Formatter, punctuator, use_tagger

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


def timed(fns: Sequence[Callable[[], object]], repeats: int) -> list[tuple[float, float]]:
    """p50 and p95 ms of each of `fns`, all run each round in a shuffled order (a fixed
    order can fall in step with a busy machine's time slices and load one of them)."""
    times = np.zeros((len(fns), repeats))
    rng = np.random.default_rng(0)
    for r in range(repeats):
        for i in rng.permutation(len(fns)):
            t = time.perf_counter()
            fns[i]()
            times[i, r] = time.perf_counter() - t
    return [tuple(float(x) for x in np.percentile(row, [50, 95]) * 1000) for row in times]


def tagged_formatter(path: Path) -> Callable[[list[str]], object]:
    """The whole formatter with the tagger in `path` (loaded here once, as a server does at
    its start; switching to it costs a global's assignment)."""
    use_tagger(path)
    punctuator()

    def format_with(words: list[str]) -> object:
        use_tagger(path)
        return Formatter().format(words)

    return format_with


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=200, help="runs per size, count")
    p.add_argument("--tagger", type=Path, nargs="+", default=[PUNCT_FILE],
                   help="tagger files to time the whole formatter with, in turn")  # fmt: skip
    args = p.parse_args()
    inverse = Formatter(punctuation=False)
    full = [tagged_formatter(path) for path in args.tagger]
    names = [f"{path.name} ({path.stat().st_size / 1e6:.1f} MB)" for path in args.tagger]
    print("ms per utterance, p50 / p95; whole formatting with each tagger: " + ", ".join(names))
    heads = ["inverse only", *names]
    print(f"{'words':>5}" + "".join(f"  {h:>15}" for h in heads))
    for n in (5, 10, 20, 40, 80):
        words = utterance(n)
        for fmt in full:
            fmt(words)  # warm
        fns = [lambda w=words: inverse.format(w)] + [lambda w=words, f=f: f(w) for f in full]
        cells = [f"{a:>6.3f} / {b:<6.3f}" for a, b in timed(fns, args.repeats)]
        widths = [max(15, len(h)) for h in heads]
        print(f"{n:>5}" + "".join(f"  {c:>{w}}" for c, w in zip(cells, widths, strict=True)))


if __name__ == "__main__":
    main()
