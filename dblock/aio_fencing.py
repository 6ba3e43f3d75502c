"""Fenced writes for SQLAlchemy's asyncio extension: ``AsyncConnection`` and ``AsyncSession``.

The asyncio face of ``dblock.fencing`` and of ``dblock.orm.fenced_session``:
the same names, arguments and errors, awaited. Each function runs the same
plan as its sync twin (``dblock.fencing.update_plan`` and the rest), so both
send the same statements and decide the same way from their results; only
the execute step is awaited here. Drivers: psycopg's async
(``postgresql+psycopg://``) and aiosqlite (``sqlite+aiosqlite://``).

A lease is a ``Lease``, an ``AsyncLease``, or any object with their
attributes (``dblock.fencing.LeaseLike``); an ``int`` token is accepted
wherever the sync functions accept one.

``commit_guard`` checks each commit with SQLAlchemy's sync events on the
session's ``sync_session`` (the connection's ``sync_connection``):
SQLAlchemy's asyncio extension runs them inside its greenlet, where the
check's statement goes through the asyncio driver.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping, Union

from sqlalchemy.engine import Connection, Result
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError
from sqlalchemy.sql.dml import Update
from sqlalchemy.sql.selectable import Select

from ._plan import run_async
from .fencing import (
    DEFAULT_COLUMN,
    LeaseLike,
    TokenLike,
    check_plan,
    checked_commits,
    fence_plan,
    lease_ref,
    read_plan,
    refuse_autocommit,
    token_of,
    update_plan,
    upsert_plan,
)
from .orm import fence_flushes

__all__ = ["check_lease", "commit_guard", "fence", "fenced_read", "fenced_session", "fenced_update", "fenced_upsert"]

AsyncTarget = Union[AsyncConnection, AsyncSession]


def _target(conn: object, what: str) -> tuple[AsyncTarget, Connection | Session]:
    """(``conn``, its sync twin) for an AsyncConnection or AsyncSession; TypeError before any SQL otherwise."""
    if isinstance(conn, async_scoped_session):
        conn = conn()
    if isinstance(conn, AsyncSession):
        return conn, conn.sync_session
    if isinstance(conn, AsyncConnection):
        if conn.sync_connection is None:
            raise ValueError(f"{what}: this AsyncConnection is not connected yet (use `async with engine.connect()`)")
        return conn, conn.sync_connection
    raise TypeError(
        f"{what} needs a SQLAlchemy AsyncConnection or AsyncSession, not {type(conn).__name__} "
        f"(for a Connection or Session, use dblock.{what})"
    )


async def fenced_update(
    conn: AsyncTarget, stmt: Update, lease: TokenLike, *, column: str = DEFAULT_COLUMN, strict: bool = False
) -> Result[Any]:
    """``await`` ``fenced(stmt, lease)`` in the caller's transaction; FencedOut if the fence refused it.

    As ``dblock.fenced_update``: one statement when it writes; when it wrote
    nothing, one more SELECT tells a refusal (FencedOut) from no rows at all
    (returned as is, rowcount 0).
    """
    target, _ = _target(conn, "fenced_update")
    return await run_async(target, update_plan(stmt, lease, column, strict))


async def fenced_read(
    conn: AsyncTarget, stmt: Select[Any], lease: TokenLike, *, column: str = DEFAULT_COLUMN
) -> Result[Any]:
    """Stamp the lease's token on the rows ``stmt`` selects and return them, in one ``UPDATE ... RETURNING``.

    As ``dblock.fenced_read``; through an AsyncSession, mapped objects come
    back refreshed from the stamped rows.
    """
    target, sync = _target(conn, "fenced_read")
    return await run_async(target, read_plan(sync, stmt, lease, column))


async def fenced_upsert(
    conn: AsyncTarget,
    table: Any,
    values: Mapping[str, Any],
    lease: TokenLike,
    *,
    index_elements: list[str] | None = None,
    column: str = DEFAULT_COLUMN,
    strict: bool = False,
) -> None:
    """Insert a row, or update it if the fence lets this token through (one statement); as ``dblock.fenced_upsert``."""
    target, sync = _target(conn, "fenced_upsert")
    await run_async(target, upsert_plan(sync, table, values, lease, index_elements, column, strict))


async def fence(
    conn: AsyncTarget,
    lease: TokenLike,
    resource: str | None = None,
    *,
    strict: bool = False,
    table: str | None = None,
    schema: str | None = None,
) -> None:
    """Check and bump the fence of ``resource`` (default: the lease's name) in the caller's transaction.

    As ``dblock.fence``: FencedOut if the resource already accepted a newer
    token; the fences row stays locked until the transaction ends.
    """
    target, sync = _target(conn, "fence")
    await run_async(target, fence_plan(sync, lease, resource, strict, table, schema))


async def check_lease(conn: AsyncTarget, lease: LeaseLike) -> None:
    """LeaseLost unless ``lease`` is the live lease now (database time); as ``dblock.check_lease``.

    On success the lease cannot be taken over until this transaction ends.
    Call it as the transaction's last statement, or use ``commit_guard``.
    """
    ref = lease_ref(lease, "check_lease")
    target, sync = _target(conn, "check_lease")
    await run_async(target, check_plan(sync, ref))


@asynccontextmanager
async def commit_guard(conn: AsyncTarget, lease: LeaseLike) -> AsyncIterator[AsyncTarget]:
    """``async with commit_guard(session_or_conn, lease):`` commits at the end only if the lease is still live.

    As ``dblock.commit_guard``: every commit inside the block (``await
    conn.commit()`` included) first checks the lease as the transaction's
    last statement; when the check fails the transaction is rolled back and
    LeaseLost raised; on any other error the block rolls back. An AUTOCOMMIT
    connection is refused with ValueError before the block runs.
    """
    ref = lease_ref(lease, "commit_guard")
    target, sync = _target(conn, "commit_guard")
    await target.run_sync(refuse_autocommit, "commit_guard")
    with checked_commits(sync, ref):
        try:
            yield target
            await target.commit()
        except BaseException:
            await target.rollback()
            raise


@asynccontextmanager
async def fenced_session(
    session: AsyncSession, lease: TokenLike, *, strict: bool = False
) -> AsyncIterator[AsyncSession]:
    """``async with fenced_session(session, lease):`` every flush of a ``Fenced`` object is fenced.

    As ``dblock.orm.fenced_session``: an UPDATE or DELETE of a row a newer
    lease wrote raises FencedOut, the session is rolled back and nothing is
    written; new rows are stamped with the token; changes still pending when
    the block ends are flushed (not committed); if the block raises, the
    session is rolled back.
    """
    token = token_of(lease)
    if isinstance(session, async_scoped_session):
        session = session()
    if not isinstance(session, AsyncSession):
        raise TypeError(
            f"fenced_session needs a SQLAlchemy AsyncSession, not {type(session).__name__} "
            "(for a Session, use dblock.orm.fenced_session)"
        )
    with fence_flushes(session.sync_session, token, strict, lease) as flush_fence:
        try:
            yield session
            await session.flush()
        except StaleDataError as exc:
            # As in the sync block: a newer lease's token on the rows is a lost
            # lock; anything else is an ordinary concurrent change, re-raised.
            await session.rollback()
            winner = await run_async(session, flush_fence.newest_token())
            await session.rollback()  # end the read's own transaction too
            lost = flush_fence.refusal(winner)
            if lost is not None:
                raise lost from exc
            raise
        except BaseException:
            await session.rollback()
            raise
