"""G4 through the ORM: the Fenced mixin and fenced_session on real databases."""

from __future__ import annotations

import secrets
from typing import Any, Iterator

import pytest
from sqlalchemy import ForeignKey, create_engine, event, select, update
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    configure_mappers,
    declared_attr,
    mapped_column,
    relationship,
)
from sqlalchemy.orm.exc import StaleDataError

import dblock
from dblock import FencedOut, Lease, fenced_update
from dblock.orm import Fenced, fenced_session

from .conftest import ALL_BACKENDS, Db

BACKENDS = ALL_BACKENDS


class Models:
    """A fresh pair of fenced models (Account 1-n Entry) on fresh tables, for one test."""

    def __init__(self, db: Db) -> None:
        suffix = secrets.token_hex(4)

        class Base(DeclarativeBase):
            pass

        class Account(Fenced, Base):
            __tablename__ = f"account_{suffix}"
            id: Mapped[int] = mapped_column(primary_key=True)
            balance: Mapped[int] = mapped_column(default=0)
            entries: Mapped[list[Entry]] = relationship(back_populates="account")

        class Entry(Fenced, Base):
            __tablename__ = f"entry_{suffix}"
            id: Mapped[int] = mapped_column(primary_key=True)
            account_id: Mapped[int | None] = mapped_column(ForeignKey(Account.id))
            account: Mapped[Account | None] = relationship(back_populates="entries")

        self.Base, self.Account, self.Entry = Base, Account, Entry
        self.engine = create_engine(db.url)
        self.statements: list[str] = []
        event.listen(self.engine, "before_cursor_execute", lambda c, cur, s, *a: self.statements.append(s))
        Base.metadata.create_all(self.engine)
        with Session(self.engine) as s:
            s.add_all([Account(id=1, balance=100), Account(id=2, balance=0), Entry(id=1, account_id=1)])
            s.commit()
        self.locker = db.locker()

    def rows(self) -> list[tuple[Any, ...]]:
        with self.engine.connect() as conn:
            accounts = conn.execute(select(self.Account.id, self.Account.balance, self.Account.fence_token)).all()
            entries = conn.execute(select(self.Entry.id, self.Entry.account_id, self.Entry.fence_token)).all()
        return sorted(map(tuple, accounts)) + sorted(map(tuple, entries))

    def write(self, lease: Lease, model: Any, id: int, **values: Any) -> None:
        """Another client's fenced write of one object, committed."""
        with Session(self.engine) as s, fenced_session(s, lease):
            obj = s.get(model, id)
            for key, value in values.items():
                setattr(obj, key, value)
            s.commit()

    def stale_and_fresh(self) -> tuple[Lease, Lease]:
        old = self.locker.acquire("accounts", ttl=0.05)
        new = self.locker.acquire("accounts", timeout=30)  # granted once `old` expired
        assert new.token > old.token
        return old, new


@pytest.fixture
def models(db: Db) -> Iterator[Models]:
    m = Models(db)
    yield m
    m.Base.metadata.drop_all(m.engine)
    m.engine.dispose()


def test_a_fresh_lease_flushes_and_stamps_its_token(models: Models) -> None:
    _, new = models.stale_and_fresh()
    with Session(models.engine) as s, fenced_session(s, new):
        s.get(models.Account, 1).balance = 90  # type: ignore[union-attr]
        s.add(models.Entry(id=2, account_id=1))
        s.commit()
    assert models.rows() == [(1, 90, new.token), (2, 0, 0), (1, 1, 0), (2, 1, new.token)]


def test_repeated_writes_by_one_lease_succeed_in_the_default_mode(models: Models) -> None:
    _, new = models.stale_and_fresh()
    with Session(models.engine) as s, fenced_session(s, new):
        account = s.get(models.Account, 1)
        for balance in (90, 80, 70):
            account.balance = balance  # type: ignore[union-attr]
            s.commit()
    assert models.rows()[0] == (1, 70, new.token)


