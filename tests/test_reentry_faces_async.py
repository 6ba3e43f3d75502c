"""Re-entry by an owner key (``acquire(name, owner=key)``), written once for both faces: this
asyncio module is the source and ``tests/test_reentry_faces.py`` is generated from it
(``python tools/async_to_sync.py``). Every case runs on each backend (the ``db`` fixture).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from dblock import LockNotAcquired
from dblock._acompat import ajoin, aspawn, running

from .conftest import ALL_BACKENDS, Db
from .test_faces_async import held, make
from .test_waiting_faces_async import count_statements

BACKENDS = ALL_BACKENDS

if True:  # ASYNC
    pytestmark = pytest.mark.asyncio


async def test_the_key_gets_its_own_lease_back_at_once_and_the_outermost_release_ends_it(db: Db) -> None:
    async with make(db) as locker, make(db) as other:
        outer = await locker.acquire("job", ttl=30, owner="worker-1")
        sent = count_statements(locker)
        inner = await locker.acquire("job", ttl=30, timeout=30, owner="worker-1")
        again = await locker.try_acquire("job", owner="worker-1")
        assert inner is outer and again is outer  # the same lease, the same token: not a new grant
        assert sent == []  # at once: nothing asked of the database
        assert await again.release() is True and await inner.release() is True  # inner releases end nothing
        assert sent == [] and held(db) == [("job", outer.token)]
        assert await other.try_acquire("job") is None  # still held
        assert await outer.release() is True  # the outermost release ends it
        assert held(db) == [] and await outer.release() is False


async def test_nested_lock_blocks_with_the_key_hold_until_the_outer_block_ends(db: Db) -> None:
    async with make(db) as locker:
        async with locker.lock("nested", ttl=30, owner="job-7") as outer:
            async with locker.lock("nested", ttl=30, timeout=5, owner="job-7") as inner:
                assert inner is outer
            assert held(db) == [("nested", outer.token)]
        assert held(db) == []


async def test_another_key_or_no_key_is_another_owner(db: Db) -> None:
    async with make(db) as locker:
        lease = await locker.acquire("shared-name", ttl=30, owner="a")
        assert await locker.try_acquire("shared-name", owner="b") is None
        with pytest.raises(LockNotAcquired, match="held by another owner"):
            await locker.acquire("shared-name", timeout=0.2, owner="b")
        with pytest.raises(LockNotAcquired):
            await locker.acquire("shared-name", timeout=0.2)
        await lease.release()


async def test_the_same_key_in_another_process_takes_up_the_lease_it_holds(db: Db) -> None:
    """A worker acquires with its key and dies without releasing (SIGKILL): its restart, with the same
    key, is granted the very lease (same token), before its TTL ran out; nobody else is."""
    script = (
        "import os, signal, sys\n"
        "from dblock import Locker\n"
        "locker = Locker(sys.argv[1], table=sys.argv[2])\n"
        "lease = locker.acquire('resume', ttl=60, owner='worker-42')\n"
        "print(lease.token, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script, db.url, db.table], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == -9, done.stderr
    token = int(done.stdout.split()[0])
    assert held(db) == [("resume", token)]  # the dead worker's lease, still live
    async with make(db) as restarted, make(db) as other:
        assert await other.try_acquire("resume") is None
        lease = await restarted.acquire("resume", ttl=60, timeout=5, owner="worker-42")
        assert lease.token == token  # taken up, not granted anew
        assert await lease.release() is True
        assert held(db) == []


async def test_a_lease_lost_is_not_re_entered(db: Db) -> None:
    async with make(db) as locker:
        first = await locker.acquire("lapse", ttl=30, owner="k")
        (info,) = await locker.leases("lapse")
        assert await locker.force_release(info) is True  # an operator ends it
        with pytest.raises(Exception):
            await first.extend()  # now the holder knows: lost
        second = await locker.acquire("lapse", ttl=30, timeout=5, owner="k")
        assert second is not first and second.token > first.token  # a new grant
        assert await first.release() is False
        assert await second.release() is True


async def test_a_keyed_waiter_is_granted_when_the_holder_releases(db: Db) -> None:
    async with make(db) as holder, make(db) as locker:
        lease = await holder.acquire("queue-up", ttl=30)
        out: dict[str, Any] = {}

        async def wait() -> None:
            out["lease"] = await locker.acquire("queue-up", ttl=30, timeout=30, owner="waiter")

        worker = aspawn(wait, name="keyed-waiter")
        await lease.release()
        await ajoin(worker, 60)
        assert not running(worker) and out["lease"].token > lease.token
        again = await locker.acquire("queue-up", timeout=1, owner="waiter")
        assert again is out["lease"]
        await again.release()
        await out["lease"].release()
        assert held(db) == []


async def test_bad_owner_keys_are_refused_before_any_statement(db: Db) -> None:
    async with make(db) as locker:
        for key, error in (("", ValueError), ("x" * 256, ValueError), ("a\x00b", ValueError), (7, TypeError)):
            with pytest.raises(error, match="owner key"):
                await locker.acquire("k", owner=key)
            with pytest.raises(error, match="owner key"):
                await locker.try_acquire("k", owner=key)
            with pytest.raises(error, match="owner key"):
                locker.lock("k", owner=key)
        assert held(db) == [] and locker.open_connections() == 0
