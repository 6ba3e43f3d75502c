"""A waiter in its own process: queue for a name, report the grant, release.

Usage: python wait_worker.py URL TABLE NAME TIMEOUT [fair|poll|line|slow] [write|read|sem:N] [hold] [go]
Prints "granted TOKEN" or "timeout", then releases at once and exits; with
"hold", it waits for a line on stdin before it releases (and prints "released").
With "go", it starts up and connects first, prints "ready", and joins the line only
once it reads a line on stdin: a test can then time its arrival (a slow machine's
interpreter start-up is no part of it).
Mode "slow" is "fair" with looks up to a minute apart, "still" with every look a minute
apart: only a release's notification wakes it in time. The kind: the exclusive (write) lock, a reader, or a holder
of a semaphore of N. The test reads the queue (``Locker.waiters``) to know
when this waiter has joined it.
"""

from __future__ import annotations

import sys

from dblock import Locker, LockNotAcquired

MODES = {
    "fair": {}, "poll": {"notify": False}, "line": {"fair": False}, "slow": {"poll_max": 60.0},
    "still": {"poll_min": 60.0, "poll_max": 60.0},  # no look of its own within a test: a hand-off wakes it
}


def main() -> None:
    url, table, name, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "fair"
    kind = sys.argv[6] if len(sys.argv) > 6 else "write"
    hold, go = "hold" in sys.argv[7:], "go" in sys.argv[7:]
    locker = Locker(url, table=table, **MODES[mode])  # type: ignore[arg-type]
    if go:
        locker.waiters()  # connected: what is left after "go" is the joining
        print("ready", flush=True)
        sys.stdin.readline()
    if kind == "write":
        acquire = locker.acquire
    else:
        side = locker.readers(name) if kind == "read" else locker.semaphore(name, int(kind.split(":")[1]))
        acquire = lambda name, **options: side.acquire(**options)  # noqa: E731
    try:
        lease = acquire(name, timeout=timeout, ttl=60)
    except LockNotAcquired:
        print("timeout", flush=True)
        return
    print("granted", lease.token, flush=True)
    if hold:
        sys.stdin.readline()
    print("released", lease.release(), flush=True)
    locker.close()


if __name__ == "__main__":
    main()