def test_strict_mode_refuses_a_second_write_by_the_same_grant(models: Models) -> None:
    _, new = models.stale_and_fresh()
    with Session(models.engine) as s:
        with fenced_session(s, new, strict=True):
            s.get(models.Account, 1).balance = 90  # type: ignore[union-attr]
            s.commit()
        with pytest.raises(FencedOut), fenced_session(s, new, strict=True):
            s.get(models.Account, 1).balance = 80  # type: ignore[union-attr]
            s.commit()
    assert models.rows()[0] == (1, 90, new.token)


def test_a_stale_flush_of_a_row_loaded_before_the_takeover_is_refused(models: Models) -> None:
    """The stale holder loaded the row, paused; the new holder wrote; the stale flush must fail."""
    old = models.locker.acquire("accounts", ttl=0.05)
    with Session(models.engine) as stale:
        account = stale.get(models.Account, 1)  # loaded with fence_token 0 <= old.token
        new = models.locker.acquire("accounts", timeout=30)
        models.write(new, models.Account, 1, balance=50)
        before = models.rows()
        with pytest.raises(FencedOut) as caught, fenced_session(stale, old):
            account.balance = 0  # type: ignore[union-attr]
            stale.get(models.Account, 2).balance = 100  # type: ignore[union-attr]
            stale.commit()
        assert caught.value.token == old.token
        assert not stale.in_transaction()  # rolled back
    assert models.rows() == before == [(1, 50, new.token), (2, 0, 0), (1, 1, 0)]


def test_a_stale_flush_of_a_row_loaded_after_the_takeover_is_refused(models: Models) -> None:
    old, new = models.stale_and_fresh()
    models.write(new, models.Account, 1, balance=50)
    models.statements.clear()
    with Session(models.engine) as stale:
        with pytest.raises(FencedOut) as caught, fenced_session(stale, old):
            for account in stale.scalars(select(models.Account)):  # a query, not session.get
                account.balance += 1
            stale.commit()
        assert caught.value.newer == new.token
    assert not [s for s in models.statements if s.startswith("UPDATE")]  # refused before any UPDATE
    assert models.rows() == [(1, 50, new.token), (2, 0, 0), (1, 1, 0)]


def test_a_stale_delete_is_refused(models: Models) -> None:
    old, new = models.stale_and_fresh()
    with Session(models.engine) as stale:
        entry = stale.get(models.Entry, 1)
        models.write(new, models.Entry, 1, account_id=2)
        with pytest.raises(FencedOut), fenced_session(stale, old):
            stale.delete(entry)
            stale.commit()
    assert models.rows()[-1] == (1, 2, new.token)


def test_relationship_changes_are_fenced(models: Models) -> None:
    """Moving an entry through the parent's collection updates the child's row: that write is fenced too."""
    old = models.locker.acquire("accounts", ttl=0.05)
    with Session(models.engine) as stale:
        source, target = stale.get(models.Account, 1), stale.get(models.Account, 2)
        entry = source.entries[0]  # type: ignore[union-attr]
        new = models.locker.acquire("accounts", timeout=30)
        with Session(models.engine) as fresh:
            Entry = models.Entry
            fenced_update(fresh, update(Entry).where(Entry.id == 1).values(account_id=1), new)
            fresh.commit()
        with pytest.raises(FencedOut), fenced_session(stale, old):
            target.entries.append(entry)  # type: ignore[union-attr]
            stale.commit()
    with Session(models.engine) as s, fenced_session(s, new):
        target = s.get(models.Account, 2)
        target.entries.append(s.get(models.Entry, 1))  # type: ignore[union-attr, arg-type]
        s.commit()
    assert models.rows()[-1] == (1, 2, new.token)


def test_bulk_update_through_the_core_helper(models: Models) -> None:
    old, new = models.stale_and_fresh()
    Account = models.Account
    with Session(models.engine) as s:
        fenced_update(s, update(Account).where(Account.id == 1).values(balance=Account.balance - 10), new)
        s.commit()
        with pytest.raises(FencedOut):
            fenced_update(s, update(Account).where(Account.id == 1).values(balance=0), old)
        s.rollback()
    assert models.rows()[0] == (1, 90, new.token)


