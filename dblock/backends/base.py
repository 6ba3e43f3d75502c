"""What every database behind dblock provides: its statements, row decoders, connections and abilities.

A backend is one class per database (``postgresql.py``, ``sqlite.py``). The
faces (``Locker``, ``AsyncLocker``), fencing, migrations and the CLI ask their
backend, never the dialect's name: adding a database is writing one module
that subclasses ``Backend`` and registering it in ``backends/__init__.py``.

What a backend must provide (the abstract members below, each with its
contract):

- ``statements()``: every lock statement (``Statements``), each with a
  contract comment: binds, rows returned, what zero rows means. A fair queue
  (``Capabilities.fair_queue``) adds ``QueueStatements``.
- row decoders: ``acquired``, ``share_acquired``, ``owned`` (and, with a fair
  queue, ``enqueued``, ``cancelled``); ``ended`` and ``extended`` are the same
  row shapes everywhere and live here.
- ``batch()``: the binds of ``extend_many`` for a list of leases.
- connections: ``connect``/``aconnect`` (bounded by a deadline),
  ``execute``/``aexecute``, ``is_broken`` and ``translate`` (a driver error as
  dblock's own), and ``set_writer_wait`` where the database, not a cut
  socket, bounds a statement (``Capabilities.cut_statements`` False).
- fencing's live-lease checks (``lease_check``, ``shared_check``) and its
  upsert construct (``insert``).
- migrations read only ``caps``: the queue's tables (``fair_queue``), where
  tokens come from (``token_sequence``), how racing migrations take turns
  (``advisory_lock``) and whether to check replication (``replication``).

Capabilities are typed data (``Capabilities``), as SQLAlchemy's dialect flags
are: a face asks ``backend.caps.fair_queue``, not which database it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Sequence

from .. import _core as core
from .._core import Grant, Miss, Queued, Rows
from .._faults import no_table
from ..errors import DBLockError, SchemaMissing
from ..schema import SHARED_OWNER

if TYPE_CHECKING:
    from sqlalchemy.engine import URL, Dialect, Engine


# The most a statement waits for another writer where the database bounds it (SQLite).
WRITER_WAIT_MS = 30_000


@dataclass(frozen=True)
class Capabilities:
    """What a database can do, as dblock uses it."""

    # Waiters queue in a table of their own and a release hands the lease to
    # the first live one in the same statement (QueueStatements). Without it,
    # waiters poll with backoff, threads of one process taking turns.
    fair_queue: bool
    # A hand-off can wake the waiting process (LISTEN/NOTIFY).
    notify: bool
    # Tables may live in a named schema (``Locker(schema=...)``).
    schemas: bool
    # A statement still running at its deadline is cut off by shutting its
    # socket down. False: the database bounds it itself (SQLite's busy
    # timeout, its only wait being for another writer), so a wait's
    # statements need no grace past the wait's deadline.
    cut_statements: bool
    # How ``extend_many`` takes its leases: parallel arrays, or one JSON text.
    batch_binds: Literal["arrays", "json"]
    # Statements can be prepared on the server once per connection.
    server_prepare: bool
    # Tokens come from a sequence (else from max(token) + 1 under the one writer).
    token_sequence: bool
    # Migrations can hold an advisory lock while they run (else the database's write lock).
    advisory_lock: bool
    # Standbys may stream from the server: migrations warn when they do not confirm commits.
    replication: bool
    # Triggers on the holders table keep a name's row in step with its shared leases (else the
    # fair queue's functions do, or the share statements themselves).
    triggers: bool = False
    # One counter issues the table's tokens, so they grow across names too. False (MariaDB):
    # each name counts its own (certified with its row on a Galera cluster, where a sequence
    # is per node); a name's tokens still only grow.
    global_tokens: bool = True
    # prune forgets no name granted within this many seconds, whatever its older_than says
    # (MariaDB: a new name's first token is read without a lock, see backends/mariadb.py).
    prune_floor: float = 0.0


@dataclass(frozen=True)
class Statements:
    """Every lock statement of one table, as the driver sends it. Contracts in the backends."""

    acquire: str
    holder: str | None  # run after an acquire that returned no row (None: the acquire reports the wait)
    release: str
    release_held: str  # release of a lease with a minimum hold (min_hold > 0)
    released: str
    extend: str
    extend_many: str  # renewal: many leases in one statement (binds: ``Backend.batch``)
    leases: str
    leases_of: str  # the rows of ``leases`` for one name (binds: name)
    prune: str
    prune_lock: str | None  # runs before prune, in its transaction (None: nothing needed)
    owned: str  # after an attempt whose reply was lost: the token owner holds (``Backend.owned``)
    share_acquire: str
    share_holder: str | None  # as holder, for share_acquire
    share_release: str
    share_released: str
    share_extend: str
    share_extend_many: str
    share_owned: str  # as owned, for a shared attempt
    share_prune: str  # after prune: forget shared leases that ended long ago
    # A lease's label (an election's value) changed by its holder: binds name, owner, token, label,
    # channel. One row (acquired_at) when the lease was still this owner's; zero rows: released or
    # taken over. Where ``caps.notify``, it also notifies ``channel``: "token acquired_at label".
    relabel: str
    # The upgradeable read lock: a reader's lease that becomes the name's write lease once the
    # reader holds alone (binds name, owner, token, ttl; one row: granted, token, expires_at,
    # wait), and the way back, or an ask to upgrade withdrawn (one row: token, expires_at).
    # Contracts in backends/postgresql.py.
    upgrade: str
    downgrade: str


@dataclass(frozen=True)
class QueueStatements:
    """The fair queue's statements (``Capabilities.fair_queue``). Contracts in the backend."""

    enqueue: str
    share_enqueue: str
    cancel: str
    beat: str
    quit: str
    waiters: str


