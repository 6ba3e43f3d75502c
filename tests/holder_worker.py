"""A lease holder in its own process, driven line by line over stdin.

Usage: python holder_worker.py URL TABLE NAME TTL
Acquires NAME and prints its token; then for each stdin line runs the command
and prints the outcome: "extend" -> "extended" | "lost"; "release" -> "True" |
"False"; "remaining" -> seconds; "exit" ends the process.
"""

from __future__ import annotations

import sys

from dblock import LeaseLost, Locker


def main() -> None:
    url, table, name, ttl = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    locker = Locker(url, table=table)
    lease = locker.acquire(name, ttl=ttl, timeout=30)
    print(lease.token, flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "extend":
            try:
                lease.extend()
                print("extended", flush=True)
            except LeaseLost:
                print("lost", flush=True)
        elif command == "release":
            print(lease.release(), flush=True)
        elif command == "remaining":
            print(lease.remaining(), flush=True)
        elif command == "exit":
            break


if __name__ == "__main__":
    main()
