"""Guard a job with a dblock lease on the embedded default (a per-user SQLite file).

Run it twice at once: the second run waits until the first releases the lock.
    python examples/quickstart.py
"""

import time

from dblock import Locker

locker = Locker()  # no URL: the embedded SQLite default, created on first use
with locker.lock("nightly-report", ttl=30, timeout=60) as lease:
    print(f"holding {lease.name!r} with fencing token {lease.token}; "
          f"trusted for {lease.remaining():.1f} s more")
    time.sleep(1)  # the job; pass lease.token along with every write it makes
    lease.extend()  # a job running longer than its ttl extends the lease
print("released; leases held now:", locker.leases())
