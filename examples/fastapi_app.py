"""A FastAPI app: one report per customer at a time, across every worker and server, with fenced writes.

    pip install 'dblock[binary,asyncio]' fastapi uvicorn   # asyncio: SQLAlchemy's AsyncEngine needs greenlet
    DATABASE_URL=postgresql+psycopg://app@db/app uvicorn examples.fastapi_app:app --workers 4

POST /reports/{customer} builds the customer's report unless one is being
built already (409). The lock is an AsyncLocker's, so waiting never blocks the
event loop, and the report row is written with the lease's fencing token: a
worker that stalled past its lease cannot overwrite a newer report.
With no DATABASE_URL it runs on the embedded SQLite default.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, HTTPException
from sqlalchemy import BigInteger, Column, MetaData, String, Table, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import dblock
from dblock.aio import AsyncLocker, fenced_update
from dblock.schema import default_sqlite_path

DATABASE_URL = os.environ.get("DATABASE_URL") or f"sqlite+aiosqlite:///{default_sqlite_path()}"
LOCK_TABLE = os.environ.get("DBLOCK_TABLE", "locks")
WORK_SECONDS = float(os.environ.get("REPORT_SECONDS", "0.2"))  # stands in for the real work

reports = Table(
    "reports",
    MetaData(),
    Column("customer", String(100), primary_key=True),
    Column("body", String, nullable=False),
    Column("fence_token", BigInteger, nullable=False, default=0),
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = create_async_engine(DATABASE_URL)
    async with engine.begin() as conn:
        await conn.run_sync(reports.metadata.create_all)
    async with AsyncLocker(engine, table=LOCK_TABLE) as locker:
        await locker.create_schema()
        app.state.engine, app.state.locker = engine, locker
        yield
    await engine.dispose()


app = FastAPI(lifespan=lifespan)


@app.post("/reports/{customer}")
async def build_report(customer: str) -> dict[str, object]:
    locker: AsyncLocker = app.state.locker
    engine: AsyncEngine = app.state.engine
    try:
        # timeout=0: answer at once if another worker is on it; renew: the lease outlives slow work.
        async with locker.lock(f"report-{customer}", ttl=10, timeout=0, renew=True) as lease:
            body = await make_report(customer)
            async with engine.begin() as conn:
                await ensure_row(conn, customer)
                # Refused (FencedOut) if a newer lease has written the row meanwhile.
                await fenced_update(conn, update(reports).where(reports.c.customer == customer).values(body=body), lease)
            return {"customer": customer, "token": lease.token}
    except dblock.LockNotAcquired:
        raise HTTPException(409, f"a report for {customer} is being built already") from None
    except dblock.FencedOut:
        raise HTTPException(409, f"a newer report for {customer} was written meanwhile") from None


async def make_report(customer: str) -> str:
    await asyncio.sleep(WORK_SECONDS)
    return f"report for {customer}"


async def ensure_row(conn: object, customer: str) -> None:
    insert = pg_insert if DATABASE_URL.startswith("postgresql") else sqlite_insert
    stmt = insert(reports).values(customer=customer, body="", fence_token=0).on_conflict_do_nothing()
    await conn.execute(stmt)  # type: ignore[attr-defined]
