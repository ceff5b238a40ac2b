"""bench/train_throughput.py runs, as a lent GPU session will run it: each lever a row.

Not timed (the numbers are the benchmark's, on a noisy shared CPU here): this checks
that every row of --levers is measured or says why it cannot run, and that each
row's phases add up to its step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_levers_table_has_a_row_for_each_lever_with_its_phases() -> None:
    run = subprocess.run(
        [sys.executable, "train_throughput.py", "--config", "tiny", "--steps", "1", "--levers"],
        cwd=ROOT / "bench", capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("device: CPU") and "fp32 peak" in lines[0]
    header = lines[1].split()
    assert header[-8:] == ["forward", "ms", "loss", "ms", "backward", "ms", "optimize", "ms"]
    rows = {line[:20].strip(): line[20:].split() for line in lines[2:]}
    assert list(rows) == [
        "recipe (chunked)", "full context", "batch x2", "batch x3", "rnn_impl auto",
        "rnn_impl persistent", "loss on device",
    ]  # fmt: skip
    batches = {label: int(row[1]) for label, row in rows.items()}
    assert batches["batch x2"] > batches["recipe (chunked)"] < batches["batch x3"]
    for label, row in rows.items():
        step_ms, phases = 1e3 * float(row[2]), [float(v) for v in row[-4:]]
        assert abs(sum(phases) - step_ms) <= 0.01 * step_ms + 0.5, (label, row)
