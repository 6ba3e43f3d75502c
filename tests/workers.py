"""Worker processes that start together: the shared harness of the multi-process tests.

A worker prints "ready" once connected, reads a start time (a time.monotonic()
value: one clock for every process of the machine) from stdin, waits for it,
works, and prints its report on stdout. So all workers start at the same moment
however long each took to start.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any, Awaitable, Callable


def run_together(commands: list[list[str]], *, timeout: float = 120, quiet: bool = False, **popen: object) -> list[str]:
    """Run ``commands`` as workers started together; their stdouts, in order.

    Each must exit 0; with ``quiet`` it must also write nothing to stderr
    (a worker thread's exception only shows there).
    """
    procs = [
        subprocess.Popen(  # type: ignore[call-overload]
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if quiet else None, text=True, **popen,
        )
        for command in commands
    ]
    outs: list[str] = []
    try:
        for p in procs:  # every worker connected: start them together
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        start_at = repr(time.monotonic() + 0.05)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(start_at + "\n")
            p.stdin.flush()
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err
            if quiet:
                assert err == "", err
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return outs


async def race_cancel_with_hand_off(
    holder: Any, acquire: Callable[[], Awaitable[Any]], rounds: int, check: Callable[[int], Awaitable[None]]
) -> None:
    """The asyncio cancellation race: ``holder`` releases name "race" while the task waiting
    behind it (``acquire()``) is being cancelled, at ``rounds`` offsets; ``check(i)`` runs after
    round i. A lease the task won before its cancellation landed is released (it must be live)."""
    import asyncio

    granted_to_cancelled = 0
    for i in range(rounds):
        lease = await holder.acquire("race", ttl=30, timeout=10)
        waiter = asyncio.create_task(acquire())
        await asyncio.sleep(0.05)  # queued
        release = asyncio.create_task(lease.release())
        await asyncio.sleep((i % 10) * 0.0005)
        waiter.cancel()
        await release
        try:
            got = await waiter
        except asyncio.CancelledError:
            pass
        else:  # it won before the cancel landed: a live lease, ours to release
            granted_to_cancelled += 1
            assert await got.release()
        await check(i)
    assert granted_to_cancelled < rounds, "the cancellation never raced the hand-off"
