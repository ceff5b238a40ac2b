"""What ONNX Runtime's offline graph optimisation would save at server start.

    python bench/session_start.py [--model DIR] [--repeats 7]

ONNX Runtime can write the graph it optimised (SessionOptions.optimized_model_filepath)
so that a later start loads it without optimising again. For each graph of the model
this prints the median time to create a session (the server's settings: all graph
optimisations, one thread) from the exported file, and from the saved optimised file
(optimisations then off), beside what the rest of a server start costs: importing the
server, and a whole `Engine` (both graphs, the card checks).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from echoic.model.runtime.engine import Engine
from echoic.model.runtime.recognizer import default_model_dir


def _session_seconds(path: Path, *, optimise: bool, save: Path | None = None) -> float:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimise
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if save is not None:
        options.optimized_model_filepath = str(save)
    t0 = time.perf_counter()
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return time.perf_counter() - t0


def _engine_seconds(model_dir: Path) -> float:
    t0 = time.perf_counter()
    Engine(model_dir, intra_op_threads=1)
    return time.perf_counter() - t0


def _median(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=default_model_dir(), help="model directory")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(f"session creation, median of {args.repeats}, ms")
    print(f"{'graph':>12} {'as exported':>12} {'pre-optimised':>14} {'saved':>7}")
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("model.onnx", "stream.onnx"):
            src = args.model / name
            if not src.is_file():
                continue
            saved = Path(scratch) / name
            _session_seconds(src, optimise=True, save=saved)
            plain = _median(lambda s=src: _session_seconds(s, optimise=True), args.repeats)
            pre = _median(lambda s=saved: _session_seconds(s, optimise=False), args.repeats)
            print(f"{name:>12} {1000 * plain:>12.1f} {1000 * pre:>14.1f}"
                  f" {1000 * (plain - pre):>7.1f}")  # fmt: skip
    engine = _median(lambda: _engine_seconds(args.model), args.repeats)
    code = "import time; t = time.perf_counter(); import echoic.server.process.app; "
    code += "print(time.perf_counter() - t)"
    imports = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout)
        for _ in range(3)
    ]  # fmt: skip
    print(f"\nfor comparison: Engine (both graphs, as exported) {1000 * engine:.0f} ms; "
          f"importing the server {1000 * statistics.median(imports):.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
