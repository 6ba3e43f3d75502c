"""Plans: what a fencing helper sends, written once for the sync and the asyncio faces.

A plan is a generator. It checks its arguments, builds each statement and
yields it as a ``Run``, receives the statement's result, decides from it (what
to send next, what to return, which error to raise) and returns its value. It
does no I/O of its own. A face only executes what the plan yields:

- the sync face (``dblock.fencing``) runs a plan with ``run``, on a
  ``Connection`` or ``Session``;
- the asyncio face (``dblock.aio_fencing``) with ``run_async``, on an
  ``AsyncConnection`` or ``AsyncSession``.

So both faces send the same statements in the same order and read their
results the same way: the two ``run`` loops below are the only code that
differs. An error a statement raises is thrown into the plan at its
``yield``, so a plan can translate it (``with _schema_hint(...)``) as if it had
called ``execute`` itself.

A ``Probe`` is a look at the caller's connection that may need I/O but is no
statement of the plan's (e.g. whether it autocommits: a Session has to take
its connection first). The sync face calls it with its Connection or Session;
the asyncio face runs it in SQLAlchemy's greenlet (``run_sync``), with the
``sync_connection`` or ``sync_session``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Generator, Mapping, NamedTuple, TypeVar, Union

from sqlalchemy.sql.base import Executable

T = TypeVar("T")


class Run(NamedTuple):
    """A statement for the face to execute on the caller's connection or session, in its transaction."""

    statement: Executable
    params: Mapping[str, Any] | None = None
    options: Mapping[str, Any] = MappingProxyType({})  # execution_options


class Probe(NamedTuple):
    """A sync look at the caller's Connection or Session (never a statement of the plan's own)."""

    look: Callable[[Any], Any]


Step = Union[Run, Probe]
Plan = Generator[Step, Any, T]


class Failed(NamedTuple):
    """What a step raised, to throw into the plan at its ``yield``."""

    error: Exception


class Done(NamedTuple):
    """The plan's return value: nothing left to run."""

    value: Any


def advance(plan: Plan[Any], sent: Any) -> Step | Done:
    """Hand the last step's result (or Failed) to ``plan``; its next step, or Done."""
    try:
        if isinstance(sent, Failed):
            return plan.throw(sent.error)
        return plan.send(sent)
    except StopIteration as stop:
        return Done(stop.value)


def run(conn: Any, plan: Plan[T]) -> T:
    """The sync face: run ``plan`` on a Connection or Session."""
    step = advance(plan, None)
    while not isinstance(step, Done):
        try:
            if isinstance(step, Probe):
                sent = step.look(conn)
            else:
                sent = conn.execute(step.statement, step.params, execution_options=step.options)
        except Exception as exc:
            sent = Failed(exc)
        step = advance(plan, sent)
    value: T = step.value
    return value


async def run_async(conn: Any, plan: Plan[T]) -> T:
    """The asyncio face: run ``plan`` on an AsyncConnection or AsyncSession (probes in its greenlet,
    given its ``sync_connection`` or ``sync_session``)."""
    step = advance(plan, None)
    while not isinstance(step, Done):
        try:
            if isinstance(step, Probe):
                sent = await conn.run_sync(step.look)
            else:
                sent = await conn.execute(step.statement, step.params, execution_options=step.options)
        except Exception as exc:
            sent = Failed(exc)
        step = advance(plan, sent)
    value: T = step.value
    return value