def test_changes_pending_at_the_end_of_the_block_are_flushed_under_the_fence(models: Models) -> None:
    old, new = models.stale_and_fresh()
    with Session(models.engine) as s:
        with fenced_session(s, new):
            s.get(models.Account, 1).balance = 1  # type: ignore[union-attr]
        s.commit()  # after the block: the UPDATE was already flushed, fenced
    assert models.rows()[0] == (1, 1, new.token)
    with Session(models.engine) as s:
        with pytest.raises(FencedOut), fenced_session(s, old):
            s.get(models.Account, 1).balance = 2  # type: ignore[union-attr]
        s.commit()  # nothing left to write
    assert models.rows()[0] == (1, 1, new.token)


def test_changes_pending_at_the_end_of_the_block_are_flushed_not_committed(models: Models) -> None:
    _, new = models.stale_and_fresh()
    with Session(models.engine) as s:
        with fenced_session(s, new):
            s.get(models.Account, 1).balance = 1  # type: ignore[union-attr]
            models.statements.clear()
        assert [q for q in models.statements if q.startswith("UPDATE")]  # flushed as the block ended
        assert s.in_transaction()
        assert models.rows()[0] == (1, 100, 0)  # another connection: nothing committed yet
        s.rollback()  # the caller decides: this discards the flushed change
    assert models.rows()[0] == (1, 100, 0)


def test_fenced_read_through_a_session_stamps_and_refreshes_the_objects(models: Models) -> None:
    """Read-modify-write in the ORM: the stamp brings loaded objects up to date and fences out the
    older holder, which read before it (without the stamp, its late write would land first)."""
    old, new = models.stale_and_fresh()
    Account = models.Account
    with Session(models.engine) as stale, Session(models.engine) as s:
        stale_account = stale.get(Account, 1)  # the old holder reads, then pauses
        account = s.get(Account, 1)  # the new holder loaded the row earlier...
        models.write(old, Account, 1, balance=50)  # ...and a late write by the old holder landed since
        models.statements.clear()
        (read,) = dblock.fenced_read(s, select(Account).where(Account.id == 1), new).scalars().all()
        stamp = 1 if models.engine.dialect.update_returning else 2  # MariaDB: the stamp, then a locking read
        assert len(models.statements) == stamp and models.statements[0].startswith("UPDATE")
        assert read is account
        assert (account.balance, account.fence_token) == (50, new.token)  # type: ignore[union-attr]
        with fenced_session(s, new):
            account.balance += 10  # type: ignore[union-attr]
            s.commit()
        assert models.rows()[0] == (1, 60, new.token)
        with pytest.raises(FencedOut), fenced_session(stale, old):
            stale_account.balance = 0  # type: ignore[union-attr]
            stale.commit()
    assert models.rows()[0] == (1, 60, new.token)


def test_fenced_read_refuses_a_row_a_newer_lease_stamped(models: Models) -> None:
    old, new = models.stale_and_fresh()
    Account = models.Account
    with Session(models.engine) as s:
        dblock.fenced_read(s, select(Account.balance).where(Account.id == 1), new)
        s.commit()
        with pytest.raises(FencedOut) as caught:
            dblock.fenced_read(s, select(Account).where(Account.id == 1), old)
        assert caught.value.newer == new.token
        s.rollback()
    assert models.rows()[0] == (1, 100, new.token)


def test_commit_guard_on_a_session(models: Models) -> None:
    locker = models.locker
    lease = locker.acquire("accounts", ttl=30)
    with Session(models.engine) as s, dblock.commit_guard(s, lease), fenced_session(s, lease):
        s.get(models.Account, 1).balance = 1  # type: ignore[union-attr]
        s.commit()  # checked: the lease is live
        s.get(models.Account, 1).balance = 2  # type: ignore[union-attr]
    assert models.rows()[0] == (1, 2, lease.token)  # the guard committed at the end of the block
    lease.release()
    with pytest.raises(dblock.LeaseLost), Session(models.engine) as s, dblock.commit_guard(s, lease):
        s.get(models.Account, 1).balance = 3  # type: ignore[union-attr]
        s.commit()
    assert models.rows()[0] == (1, 2, lease.token)


