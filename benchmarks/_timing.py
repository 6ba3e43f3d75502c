"""Interleaved timing for the benchmarks: each round runs every variant, so noise hits them alike."""

from __future__ import annotations

import random
import statistics
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


def rotation(variants: dict[str, T], r: int) -> list[tuple[str, T]]:
    """Round ``r``'s order: a shuffle, the same for the same ``r`` in every run. A variant's speed
    here depends on what ran just before it (whose database process was awake, on which CPU), so
    each variant follows each other one, and the end of the previous round, about equally often.
    (Rotating one order would not do: it keeps every variant after the same neighbour.)"""
    order = list(variants.items())
    random.Random(r).shuffle(order)
    return order


async def ainterleaved(variants: dict[str, Callable[[], Awaitable[None]]], rounds: int, calls: int) -> dict[str, float]:
    """``interleaved`` for coroutine functions, awaited on the running event loop."""
    for fn in variants.values():
        for _ in range(20):
            await fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name, fn in rotation(variants, r):
            start = time.perf_counter()
            for _ in range(calls):
                await fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def interleaved(variants: dict[str, Callable[[], None]], rounds: int, calls: int, warmup: int = 20) -> dict[str, float]:
    """Median microseconds per call of each variant over ``rounds`` rounds of ``calls`` calls."""
    for fn in variants.values():  # prepare statements, fill caches
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name, fn in rotation(variants, r):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}
