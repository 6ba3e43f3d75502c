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
    order = list(variants.items())
    for r in range(rounds):
        # Rotate who goes first: a variant's speed here depends on what ran just before it
        # (whose database process was awake, on which CPU), so no variant always follows the same one.
        for name, fn in order[r % len(order):] + order[: r % len(order)]:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}
