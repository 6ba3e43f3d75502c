"""Fencing for SQLAlchemy ORM sessions: a model mixin and a fenced ``Session`` block.

``Fenced`` adds ``fence_token`` to a model and makes it the mapper's version
column with ``version_id_generator=False``: every UPDATE and DELETE the ORM
flushes for the object carries ``AND fence_token = <the value it loaded>``.
Inside ``with fenced_session(session, lease):`` dblock also checks that loaded
value against the lease before the flush (refusing a row a newer lease already
wrote) and stamps the lease's token into the row. Together: the row is written
only if no newer lease wrote it, checked by the database in the same
statement as the write.

``dblock.aio_fencing.fenced_session`` is the same block for an
``AsyncSession``: it puts the same ``FlushFence`` in force on the session's
``sync_session`` (``fence_flushes``), whose flush events these handlers are.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from sqlalchemy import BigInteger, and_, event, inspect, or_, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapped, Mapper, Session, declared_attr, mapped_column, object_session, scoped_session
from sqlalchemy.orm.exc import StaleDataError

from ._plan import Plan, Run, run
from .errors import FencedOut
from .fencing import TokenLike, refused, token_of

__all__ = ["Fenced", "fenced_session"]


class Fenced:
    """Declarative mixin: a ``fence_token`` column (BIGINT NOT NULL DEFAULT 0) that fences flushes.

    ``class Account(Fenced, Base): ...``. If your model needs its own
    ``__mapper_args__``, merge in ``Fenced.fence_mapper_args(cls)``:
    ``{**Fenced.fence_mapper_args(cls), "eager_defaults": True}``. dblock checks
    at mapper configuration that the fence is in place.
    """

    fence_token: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default=text("0"))

    @staticmethod
    def fence_mapper_args(cls: Any) -> dict[str, Any]:
        table = cls.__dict__.get("__table__")
        if table is None or "fence_token" not in table.c:
            return {}  # a subclass without its own fence_token column inherits the parent's
        return {"version_id_col": table.c.fence_token, "version_id_generator": False}

    @declared_attr.directive
    def __mapper_args__(cls) -> dict[str, Any]:
        return Fenced.fence_mapper_args(cls)


@event.listens_for(Fenced, "mapper_configured", propagate=True)
def _check_mapper(mapper: Mapper[Any], cls: Any) -> None:
    # Without the version column the UPDATE would carry no check at all: a
    # model's own __mapper_args__ replacing the mixin's must fail loudly.
    col = mapper.version_id_col
    if col is None or col.key != "fence_token" or mapper.version_id_generator is not False:
        raise TypeError(
            f"{cls.__name__} mixes in dblock.orm.Fenced but its mapper does not use fence_token as "
            "version_id_col with version_id_generator=False; merge Fenced.fence_mapper_args(cls) "
            "into its __mapper_args__"
        )


@dataclass
class FlushFence:
    """The fence in force on one Session inside a fenced_session block (either face's)."""

    lease: TokenLike  # as given: refusals name it (and dblock.metrics counts them by it)
    token: int
    strict: bool
    touched: set[tuple[Mapper[Any], tuple[Any, ...]]] = field(default_factory=set)
    stamped: set[tuple[Mapper[Any], tuple[Any, ...]]] = field(default_factory=set)  # this transaction

    def newest_token(self) -> Plan[int | None]:
        """A plan: the largest token now on the rows this block tried to write (run it after the rollback)."""
        newest: int | None = None
        by_mapper: dict[Mapper[Any], list[tuple[Any, ...]]] = {}
        for mapper, identity in self.touched:
            by_mapper.setdefault(mapper, []).append(identity)
        for mapper, identities in by_mapper.items():
            table = mapper.local_table if "fence_token" in mapper.local_table.c else mapper.base_mapper.local_table
            pk = mapper.primary_key
            match = or_(*[_pk_equals(pk, identity) for identity in identities])
            found = (yield Run(select(table.c.fence_token).where(match))).scalars().all()
            for value in found:
                if newest is None or value > newest:
                    newest = value
        return newest

    def refusal(self, winner: int | None) -> FencedOut | None:
        """After a flush found its rows changed: FencedOut if ``winner`` (newest_token's) beats this lease.

        None: the change came from an older lease's write (or ours elsewhere),
        an ordinary concurrent change, not a lost lock.
        """
        if winner is not None and (winner > self.token or (self.strict and winner == self.token)):
            return refused(self.lease, "a row flushed in this session", winner, self.strict)
        return None


# The fence in force for each Session inside a fenced_session block.
_active: weakref.WeakKeyDictionary[Session, FlushFence] = weakref.WeakKeyDictionary()


@contextmanager
def fenced_session(session: Session, lease: TokenLike, *, strict: bool = False) -> Iterator[Session]:
    """``with fenced_session(session, lease):`` every flush of a ``Fenced`` object is fenced.

    An UPDATE or DELETE of a row that a newer lease wrote raises FencedOut;
    the session is rolled back and nothing is written. New rows are stamped
    with the token. Changes still pending when the block ends are flushed
    before it ends; if the block raises, the session is rolled back, so no
    change made inside can be written unfenced later. For
    ``session.execute(update(...))`` use ``dblock.fenced_update(session, ...)``:
    bulk statements skip flush events.
    """
    token = token_of(lease)
    if isinstance(session, scoped_session):
        session = session()
    if not isinstance(session, Session):
        raise TypeError(f"fenced_session needs a SQLAlchemy Session, not {type(session).__name__}")
    with fence_flushes(session, token, strict, lease) as fence:
        try:
            yield session
            session.flush()
        except StaleDataError as exc:
            # The row's token is no longer the one loaded. A newer lease's write
            # means we are fenced out; an older lease's (or our own elsewhere) is
            # an ordinary concurrent change: re-raised as is, retry with fresh data.
            session.rollback()
            winner = run(session, fence.newest_token())
            session.rollback()  # end the read's own transaction too
            lost = fence.refusal(winner)
            if lost is not None:
                raise lost from exc
            raise
        except BaseException:
            session.rollback()  # nothing made inside the block may be flushed later, unfenced
            raise


@contextmanager
def fence_flushes(session: Session, token: int, strict: bool, lease: TokenLike | None = None) -> Iterator[FlushFence]:
    """Put a FlushFence for ``token`` in force on ``session`` for the block, and take it off after.

    Shared by both faces' ``fenced_session`` (an AsyncSession's is its
    ``sync_session``). Refuses a non-bool ``strict`` and a session already
    inside a fenced_session block.
    """
    if not isinstance(strict, bool):
        raise TypeError("strict must be True or False")
    if session in _active:
        raise RuntimeError("this Session is already inside a fenced_session block")
    fence = FlushFence(token if lease is None else lease, token, strict)

    def transaction_ended(session: Session, transaction: Any) -> None:
        if transaction.parent is None:
            fence.stamped.clear()

    _active[session] = fence
    event.listen(session, "after_transaction_end", transaction_ended)
    try:
        yield fence
    finally:
        _active.pop(session, None)
        event.remove(session, "after_transaction_end", transaction_ended)


def _pk_equals(pk: Any, identity: tuple[Any, ...]) -> Any:
    return and_(*[col == value for col, value in zip(pk, identity)])


def _fence_of(target: Any) -> FlushFence | None:
    session = object_session(target)
    return None if session is None else _active.get(session)


def _loaded_token(target: Any) -> int | None:
    """The token the row carried when this session loaded it (loads it if it was expired)."""
    history = inspect(target).attrs.fence_token.load_history()
    if history.deleted:  # set in this flush by someone: compare with what was loaded
        return int(history.deleted[0]) if history.deleted[0] is not None else None
    if history.unchanged:
        return int(history.unchanged[0]) if history.unchanged[0] is not None else None
    return None


def _key(mapper: Mapper[Any], target: Any) -> tuple[Mapper[Any], tuple[Any, ...]]:
    return mapper.base_mapper, tuple(mapper.primary_key_from_instance(target))


def _check(fence: FlushFence, mapper: Mapper[Any], target: Any) -> None:
    key = _key(mapper, target)
    fence.touched.add(key)
    loaded = _loaded_token(target)
    if loaded is None:
        return
    # Strict: one write per grant, but the several flushes of one transaction
    # (autoflush, insert then update) are one write.
    again = loaded == fence.token and key not in fence.stamped
    if loaded > fence.token or (fence.strict and again):
        raise refused(fence.lease, f"row {key[1]!r} of {type(target).__name__}", loaded, fence.strict)


def _has_column_changes(mapper: Mapper[Any], target: Any) -> bool:
    attrs = inspect(target).attrs
    return any(attrs[prop.key].history.has_changes() for prop in mapper.column_attrs)


@event.listens_for(Fenced, "before_update", propagate=True)
def _before_update(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    fence = _fence_of(target)
    if fence is None or not _has_column_changes(mapper, target):
        return  # no fence in force, or only a collection changed: no UPDATE of this row
    _check(fence, mapper, target)
    target.fence_token = fence.token  # SET fence_token = :token ... WHERE fence_token = :loaded
    fence.stamped.add(_key(mapper, target))


@event.listens_for(Fenced, "before_delete", propagate=True)
def _before_delete(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    fence = _fence_of(target)
    if fence is not None:
        _check(fence, mapper, target)  # DELETE ... WHERE fence_token = :loaded


@event.listens_for(Fenced, "before_insert", propagate=True)
def _before_insert(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    fence = _fence_of(target)
    if fence is not None:
        target.fence_token = fence.token


@event.listens_for(Fenced, "after_insert", propagate=True)
def _after_insert(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    fence = _fence_of(target)
    if fence is not None:
        fence.stamped.add(_key(mapper, target))  # now it has its primary key
