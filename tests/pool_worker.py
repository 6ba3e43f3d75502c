"""One process of the pool test: THREADS threads each acquire and release one name ROUNDS times.

Usage: python pool_worker.py URL TABLE APP THREADS ROUNDS
APP becomes the connections' application_name, so the test can count this
process's connections. Prints "ready" once connected, starts on a line from
stdin, then prints {"granted": n, "released": n, "errors": [...], "peak": n} as JSON,
peak being the most pooled connections the Locker had open at once.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from sqlalchemy.engine import make_url

from dblock import Locker


def main() -> None:
    url, table, app = sys.argv[1:4]
    threads, rounds = int(sys.argv[4]), int(sys.argv[5])
    url = make_url(url).update_query_dict({"application_name": app}).render_as_string(hide_password=False)
    locker = Locker(url, table=table)
    locker.leases()
    print("ready", flush=True)
    sys.stdin.readline()
    counts = {"granted": 0, "released": 0}
    errors: list[str] = []
    guard = threading.Lock()

    def work() -> None:
        for _ in range(rounds):
            try:
                lease = locker.acquire("pool", ttl=30, timeout=240)
                with guard:
                    counts["granted"] += 1
                time.sleep(0.002)
                if lease.release():
                    with guard:
                        counts["released"] += 1
            except Exception as exc:  # noqa: BLE001 - reported to the test
                with guard:
                    errors.append(repr(exc))

    peak = [0]
    done = threading.Event()

    def sample() -> None:  # the pool's own count: a cut connection's server session may linger after close
        while not done.wait(0.005):
            peak[0] = max(peak[0], locker.open_connections())

    sampler = threading.Thread(target=sample)
    sampler.start()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    sampler.join()
    locker.close()
    json.dump({**counts, "errors": errors, "peak": peak[0]}, sys.stdout)


if __name__ == "__main__":
    main()
