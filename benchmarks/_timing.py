"""Interleaved timing for the benchmarks: each round runs every variant, so noise hits them alike."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(variants: dict[str, Callable[[], None]], rounds: int, calls: int, warmup: int = 20) -> dict[str, float]:
    """Median microseconds per call of each variant over ``rounds`` rounds of ``calls`` calls."""
    for fn in variants.values():  # prepare statements, fill caches
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}