def test_fenced_session_checks_its_arguments(models: Models) -> None:
    lease = models.locker.acquire("accounts")
    with Session(models.engine) as s:
        with pytest.raises(TypeError):
            with fenced_session(s, "7"):  # type: ignore[arg-type]
                pass
        with pytest.raises(TypeError):
            with fenced_session(models.engine, lease):  # type: ignore[arg-type]
                pass
        with pytest.raises(RuntimeError), fenced_session(s, lease), fenced_session(s, lease):
            pass


def test_an_error_inside_the_block_rolls_back_so_nothing_is_written_unfenced_later(models: Models) -> None:
    old, new = models.stale_and_fresh()
    with Session(models.engine) as stale:
        account = stale.get(models.Account, 1)
        models.write(new, models.Account, 1, balance=50)
        with pytest.raises(RuntimeError), fenced_session(stale, old):
            account.balance = 0  # type: ignore[union-attr]
            raise RuntimeError("the caller's own error")
        stale.commit()  # outside the block: nothing pending may be written unfenced
    assert models.rows()[0] == (1, 50, new.token)


def test_a_model_whose_mapper_args_drop_the_fence_is_refused() -> None:
    class Base(DeclarativeBase):
        pass

    class Unfenced(Fenced, Base):
        __tablename__ = "unfenced"
        __mapper_args__ = {"eager_defaults": True}  # replaces the mixin's version_id_col
        id: Mapped[int] = mapped_column(primary_key=True)

    class Merged(Fenced, Base):
        __tablename__ = "merged"
        id: Mapped[int] = mapped_column(primary_key=True)

        @declared_attr.directive
        def __mapper_args__(cls) -> dict[str, Any]:
            return {**Fenced.fence_mapper_args(cls), "eager_defaults": True}

    assert Merged.__mapper__.version_id_col is Merged.__table__.c.fence_token  # type: ignore[attr-defined]
    try:
        with pytest.raises(TypeError, match="fence_mapper_args"):
            configure_mappers()
    finally:
        Base.registry.dispose()


def test_an_older_leases_write_is_a_concurrent_change_not_a_fence_failure(models: Models) -> None:
    """The newest holder loaded a row, then a stale fenced write landed (allowed: the row had
    seen no newer token). The newest holder's flush conflicts; it is not told it lost the lock."""
    old, new = models.stale_and_fresh()
    Account = models.Account
    with Session(models.engine) as fresh:
        account = fresh.get(Account, 1)
        with Session(models.engine) as stale:
            fenced_update(stale, update(Account).where(Account.id == 1).values(balance=7), old)
            stale.commit()
        with pytest.raises(StaleDataError), fenced_session(fresh, new):
            account.balance = 1  # type: ignore[union-attr]
            fresh.commit()
    assert models.rows()[0] == (1, 7, old.token)


def test_strict_mode_counts_the_flushes_of_one_transaction_as_one_write(models: Models) -> None:
    _, new = models.stale_and_fresh()
    with Session(models.engine) as s, fenced_session(s, new, strict=True):
        s.add(models.Account(id=3, balance=1))
        s.flush()
        s.get(models.Account, 3).balance = 2  # type: ignore[union-attr]
        s.get(models.Account, 1).balance = 1  # type: ignore[union-attr]
        s.flush()
        s.get(models.Account, 1).balance = 2  # type: ignore[union-attr]
        s.commit()
    assert models.rows()[:3] == [(1, 2, new.token), (2, 0, 0), (3, 2, new.token)]


def test_a_collection_change_does_not_write_the_parent_row(models: Models) -> None:
    _, new = models.stale_and_fresh()
    with Session(models.engine) as s, fenced_session(s, new):
        account = s.get(models.Account, 2)
        account.entries.append(models.Entry(id=5))  # type: ignore[union-attr]
        models.statements.clear()
        s.commit()
    assert not [q for q in models.statements if q.startswith(f"UPDATE {models.Account.__tablename__}")]
    assert models.rows()[1] == (2, 0, 0)
