"""What the hardware can do, measured here: the ceiling the benchmarks divide by."""

from __future__ import annotations

import statistics
import time


def cpu_fp32_peak(threads: int = 0, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a large float32 matrix product on `threads` CPU threads (0: torch's
    default, all cores): the practical peak of this CPU, as vendor BLAS reaches it."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / statistics.median(times) / 1e9
