"""Fencing for SQLAlchemy ORM sessions: a model mixin and a fenced ``Session`` block.

``Fenced`` adds ``fence_token`` to a model and makes it the mapper's version
column with ``version_id_generator=False``: every UPDATE and DELETE the ORM
flushes for the object carries ``AND fence_token = <the value it loaded>``.
Inside ``with fenced_session(session, lease):`` dblock also checks that loaded
value against the lease before the flush (refusing a row a newer lease already
wrote) and stamps the lease's token into the row. Together: the row is written
only if no newer lease wrote it, checked by the database in the same
statement as the write (G4).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from sqlalchemy import BigInteger, event, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapped, Mapper, Session, declared_attr, mapped_column, object_session
from sqlalchemy.orm.exc import StaleDataError

from .errors import FencedOut
from .fencing import TokenLike, _refused, token_of

__all__ = ["Fenced", "fenced_session"]


class Fenced:
    """Declarative mixin: a ``fence_token`` column (BIGINT NOT NULL DEFAULT 0) that fences flushes.

    ``class Account(Fenced, Base): ...``. If your model needs its own
    ``__mapper_args__``, merge in ``Fenced.fence_mapper_args(cls)``.
    """

    fence_token: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default=text("0"))

    @staticmethod
    def fence_mapper_args(cls: Any) -> dict[str, Any]:
        return {"version_id_col": cls.__table__.c.fence_token, "version_id_generator": False}

    @declared_attr.directive
    def __mapper_args__(cls) -> dict[str, Any]:
        return Fenced.fence_mapper_args(cls)


@dataclass(frozen=True)
class _Fence:
    token: int
    strict: bool


# The fence in force for each Session inside a fenced_session block.
_active: weakref.WeakKeyDictionary[Session, _Fence] = weakref.WeakKeyDictionary()


@contextmanager
def fenced_session(session: Session, lease: TokenLike, *, strict: bool = False) -> Iterator[Session]:
    """``with fenced_session(session, lease):`` every flush of a ``Fenced`` object is fenced.

    An UPDATE or DELETE of a row that a newer lease wrote raises FencedOut:
    the flush fails, the session is rolled back and nothing is written. New
    rows are stamped with the token. Changes still pending when the block
    ends are flushed before it ends, so nothing made inside escapes the fence;
    commit inside the block or after it. For ``session.execute(update(...))``
    use ``dblock.fenced_update(session, ...)``: bulk statements skip flush events.
    """
    token = token_of(lease)
    if not isinstance(session, Session):
        raise TypeError(f"fenced_session needs a SQLAlchemy Session, not {type(session).__name__}")
    if not isinstance(strict, bool):
        raise TypeError("strict must be True or False")
    if session in _active:
        raise RuntimeError("this Session is already inside a fenced_session block")
    _active[session] = _Fence(token, strict)
    try:
        yield session
        session.flush()
    except StaleDataError as exc:
        session.rollback()
        raise FencedOut(
            f"fenced out: a row changed since this session loaded it (a newer lease wrote or deleted it), "
            f"so token {token} may not write it; the session was rolled back and nothing was written",
            token=token,
            resource="a fenced row",
        ) from exc
    except FencedOut:
        session.rollback()
        raise
    finally:
        _active.pop(session, None)


def _loaded_token(target: Any) -> int | None:
    """The token the row carried when this session loaded it (loads it if it was expired)."""
    history = inspect(target).attrs.fence_token.load_history()
    if history.deleted:  # set in this flush by someone: compare with what was loaded
        return int(history.deleted[0]) if history.deleted[0] is not None else None
    if history.unchanged:
        return int(history.unchanged[0]) if history.unchanged[0] is not None else None
    return None


def _check(fence: _Fence, target: Any) -> None:
    loaded = _loaded_token(target)
    if loaded is None:
        return
    if loaded > fence.token or (fence.strict and loaded == fence.token):
        raise _refused(fence.token, f"row {inspect(target).identity!r} of {type(target).__name__}", loaded, fence.strict)


def _fence_of(target: Any) -> _Fence | None:
    session = object_session(target)
    return None if session is None else _active.get(session)


@event.listens_for(Fenced, "before_update", propagate=True)
def _before_update(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    fence = _fence_of(target)
    if fence is not None:
        _check(fence, target)
        target.fence_token = fence.token  # SET fence_token = :token ... WHERE fence_token = :loaded


@event.listens_for(Fenced, "before_delete", propagate=True)
def _before_delete(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    fence = _fence_of(target)
    if fence is not None:
        _check(fence, target)  # DELETE ... WHERE fence_token = :loaded


@event.listens_for(Fenced, "before_insert", propagate=True)
def _before_insert(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    fence = _fence_of(target)
    if fence is not None:
        target.fence_token = fence.token
