"""One process of the read-modify-write race (issue 11): threads incrementing a counter by hand.

Usage: python rmw_worker.py URL TABLE COUNTER TTL THREADS DURATION MODE
Each thread loops for DURATION seconds (longer, up to 10x, until the process
made 15 attempts): acquire "counter" with TTL, read the
counter, pause 0-8 ms (often past the TTL, so another thread takes over), write
read + 1 with fenced_update in the same transaction, release. MODE is how it
reads: "stamp" through dblock.fenced_read (the documented pattern), "naive"
with a plain SELECT. Once connected it prints "ready" and reads the start time
(a time.monotonic() value) from stdin, so all processes start together. Then it
prints one JSON object: accepted (writes committed), refused (FencedOut) and
takeovers (releases that found the lease already taken over).
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

from sqlalchemy import create_engine, select, update

import dblock
from fence_worker import counter_table  # this script's folder is on sys.path


def main() -> None:
    url, table, counter = sys.argv[1:4]
    ttl, threads, duration, mode = float(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), sys.argv[7]
    locker = dblock.Locker(url, table=table)
    engine = create_engine(url, connect_args={"timeout": 30} if url.startswith("sqlite") else {})
    t = counter_table(counter)
    read = select(t.c.n).where(t.c.id == 1)
    locker.leases()  # connected before the start
    with engine.connect():
        pass
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    totals = {"accepted": 0, "refused": 0, "takeovers": 0}
    guard = threading.Lock()

    def loop() -> None:
        rng = random.Random()
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end, last = start_at + duration, start_at + 10 * duration
        # Run DURATION, and longer (up to 10x) while this process has made fewer than 15
        # attempts: a slow or busy machine must not turn the race into no race.
        while time.monotonic() < end or (totals["accepted"] + totals["refused"] < 15 and time.monotonic() < last):
            lease = locker.acquire("counter", ttl=ttl, timeout=30)
            try:
                with engine.begin() as conn:
                    if mode == "stamp":
                        n = dblock.fenced_read(conn, read, lease).scalar_one()
                    else:
                        n = conn.execute(read).scalar_one()
                    time.sleep(rng.uniform(0, 0.008))
                    dblock.fenced_update(conn, update(t).where(t.c.id == 1).values(n=n + 1), lease)
                outcome = "accepted"  # counted only once committed
            except dblock.FencedOut:
                outcome = "refused"
            taken_over = not lease.release()
            with guard:
                totals[outcome] += 1
                totals["takeovers"] += taken_over

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    locker.close()
    engine.dispose()
    print(json.dumps(totals), flush=True)


if __name__ == "__main__":
    main()
