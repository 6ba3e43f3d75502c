"""One "machine" of the once-per-period test: it starts a short job under a lock when its clock says so.

Usage: python period_worker.py URL TABLE NAME MIN_HOLD OFFSET JOB
Prints "ready" once connected and reads the start time from stdin (a
time.monotonic() value, one clock for every process of the machine; see
workers.py). Its own clock runs OFFSET seconds late: it starts the job at
start + OFFSET, taking the lock with one attempt (min_hold=MIN_HOLD). If it
gets it, the job takes JOB seconds; then it releases. Prints "ran TOKEN" or
"skipped".
"""

from __future__ import annotations

import sys
import time

from dblock import Locker


def main() -> None:
    url, table, name = sys.argv[1:4]
    hold, offset, job = float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
    locker = Locker(url, table=table)
    locker.leases()  # connected (and the embedded default's file made) before the start
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    time.sleep(max(0.0, start_at + offset - time.monotonic()))
    lease = locker.try_acquire(name, ttl=30, min_hold=hold)
    if lease is None:
        print("skipped", flush=True)
        return
    time.sleep(job)
    assert lease.release() is True
    print(f"ran {lease.token}", flush=True)
    locker.close()


if __name__ == "__main__":
    main()
