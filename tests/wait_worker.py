"""A waiter in its own process: queue for a name, report the grant, release.

Usage: python wait_worker.py URL TABLE NAME TIMEOUT [fair|poll|line]
Prints "granted TOKEN" or "timeout", then releases at once and exits. The
test reads the lock row's queue to know when this waiter has joined it.
"""

from __future__ import annotations

import sys

from dblock import Locker, LockNotAcquired

MODES = {"fair": {}, "poll": {"notify": False}, "line": {"fair": False}}


def main() -> None:
    url, table, name, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "fair"
    locker = Locker(url, table=table, **MODES[mode])  # type: ignore[arg-type]
    try:
        lease = locker.acquire(name, timeout=timeout)
    except LockNotAcquired:
        print("timeout", flush=True)
        return
    print("granted", lease.token, flush=True)
    lease.release()
    locker.close()


if __name__ == "__main__":
    main()
