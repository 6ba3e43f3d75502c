"""The one-round-trip verbs of a Locker: each builds its binds, sends one statement and decodes its rows.

Written once for both faces (``tools/async_to_sync.py`` writes ``_verbs.py``
from this module). The statements and what their rows mean are the
backend's (``dblock.backends``); the driver sends them in bounded time. Here is
what a verb needs around its statement: the binds, the follow-up a backend
may need (SQLite's holder after a miss), the check after a release whose reply
was lost, and when the statement was sent (a lease is trusted from then, G5: the
driver's ``Result.sent_at``, taken on an open connection, so connecting is not counted).
No waiting, no threads or tasks, no lease objects: the faces build on these.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import _core as core
from . import _process as process
from ._core import Ended, Extended, Grant, Miss, Queued
from ._defaults import QUIT_WITHIN
from ._lease_state import LeaseInfo

if TYPE_CHECKING:
    from ._adriver import AsyncDriver
    from .backends import Backend


def quit_now(backend: Backend, proc: str, deadline: float) -> None:
    """At a clean exit: delete heartbeat row ``proc`` on a connection of its own (the Locker's
    pool may be gone with its event loop); the caller bounds the time (``_process.at_exit``)."""
    raw = backend.connect(deadline)
    try:
        backend.execute(backend.cursor(raw), backend.queue.quit, {"proc": proc})
    finally:
        raw.close()


class AsyncVerbs:
    """The statements of one Locker's table, one round trip each (the rare second one is named)."""

    def __init__(
        self,
        backend: Backend,
        driver: AsyncDriver,
        *,
        op_timeout: float,
        label: Callable[[], str],
        proc: Callable[[], str],
        lapse: float,
    ) -> None:
        self.backend = backend
        self.driver = driver
        self.op_timeout = op_timeout
        self._label = label  # who asks, written with each grant (the Locker's label)
        self._proc = proc  # this process's liveness id in the fair queue
        self._lapse = lapse  # seconds a heartbeat keeps this process's waiters alive
        self._cut = backend.caps.cut_statements
        # (pid, at-exit handle) once this process sent a statement that writes its heartbeat row
        # (a fair waiter's look, or a beat): close(), or else a clean exit, deletes the row.
        self._wrote: tuple[int, int] | None = None
        self._wrote_lock = threading.Lock()

    # -- deadlines -------------------------------------------------------------
    def deadline(self) -> float:
        """The deadline of a one-statement call starting now."""
        return time.monotonic() + self.op_timeout

    def bound(self, deadline: float) -> float:
        """The deadline of one statement of a wait that ends at ``deadline`` (``core.statement_deadline``)."""
        return core.statement_deadline(time.monotonic(), deadline, self.op_timeout, not self._cut)

    # -- acquiring -------------------------------------------------------------
    async def acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        limit: int | None | bool,
        deadline: float,
        *,
        waiting: bool = False,
        label: str | None = None,
    ) -> tuple[Grant | Miss, int | None, float]:
        """One attempt (``limit`` False: the exclusive lock; None: a reader; an int: a semaphore slot;
        ``core.UPGRADEABLE``: the upgradeable reader).

        Returns the outcome, the slots a shared grant left free (None: no limit
        binds), and when the statement was sent.
        """
        sql = self.backend.sql
        params: dict[str, Any] = {"name": name, "owner": owner, "ttl": ttl, "label": label or self._label()}
        if core.shared_kind(limit):
            params["limit"] = core.limit_bind(limit)
            params["upgradeable"] = core.upgradeable_bind(limit)
            result = await self.driver.run(
                sql.share_acquire, params, sql.share_holder, deadline=deadline, waiting=waiting
            )
            outcome, free = self.backend.share_acquired(result.rows, result.extra)
            return outcome, free, result.sent_at
        result = await self.driver.run(sql.acquire, params, sql.holder, deadline=deadline, waiting=waiting)
        return self.backend.acquired(result.rows, result.extra), None, result.sent_at

    async def enqueue(
        self,
        name: str,
        owner: str,
        ttl: float,
        limit: int | None | bool,
        ident: tuple[int, str] | None,
        until: float | None,
        seq: int | None,
        deadline: float,
        *,
        label: str | None = None,
    ) -> tuple[Grant | Queued | None, float]:
        """One look of a fair waiter: granted, or its place in line (None: look again); and when it was sent."""
        queue = self.backend.queue
        if self._wrote is None or self._wrote[0] != process.pid:
            self._writes_row()
        result = await self.driver.run(
            queue.share_enqueue if core.shared_kind(limit) else queue.enqueue,
            {
                "name": name, "owner": owner, "ttl": ttl, "label": label or self._label(),
                "proc": self._proc(), "lapse": self._lapse,
                "pid": ident[0] if ident else None, "start": ident[1] if ident else None,
                "until": until, "seq": seq, "limit": core.limit_bind(limit),
                "upgradeable": core.upgradeable_bind(limit),
            },
            deadline=deadline,
            waiting=True,
        )
        return self.backend.enqueued(result.rows), result.sent_at

    async def cancel(self, name: str, owner: str, seq: int | None, deadline: float) -> Grant | None:
        """Leave the fair queue: the lease a release handed ``owner`` first, or None."""
        rows = (
            await self.driver.run(
                self.backend.queue.cancel, {"name": name, "owner": owner, "seq": seq}, deadline=deadline
            )
        ).rows
        return self.backend.cancelled(rows)

    async def beat(self) -> None:
        """This process's fair waiters are alive for ``lapse`` more seconds."""
        binds = {"proc": self._proc(), "lapse": self._lapse}
        if self._wrote is None or self._wrote[0] != process.pid:
            self._writes_row()
        await self.driver.run(self.backend.queue.beat, binds, deadline=self.deadline())

    def _writes_row(self) -> None:
        """This process is about to write its heartbeat row: have a clean exit delete it, unless
        ``quit`` does first. Before the statement is sent, as it may write though its reply is lost."""
        with self._wrote_lock:
            if self._wrote is not None and self._wrote[0] == process.pid:
                return
            backend, proc = self.backend, self._proc()
            handle = process.at_exit(self.quit_within(), lambda deadline: quit_now(backend, proc, deadline))
            self._wrote = (process.pid, handle)

    def quit_within(self) -> float:
        """How long ``quit`` (close) or a clean exit may take to delete the heartbeat row."""
        return min(self.op_timeout, QUIT_WITHIN)

    async def quit(self, deadline: float) -> bool:
        """Delete this process's heartbeat row, if it wrote one (a Locker's close): True if it was
        sent. Withdraws the at-exit deletion either way: a row that could not be deleted by
        ``deadline`` lapses, and nothing deletes another process's row (a fork's child has its own)."""
        with self._wrote_lock:
            wrote, self._wrote = self._wrote, None
        if wrote is None or wrote[0] != process.pid:
            return False
        process.done_at_exit(wrote[1])
        await self.driver.run(self.backend.queue.quit, {"proc": self._proc()}, deadline=deadline)
        return True

    # -- a lease's verbs -------------------------------------------------------
    # ``shared``: a reader's or semaphore holder's lease, whose verbs are the shared statements.
    async def extend(
        self, name: str, owner: str, token: int, ttl: float, deadline: float, shared: bool = False
    ) -> Extended | None:
        """Extend the lease by ``ttl`` s (database clock); None if it was released or taken over."""
        sql = self.backend.sql
        result = await self.driver.run(
            sql.share_extend if shared else sql.extend,
            {"name": name, "owner": owner, "token": token, "ttl": ttl},
            deadline=deadline,
        )
        rows = result.rows
        return Extended(core.when(rows[0][0]), result.sent_at) if rows else None

    async def extend_many(
        self, leases: Sequence[tuple[str, str, int, float]], deadline: float, shared: bool = False
    ) -> tuple[float, list[datetime | None]]:
        """Renewal's extend: (name, owner, token, ttl) of each lease, in one statement.

        Returns when it was sent, and per lease (in the order given) its new
        expiry, or None if it was not extended (released or taken over). A
        background statement (``waiting``): however many leases renew, it
        leaves a connection of the pool for releases and other calls.
        """
        sql = self.backend.sql
        params = self.backend.batch(sorted(leases))  # by name: row locks in one order
        result = await self.driver.run(
            sql.share_extend_many if shared else sql.extend_many, params, deadline=deadline, waiting=True
        )
        return result.sent_at, self.backend.extended(result.rows, [(lease[0], lease[2]) for lease in leases])

    async def end(self, key: dict[str, Any], deadline: float, hold: float = 0.0, *, shared: bool = False) -> Ended:
        """Release the lease ``key`` (name, owner, token): ended by this call, or kept until
        ``hold`` s after its grant if that has not passed yet (``sql.release_held``).
        ``shared``: a reader's or semaphore holder's lease (no hold)."""
        sql = self.backend.sql
        held = core.holds(hold) and not shared
        if shared:
            result = await self.driver.run(sql.share_release, key, deadline=deadline)
        elif held:
            result = await self.driver.run(sql.release_held, {**key, "hold": hold}, deadline=deadline)
        else:
            result = await self.driver.run(sql.release, key, deadline=deadline)
        if not result.rows and result.retried:
            # The first try may have ended the lease before its reply was lost.
            # Ours ended without a takeover if the row still has our token, free.
            # (A hold the first try set is set again by the retry itself.)
            released = sql.share_released if shared else sql.released
            return self.backend.ended((await self.driver.run(released, key, deadline=deadline)).rows, held=False)
        return self.backend.ended(result.rows, held)

    async def upgrade(
        self, name: str, owner: str, token: int, ttl: float, deadline: float
    ) -> tuple[Grant | Miss | None, float]:
        """One attempt to turn the upgradeable reader's lease (``token``) into the write lease:
        granted (the write lease's token and expiry), a miss (other holders; from now on no
        shared lease of ``name`` is granted until this owner upgrades or withdraws), or None
        (the read lease is gone); and when the statement was sent."""
        result = await self.driver.run(
            self.backend.sql.upgrade, {"name": name, "owner": owner, "token": token, "ttl": ttl}, deadline=deadline
        )
        rows, sent_at = result.rows, result.sent_at
        if not rows:
            return None, sent_at
        granted, new_token, expires_at, wait = rows[0]
        if granted:
            return Grant(int(new_token), core.when(expires_at)), sent_at
        return Miss(None if wait is None else float(wait)), sent_at

    async def downgrade(
        self, name: str, owner: str, token: int, ttl: float, deadline: float
    ) -> tuple[Grant | None, float]:
        """The write lease (``token``) back to the upgradeable reader's lease, or that reader's ask to
        upgrade withdrawn: its token and expiry, None if the lease was released or taken over; and
        when the statement was sent."""
        result = await self.driver.run(
            self.backend.sql.downgrade, {"name": name, "owner": owner, "token": token, "ttl": ttl}, deadline=deadline
        )
        rows = result.rows
        return (Grant(int(rows[0][0]), core.when(rows[0][1])) if rows else None), result.sent_at

    async def forget(self, name: str, owner: str, shared: bool = False) -> None:
        """After an attempt whose reply was lost: take ``owner`` out of ``name``'s queue, and end
        its lease (``shared``: its shared lease) if it holds one."""
        sql = self.backend.sql
        # With a fair queue, owned is cancel: the queue entry goes too, exclusive and shared waiters alike.
        rows = (
            await self.driver.run(
                sql.share_owned if shared else sql.owned,
                {"name": name, "owner": owner, "seq": None},
                deadline=self.deadline(),
            )
        ).rows
        token = self.backend.owned(rows)
        if token is not None:
            await self.end({"name": name, "owner": owner, "token": token}, self.deadline(), shared=shared)

    async def relabel(self, name: str, owner: str, token: int, label: str, channel: str) -> datetime | None:
        """Set the lease's label (an election's value), notifying ``channel`` where the database can:
        the lease's grant time, or None if it was released or taken over."""
        rows = (
            await self.driver.run(
                self.backend.sql.relabel,
                {"name": name, "owner": owner, "token": token, "label": label, "channel": channel},
                deadline=self.deadline(),
            )
        ).rows
        return core.when(rows[0][0]) if rows else None

    # -- operators -------------------------------------------------------------
    async def leases(self, name: str | None = None) -> list[LeaseInfo]:
        """The unexpired leases now (of ``name`` only, if given), ``remaining`` by the database clock."""
        sql = self.backend.sql
        statement, params = (sql.leases, {}) if name is None else (sql.leases_of, {"name": name})
        rows = (await self.driver.run(statement, params, deadline=self.deadline())).rows
        return [
            LeaseInfo(n, o, t, core.when(a), core.when(e), float(r), label, bool(sh), lim)
            for n, o, t, a, e, r, label, sh, lim in rows
        ]

    async def waiters(self) -> dict[str, int]:
        """How many wait in each name's fair queue now (empty without a fair queue)."""
        if not self.backend.caps.fair_queue:
            return {}
        rows = (await self.driver.run(self.backend.queue.waiters, {}, deadline=self.deadline())).rows
        return {name: count for name, count in rows}

    async def prune(self, age: float) -> int:
        """Delete rows of names nobody held for ``age`` s (and shared leases that ended that long ago)."""
        sql = self.backend.sql
        rows = (await self.driver.run(sql.prune, {"age": age}, before=sql.prune_lock, deadline=self.deadline())).rows
        await self.driver.run(sql.share_prune, {"age": age}, deadline=self.deadline())
        return len(rows)