class Unsupported(DBLockError):
    """The database has no such ability (see ``Backend.caps``)."""


class Backend:
    """One database's statements, decoders, connections and capabilities, for one lock table.

    Made once per Locker (``backends.for_engine``); the faces read ``sql`` (and
    ``queue``) on every call, so a test may swap a statement on one Locker.
    """

    name: ClassVar[str]  # the SQLAlchemy backend name, as metrics and messages show it
    title: ClassVar[str]  # for people: "PostgreSQL"
    caps: ClassVar[Capabilities]
    # The driver's errors: what a statement raises when the database refused it or went away.
    errors: ClassVar[tuple[type[BaseException], ...]]

    def __init__(self, engine: Engine, table: str, schema: str | None, where: str, *, prepare: bool = True) -> None:
        if schema is not None and not self.caps.schemas:
            raise ValueError(f"schema is not supported on {self.title}; leave it None")
        self.engine = engine
        self.table = table
        self.schema = schema
        self.where = where  # the URL without its password, for messages
        # False behind a transaction pooler (PgBouncer pool_mode=transaction):
        # a statement prepared on one server session may be run by another
        # client's session with that client's parameters.
        self.prepare = prepare
        # A connect succeeded once: a refused connection since is the server away, not the URL.
        self.reached = False
        self.sql = self.statements(engine.dialect, table, schema)
        self._queue = self.queue_statements(engine.dialect, table, schema) if self.caps.fair_queue else None

    # -- statements ------------------------------------------------------------
    @classmethod
    def statements(cls, dialect: Dialect, table: str, schema: str | None) -> Statements:
        raise NotImplementedError

    @classmethod
    def queue_statements(cls, dialect: Dialect, table: str, schema: str | None) -> QueueStatements:
        raise Unsupported(f"{cls.title} has no fair queue")

    @property
    def queue(self) -> QueueStatements:
        """The fair queue's statements; ``Unsupported`` where ``caps.fair_queue`` is False."""
        if self._queue is None:
            raise Unsupported(f"{self.title} has no fair queue")
        return self._queue

    @queue.setter
    def queue(self, statements: QueueStatements) -> None:
        self._queue = statements

    # -- rows into outcomes ----------------------------------------------------
    @staticmethod
    def acquired(rows: Rows, holder: Rows) -> Grant | Miss:
        """The outcome of ``sql.acquire`` (and of ``sql.holder`` after a miss, where there is one)."""
        raise NotImplementedError

    @staticmethod
    def share_acquired(rows: Rows, holder: Rows) -> tuple[Grant | Miss, int | None]:
        """The outcome of ``sql.share_acquire`` (and ``sql.share_holder``), and on a grant the
        slots it left free (None: no limit binds; <= 0: the semaphore is full)."""
        raise NotImplementedError

    @staticmethod
    def owned(rows: Rows) -> int | None:
        """The outcome of ``sql.owned`` / ``sql.share_owned`` (binds name, owner, seq None):
        the token of the lease the owner holds, or None."""
        raise NotImplementedError

    @staticmethod
    def enqueued(rows: Rows) -> Grant | Queued | None:
        """The outcome of ``queue.enqueue`` / ``queue.share_enqueue``; None: look again."""
        raise Unsupported("this database has no fair queue")

    @staticmethod
    def cancelled(rows: Rows) -> Grant | None:
        """The outcome of ``queue.cancel``: the lease a release handed the owner first, or None."""
        raise Unsupported("this database has no fair queue")

    @staticmethod
    def ended(rows: Rows, held: bool) -> core.Ended:
        """The outcome of ``sql.release`` (``held`` False) or ``sql.release_held`` (True):
        rows (token, handed[, held_until]) on every backend."""
        if not rows:
            return core.Ended(False)
        if held and rows[0][2] is not None:
            return core.Ended(True, core.when(rows[0][2]))
        return core.Ended(True)

    @staticmethod
    def extended(rows: Rows, keys: Sequence[tuple[str, int]]) -> list[datetime | None]:
        """The outcome of ``sql.extend_many``: per (name, token) of ``keys``, in order,
        the new database expiry, or None if that lease was released or taken over."""
        expiries = {(name, token): expires_at for name, token, expires_at in rows}
        return [None if (e := expiries.get(key)) is None else core.when(e) for key in keys]

    @staticmethod
    def batch(leases: Sequence[tuple[str, str, int, float]]) -> dict[str, Any]:
        """The binds of ``sql.extend_many`` for (name, owner, token, ttl) of each lease."""
        raise NotImplementedError

    # -- connections -----------------------------------------------------------
    def connect(self, deadline: float) -> Any:
        """A new autocommit driver connection, opened before ``deadline`` (``time.monotonic()``)."""
        raise NotImplementedError

    def cursor(self, raw: Any) -> Any:
        return raw.cursor()

    def execute(self, cursor: Any, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        """Run one statement; its rows (none for a statement that returns none)."""
        raise NotImplementedError

    async def aconnect(self, deadline: float) -> Any:
        """``connect`` of the asyncio face."""
        raise NotImplementedError

    async def acursor(self, raw: Any) -> Any:
        return raw.cursor()

    async def aexecute(self, cursor: Any, sql: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        raise NotImplementedError

    def set_writer_wait(self, raw: Any, ms: int) -> None:
        """How long the next statement may wait for another writer (``caps.cut_statements`` False)."""
        raise Unsupported(f"{self.title} statements are cut off, not bounded by a writer wait")

    async def aset_writer_wait(self, raw: Any, ms: int) -> None:
        raise Unsupported(f"{self.title} statements are cut off, not bounded by a writer wait")

    # -- notifications (``caps.notify``) ---------------------------------------------
    @staticmethod
    def watch(channel: str) -> list[str]:
        """The statements that make a session hear an election's ``relabel`` notifications."""
        raise Unsupported("this database cannot notify")

    @staticmethod
    def listen(listener: str) -> list[str]:
        """The statements that make a connection the listener ``listener`` (an id of hex digits):
        hand-offs to owners whose id starts with it are notified to that connection."""
        raise Unsupported("this database cannot notify a waiter")

    # binds: none. One row (pid, start): the listening session, as queue entries name it.
    session: ClassVar[str] = ""

    @staticmethod
    def handed(payload: str) -> tuple[str, int, float] | None:
        """A hand-off notification's (owner, token, expiry as database epoch seconds); None if malformed."""
        raise Unsupported("this database cannot notify a waiter")

    def is_broken(self, raw: Any) -> bool:
        """Whether the connection broke under the statement (the server went away)."""
        return False

    def table_check(self) -> tuple[str, dict[str, Any]]:
        """A statement (and its binds) whose one row's first value is true if dblock's table exists:
        asked when a statement found a function or column missing, to tell a table of an older
        dblock from no table at all."""
        raise NotImplementedError

    def no_table(self, sqlstate: str | None = None) -> SchemaMissing:
        """The error that says dblock's table is not in this database, and how to make it."""
        return no_table(self.where, self.table, self.schema, sqlstate)

    def translate(self, exc: BaseException) -> DBLockError:
        """A driver error of a lock statement as dblock's own."""
        raise NotImplementedError

    @classmethod
    def schema_error(
        cls, exc: BaseException, orig: BaseException, reason: str, where: str, table: str, path: str
    ) -> DBLockError:
        """An error of making or upgrading the tables (``exc``, the driver's ``orig``, its first line
        ``reason``) as dblock's own; a missing privilege is told apart before this is asked."""
        raise NotImplementedError

    # -- engines -----------------------------------------------------------------------
    @classmethod
    def engine_for_url(cls, url: URL) -> Engine:
        """The engine dblock makes for ``url`` (its driver checked; ``ValueError`` for one dblock cannot use)."""
        raise NotImplementedError

    @classmethod
    def adopt(cls, engine: Engine) -> tuple[Engine, bool]:
        """The engine dblock uses for the app's ``engine``, and whether dblock made it (then
        ``Locker.close`` disposes of it): the app's own, or one dblock makes from its URL."""
        raise NotImplementedError

    @classmethod
    def prepare_database(cls, engine: Engine) -> None:
        """Before the migrations make the tables: settings of the database itself (none here)."""

    # Options of every table the migrations make (MariaDB: engine, character set, collation).
    table_options: ClassVar[dict[str, str]] = {}

    @classmethod
    def serialise(cls, conn: Any, key: int) -> None:
        """Wait for the advisory lock ``key`` (``caps.advisory_lock``): racing migrations take turns."""
        raise Unsupported(f"{cls.title} has no advisory lock")

    @classmethod
    def unserialise(cls, conn: Any, key: int) -> None:
        """End the turn ``serialise`` began (where it does not end with the transaction)."""

    # -- fencing -------------------------------------------------------------
    @classmethod
    def lease_check(cls, t: str) -> str:
        """binds name, owner, token. One row: the exclusive lease is live and cannot be taken
        over until the caller's transaction ends. Zero rows: expired, released or taken over."""
        raise NotImplementedError

    @classmethod
    def shared_check(cls, t: str, h: str) -> str:
        """``lease_check`` for a shared lease (``h``: the holders table)."""
        raise NotImplementedError

    @classmethod
    def insert(cls) -> Any:
        """The dialect's ``insert`` construct with ON CONFLICT, for fenced upserts."""
        raise NotImplementedError

    @classmethod
    def fenced_upsert(
        cls, dialect: Dialect, table: Any, values: dict[str, Any], keys: list[str], column: str, token: int, strict: bool
    ) -> tuple[Any, Any, Any]:
        """A fenced upsert of one row: (a statement to run first, or None; the upsert; and
        ``passed(first_row)``, True when the upsert wrote the row). The row is inserted stamped
        with ``token``, or updated, stamp included, only if its stored token lets ``token``
        through (``strict``: is below it); otherwise nothing is written. The first statement,
        where there is one, returns the stored token of a row it locks: when that already
        refuses ``token``, the upsert is not sent."""
        fence = table.c[column]
        stmt = cls.insert()(table).values({**values, column: token})
        update = {k: stmt.excluded[k] for k in [*values, column] if k not in keys}
        stmt = stmt.on_conflict_do_update(
            index_elements=keys, set_=update, where=(fence < token) if strict else (fence <= token)
        ).returning(fence)
        return None, stmt, lambda row: row is not None

    @staticmethod
    def denied(orig: BaseException | None) -> bool:
        """Whether a driver error says the user lacks a privilege (any driver of this database)."""
        return False

    @staticmethod
    def missing_table(orig: BaseException | None) -> bool:
        """Whether a driver error (of any driver of this database, the app's too) says a table is missing."""
        raise NotImplementedError

    # Whether an UPDATE can return rows (fenced_read stamps and reads in one statement); without,
    # it stamps, then reads the rows it stamped (and holds locked) in the same transaction.
    update_returning: ClassVar[bool] = True


# A shared lease is a row of the holders table: (name, owner) with its own token
# and expiry, and lim, the limit it was granted under (NULL for a reader). While
# any is live the name's row in the lock table shows owner SHARED_OWNER, the
# newest shared grant's token and an expiry no earlier than every live
# holder's, so the exclusive statements (a write lock is the exclusive lock)
# see the name held until the last reader leaves or runs out. Every change to a
# name's holders happens under that row's lock (PostgreSQL: the share functions
# lock it first; SQLite: one writer at a time).
SHARED = f"'{SHARED_OWNER}'"


def leases_statement(
    t: str, h: str, now: str, remaining: str, false: str, true: str, name: str | None = None
) -> str:
    """The ``leases`` statement of a backend whose clock reads ``now``; ``remaining``: the
    seconds left of ``{0}.expires_at``; ``false``/``true``: its boolean literals. ``name``:
    the backend's placeholder for a name, for ``leases_of``, the same rows of one name."""
    # leases (leases_of: of one name, found by its primary key)
    # binds: none (leases_of: name)
    # returns a row per unexpired lease, exclusive or shared: name, owner, token,
    #   acquired_at, expires_at, remaining (seconds, database clock), label,
    #   shared (false: exclusive/write), lim (a semaphore holder's limit; NULL
    #   for readers and exclusive leases). Zero rows: nothing held.
    one = "" if name is None else f" AND l.name = {name}"
    return f"""
SELECT l.name, l.owner, l.token, l.acquired_at, l.expires_at, {remaining.format("l")}, l.label, {false}, NULL
FROM {t} AS l WHERE l.owner IS NOT NULL AND l.owner <> {SHARED} AND l.expires_at > {now}{one}
UNION ALL
SELECT x.name, x.owner, x.token, x.acquired_at, x.expires_at, {remaining.format("x")}, x.label, {true}, x.lim
FROM {h} AS x JOIN {t} AS l ON l.name = x.name AND l.owner = {SHARED}
WHERE x.expires_at > {now}{one}
ORDER BY 1, 3"""


# -- row shapes shared by the backends whose statements report them alike (SQLite, MariaDB) ------
def shared_grant(rows: Rows, holder: Rows) -> tuple[Grant | Miss, int | None]:
    """``share_acquired`` for a share_acquire that returns (token, expires_at, free) when granted,
    nothing when not (then share_holder's one row: the wait)."""
    if not rows:
        return Miss(holder[0][0] if holder else None), None
    token, expires_at, free = rows[0]
    return Grant(token, core.when(expires_at)), None if free is None else int(free)


def owned_token(rows: Rows) -> int | None:
    """``owned`` for an owned statement that returns the owner's token, or nothing."""
    return rows[0][0] if rows else None


def json_batch(leases: Sequence[tuple[str, str, int, float]]) -> dict[str, Any]:
    """``batch`` for ``caps.batch_binds == "json"``: one JSON array of [name, owner, token, ttl]."""
    return {"batch": json.dumps([list(lease) for lease in leases])}
