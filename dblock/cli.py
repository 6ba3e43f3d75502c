"""The ``dblock`` command: run a command under a lock, list and break leases, migrate.

    dblock run NAME [--ttl T] [--wait T] [--grace T] [--min-interval T] -- CMD [ARGS...]
    dblock status [NAME] [--json]
    dblock release NAME --force [--yes]
    dblock migrate [--sql | --downgrade REV]

``--url`` (or ``$DBLOCK_URL``) picks the database; with neither, the embedded
SQLite default (``$DBLOCK_HOME``). Exit codes are the ``EXIT_*`` constants.
Durations are seconds, or carry a unit: ``250ms``, ``90s``, ``5m``, ``1h``, ``1d``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any, Callable, Sequence

import psycopg
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

from ._process import describe_process
from ._redact import display_url, redact
from . import __version__
from ._core import DRIFT
from ._validate import (
    check_identifier, check_limit, check_min_hold, check_name, check_text, check_timeout, check_trusted, check_ttl,
    human_seconds, parse_duration,
)
from .errors import DBLockError, LockNotAcquired, Misconfigured, PermissionDenied
from .lease import Lease, LeaseInfo
from .locker import Locker
from .renew import Overdue, call_within
from .schema import DEFAULT_TABLE, LABEL_LENGTH, default_sqlite_path

EXIT_NOT_HELD = 1  # status NAME: not held; release: nothing was released
EXIT_USAGE = 2  # bad arguments (argparse's code); nothing was touched
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the database failed (unreachable, table missing, ...)
EXIT_SOFTWARE = 70  # EX_SOFTWARE: a bug in dblock; the traceback is on stderr
EXIT_BUSY = 75  # EX_TEMPFAIL: the lock is held by someone else; try again later
EXIT_LOST = 76  # the lease was lost while the command ran; the command was stopped
EXIT_CONFIG = 78  # EX_CONFIG: the database cannot be reached as the URL says (no such host, refused login, ...)
EXIT_CANNOT_RUN = 126  # the command was found but could not be started (as in the shell)
EXIT_NOT_FOUND = 127  # the command was not found (as in the shell)

DEFAULT_TTL = 30.0
DEFAULT_GRACE = 10.0
# Signals `dblock run` passes on to its command. It keeps holding (and renewing)
# the lease until the command exits, whatever the command does with them.
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# Keys that a terminal sends to its whole foreground process group, the command included.
_FROM_TERMINAL = (signal.SIGINT, signal.SIGQUIT)

_EPILOG = f"""\
exit codes:
  run      the command's own status (128+N if a signal N ended it);
           {EXIT_BUSY} the lock is busy; {EXIT_LOST} the lease was lost and the command stopped;
           {EXIT_NOT_FOUND} command not found; {EXIT_CANNOT_RUN} command not executable
  status   0; with NAME, {EXIT_NOT_HELD} if NAME is not held
  release  0 released; {EXIT_NOT_HELD} nothing released
  all      {EXIT_USAGE} bad arguments; {EXIT_UNAVAILABLE} database error; {EXIT_SOFTWARE} internal error;
           {EXIT_CONFIG} the database cannot be reached as configured (bad host, login, database or path)

environment:
  DBLOCK_URL   database URL when --url is not given (default: the embedded SQLite file)
  DBLOCK_HOME  directory of the embedded SQLite file
  the command of `run` gets DBLOCK_NAME and DBLOCK_TOKEN (the fencing token)
"""

log = logging.getLogger("dblock.cli")


class _Interrupted(BaseException):
    """A forwarded signal arrived before there was a command to forward it to."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# -- arguments -----------------------------------------------------------------
def _typed(check: Callable[[Any], Any], convert: Callable[[str], Any] = float) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return check(convert(text))
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc) if str(exc) else f"invalid value {text!r}") from None

    parse.__name__ = check.__name__.replace("check_", "")  # argparse names the type in errors
    return parse


def _seconds(check: Callable[[Any], Any]) -> Callable[[str], Any]:
    return _typed(check, parse_duration)


_NAME = _typed(check_name, str)
_TTL = _seconds(lambda v: check_trusted(check_ttl(v), DRIFT, tunable=False))  # leaves trust after the clock allowance
_MIN_INTERVAL = _typed(lambda v: check_min_hold(v, "min-interval"), parse_duration)
_TABLE = _typed(lambda v: check_identifier(v, "table"), str)


def _signal(text: str) -> signal.Signals:
    """A signal by name (USR1, SIGUSR1) or number."""
    name = text.strip().upper()
    try:
        return signal.Signals(int(name)) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a signal: {text!r} (a name such as USR1 or SIGTERM, or a number)") from None
_SCHEMA = _typed(lambda v: check_identifier(v, "schema"), str)


def _database_options(parser: argparse.ArgumentParser, default: Any, django: bool = False) -> None:
    group = parser.add_argument_group("database")
    if django:  # ``manage.py dblock``: the database is one of settings.DATABASES
        group.add_argument("--database", default=default, metavar="ALIAS",
                           help="alias in settings.DATABASES (default: default)")
    else:
        group.add_argument("--url", default=default,
                           help="SQLAlchemy URL (default: $DBLOCK_URL, else the embedded SQLite file)")
    group.add_argument("--table", type=_TABLE, default=default, help=f"lock table (default: {DEFAULT_TABLE})")
    group.add_argument("--schema", type=_SCHEMA, default=default, help="PostgreSQL schema of the table")
    group.add_argument("-v", "--verbose", action="store_true", default=default, help="log what dblock does")


def build_parser(prog: str = "dblock", django: bool = False) -> argparse.ArgumentParser:
    """The command's parser; ``django``: ``manage.py dblock``'s, for its help (``--database ALIAS``
    instead of ``--url``, and no ``migrate``: Django's migrations make the tables there)."""
    epilog = _EPILOG
    if django:
        epilog = epilog.replace(
            "  DBLOCK_URL   database URL when --url is not given (default: the embedded SQLite file)\n"
            "  DBLOCK_HOME  directory of the embedded SQLite file\n",
            "",
        ).replace(
            "environment:\n",
            "database: --database ALIAS picks one of settings.DATABASES; `manage.py migrate dblock` makes the tables\n"
            "\nenvironment:\n",
        )
    parser = argparse.ArgumentParser(
        prog=prog,
        description="A lease lock with fencing tokens in your SQL database.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"dblock {__version__}")
    _database_options(parser, None, django)
    # The same options after the command name; SUPPRESS keeps them from
    # overwriting the ones given before it.
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _database_options(common, argparse.SUPPRESS, django)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        parents=[common],
        allow_abbrev=False,
        usage=f"{prog} run NAME [--shared | --limit N] [--ttl T] [--wait T] [--grace T] [--min-interval T] [options] "
        "-- CMD [ARGS...]",
        help="run a command while holding a lock",
        description="Acquire NAME, run CMD with DBLOCK_NAME and DBLOCK_TOKEN set, renew the lease "
        "every ttl/3 while it runs, release it when CMD exits, and exit with CMD's status.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("name", type=_NAME, help="the lock's name")
    run.add_argument("--ttl", type=_TTL, default=DEFAULT_TTL,
                     help=f"lease length (30, 90s, 5m, 1h...), renewed every ttl/3 (default: {DEFAULT_TTL:g}s)")
    run.add_argument("--wait", type=_seconds(check_timeout), default=0.0,
                     help=f"how long to wait for a busy lock ('inf': for ever; default: 0, exit {EXIT_BUSY} at once); "
                     "on a terminal, says who holds it and when it is got")
    run.add_argument("--grace", type=_seconds(check_timeout), default=DEFAULT_GRACE,
                     help=f"if the lease is lost: time between SIGTERM and SIGKILL (default: {DEFAULT_GRACE:g}s)")
    side = run.add_mutually_exclusive_group()
    side.add_argument("--shared", action="store_true",
                      help="take a read lock: any number of --shared runs at once, none with an exclusive run of NAME")
    side.add_argument("--limit", type=_typed(check_limit, int), default=None, metavar="N",
                      help="take one of N semaphore slots of NAME: at most N such runs at once")
    run.add_argument("--expiring-signal", type=_signal, default=None, metavar="SIG",
                     help="send SIG (USR1, TERM...) to CMD when renewal has not extended the lease and little "
                     "of it is left (--expiring-margin), before it is lost (default: none)")
    run.add_argument("--expiring-margin", type=_seconds(lambda v: check_ttl(v, "expiring-margin")), default=None,
                     metavar="T", help="how much of the lease is left when SIG is sent (default: a third of the ttl)")
    run.add_argument("--min-interval", type=_MIN_INTERVAL, default=0.0, metavar="T",
                     help="keep the lock until T after it was got, even if CMD ends sooner, so CMD started "
                     "on several machines runs once per period (default: 0, released when CMD ends)")
    run.set_defaults(handler=_run, parser=run, elect=False)

    elect = commands.add_parser(
        "elect",
        parents=[common],
        allow_abbrev=False,
        usage=f"{prog} elect NAME [--value V] [--ttl T] [--wait T] [--grace T] [options] -- CMD [ARGS...]",
        help="run a command while leading an election",
        description="Campaign in the election NAME (waiting for ever by default), run CMD while this process "
        "leads, with DBLOCK_NAME set and DBLOCK_TOKEN the term (a fencing token), renew the leadership every "
        "ttl/3, resign when CMD exits (the next candidate leads at once), and exit with CMD's status.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    elect.add_argument("name", type=_NAME, help="the election's name")
    elect.add_argument("--value", type=_typed(lambda v: check_text(v, "value", LABEL_LENGTH), str), default=None,
                       help="what this leader proclaims, shown by `dblock status` (default: host:pid command)")
    elect.add_argument("--ttl", type=_TTL, default=DEFAULT_TTL,
                       help=f"leadership lease, renewed every ttl/3 (default: {DEFAULT_TTL:g}s)")
    elect.add_argument("--wait", type=_seconds(check_timeout), default=float("inf"),
                       help=f"how long to campaign (default: for ever; 0: exit {EXIT_BUSY} at once if another leads)")
    elect.add_argument("--grace", type=_seconds(check_timeout), default=DEFAULT_GRACE,
                       help=f"if leadership is lost: time between SIGTERM and SIGKILL (default: {DEFAULT_GRACE:g}s)")
    elect.add_argument("--expiring-signal", type=_signal, default=None, metavar="SIG",
                       help="send SIG to CMD when renewal has not extended the leadership and little of it is left")
    elect.add_argument("--expiring-margin", type=_seconds(lambda v: check_ttl(v, "expiring-margin")), default=None,
                       metavar="T", help="how much is left when SIG is sent (default: a third of the ttl)")
    elect.set_defaults(handler=_run, parser=elect, elect=True, shared=False, limit=None, min_interval=0.0)

    status = commands.add_parser(
        "status", parents=[common], allow_abbrev=False, help="list the leases held now",
        description="List the leases held now: name, owner label, token, how long it has been held and how "
        "long it has left (by the database clock), and how many wait for it (PostgreSQL's fair queue).",
    )
    status.add_argument("name", nargs="?", type=_NAME, help=f"only this lock (exit {EXIT_NOT_HELD} if it is not held)")
    status.add_argument("--json", action="store_true", help="print JSON for scripts")
    status.set_defaults(handler=_status, parser=status)

    release = commands.add_parser(
        "release", parents=[common], allow_abbrev=False, help="break a lease (operators)",
        description="End the current lease on NAME whoever holds it. Its holder learns it at its next "
        "renewal; `dblock run` then stops its command.",
    )
    release.add_argument("name", type=_NAME, help="the lock's name")
    release.add_argument("--force", action="store_true", help="required: yes, break someone else's lease")
    release.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    release.set_defaults(handler=_release, parser=release)
    if django:
        return parser

    migration = commands.add_parser(
        "migrate", parents=[common], allow_abbrev=False, help="create or upgrade dblock's tables",
        description="Create or upgrade dblock's tables with its migrations (safe to run concurrently).",
    )
    migration.add_argument("--sql", action="store_true", help="print the DDL instead of running it")
    migration.add_argument("--downgrade", metavar="REV",
                           help="downgrade dblock's tables to one of its revisions instead; 'base' removes them "
                           "(and dblock's version table), leaving every other table alone")
    migration.set_defaults(handler=_migrate, parser=migration)
    return parser


# -- entry point -----------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RedactingFormatter("dblock: %(message)s"))
    root = logging.getLogger("dblock")
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        return _main(args)
    except SystemExit as exc:  # argparse
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except Exception:  # noqa: BLE001 - reported, with its traceback, as an internal error
        sys.stderr.write(redact(traceback.format_exc()))
        sys.stderr.write("dblock: internal error (a bug); please report it with the traceback above\n")
        return EXIT_SOFTWARE
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        root.removeHandler(handler)
        root.setLevel(level)


def _main(argv: list[str]) -> int:
    parser = build_parser()
    # `run` takes its command after the first `--`; other commands get it back.
    command: list[str] | None = None
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    args, extra = parser.parse_known_args(argv)
    sub: argparse.ArgumentParser = args.parser
    if extra and args.command in ("run", "elect") and command is None and not extra[0].startswith("-"):
        # `dblock run NAME CMD ARGS`: the most likely slip, answered with the fix.
        sub.error(f"put -- before the command to run: dblock {args.command} {args.name} -- {' '.join(extra)}")
    if extra:
        parser.parse_args(argv)  # argparse's own error for what it does not know
    if args.command in ("run", "elect"):
        if not command:
            sub.error(f"give the command to run after --, e.g. dblock {args.command} NAME -- CMD ARGS...")
        args.cmd = command
    elif command is not None:
        args = parser.parse_args([*argv, "--", *command])
    if args.url is None:
        args.url = os.environ.get("DBLOCK_URL") or None
    if args.table is None:
        args.table = DEFAULT_TABLE
    if args.url is None and args.schema is not None:
        sub.error("--schema needs a PostgreSQL --url; the embedded default is SQLite, which has no schemas")
    if args.verbose:
        logging.getLogger("dblock").setLevel(logging.DEBUG)
    handler: Callable[[argparse.Namespace, argparse.ArgumentParser], int] = args.handler
    try:
        return handler(args, sub)
    except (DBLockError, SQLAlchemyError, psycopg.Error, sqlite3.Error, OSError) as exc:
        print(f"dblock: {_first_line(exc)}", file=sys.stderr)
        return EXIT_CONFIG if isinstance(exc, Misconfigured) else EXIT_UNAVAILABLE


def _locker(args: argparse.Namespace, parser: argparse.ArgumentParser, label: str | None = None) -> Locker:
    """The Locker the options describe; bad options end the program with usage (exit 2) before any I/O."""
    try:
        return Locker(args.url, table=args.table, schema=args.schema, label=label)
    except (TypeError, ValueError) as exc:
        parser.error(redact(str(exc)))  # it may quote the URL


def _nothing_there(args: argparse.Namespace) -> bool:
    """True if the embedded default has no file yet: nothing is held, and looking must not create it."""
    return args.url is None and not default_sqlite_path().exists()


# -- dblock run ---------------------------------------------------------------------
def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command: list[str] = args.cmd
    if (args.shared or args.limit is not None) and args.min_interval:
        parser.error("--min-interval holds the exclusive lock; it does not go with --shared or --limit")
    if args.expiring_margin is not None and args.expiring_signal is None:
        parser.error("--expiring-margin says when --expiring-signal is sent: give --expiring-signal too")
    locker = _locker(args, parser, label=describe_process(command))
    child: list[subprocess.Popen[bytes]] = []  # set once the command runs
    pending: list[int] = []  # signals that arrived while it was being started
    spawning = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if child:
            if signum in _FROM_TERMINAL and _terminal_signals_our_group():
                return  # the terminal sent it to the command too; twice would be once too many
            child[0].send_signal(signum)
        elif spawning:
            pending.append(signum)
        else:
            raise _Interrupted(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in FORWARDED}
    lease: Lease | None = None
    try:
        wake = threading.Event()

        def expiring(lease: Lease) -> None:
            if child and child[0].poll() is None:
                print(f"dblock: {args.name!r} could not be renewed yet and has {lease.remaining():.1f} s left; "
                      f"sending {args.expiring_signal.name} to the command", file=sys.stderr)
                child[0].send_signal(args.expiring_signal)

        warn = expiring if args.expiring_signal is not None else None
        lease = _acquire(locker, args, on_lost=lambda _: wake.set(), on_expiring=warn, margin=args.expiring_margin)
        if lease is None:
            print(f"dblock: {_busy(locker, args.name, args.wait)}", file=sys.stderr)
            return EXIT_BUSY
        log.debug("acquired %r, token %s; running %s", args.name, lease.token, command)
        env = dict(os.environ, DBLOCK_NAME=args.name, DBLOCK_TOKEN=str(lease.token))
        spawning = True
        try:
            child.append(subprocess.Popen(command, env=env, preexec_fn=_die_with(os.getpid())))
        except FileNotFoundError:
            print(f"dblock: {command[0]}: command not found", file=sys.stderr)
            return EXIT_NOT_FOUND
        except OSError as exc:
            print(f"dblock: {command[0]}: cannot run: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_CANNOT_RUN
        finally:
            spawning = False
        for signum in pending:
            on_signal(signum, None)
        return _supervise(child[0], lease, wake, args)
    except _Interrupted as exc:  # while waiting for the lock: nothing runs yet
        return 128 + exc.signum
    finally:
        if lease is not None:
            _release_quietly(lease)
        for sig, old in previous.items():
            signal.signal(sig, old)


# prctl(2) option: the signal a process gets when the thread that forked it ends.
_PR_SET_PDEATHSIG = 1


def _die_with(supervisor: int) -> Callable[[], None] | None:
    """What the command's process runs between fork and exec, so it dies with its supervisor.

    A SIGKILLed `dblock run` (OOM killer, kill -9) cannot stop its command, and its
    lease runs out within --ttl: the command would then run unprotected, alongside
    the next holder's. On Linux the kernel sends the command SIGKILL when the thread
    that forked it ends (here the main thread, which lives as long as the process).
    SIGKILL, because a command may ignore or delay SIGTERM and nobody is left to
    follow up. None (nothing to run) on other systems.

    Python runs this in the child of a threaded process (renewal, listener), where
    only async-signal-safe work is safe: everything is looked up before the fork,
    and the child makes three system calls (no import, lock or logging). A shim
    exec'd first would avoid running Python there, but costs an interpreter start
    per run and would take over Popen's report of a command that cannot start.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # a libc without prctl: nothing to be done
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    getppid, kill, getpid, sigkill = os.getppid, os.kill, os.getpid, int(signal.SIGKILL)

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        # The supervisor may have died before prctl: then the signal will never
        # come, and the child was handed to another parent. Do what it would have done.
        if getppid() != supervisor:
            kill(getpid(), sigkill)

    return in_child


def _acquire(
    locker: Locker,
    args: argparse.Namespace,
    on_lost: Callable[[Lease], object],
    on_expiring: Callable[[Lease], object] | None = None,
    margin: float | None = None,
) -> Lease | None:
    started = time.monotonic()
    shared = None  # the exclusive lock; else a read lock's readers or a semaphore (--shared, --limit)
    if getattr(args, "shared", False) or getattr(args, "limit", None) is not None:
        shared = locker.readers(args.name) if args.limit is None else locker.semaphore(args.name, args.limit)

    renewal: dict[str, Any] = dict(renew=True, on_lost=on_lost, on_expiring=on_expiring, expiring_margin=margin)

    def take(timeout: float | None) -> Lease | None:
        if args.elect:
            try:
                return locker.election(args.name).campaign(
                    value=args.value, ttl=args.ttl, timeout=0.0 if timeout is None else timeout, on_lost=on_lost,
                    on_expiring=on_expiring, expiring_margin=margin,
                ).lease
            except LockNotAcquired:
                if timeout is None:
                    return None  # one try: another leads
                raise
        if shared is not None:
            if timeout is None:
                return shared.try_acquire(ttl=args.ttl, **renewal)
            return shared.acquire(ttl=args.ttl, timeout=timeout, **renewal)
        if timeout is None:
            return locker.try_acquire(args.name, ttl=args.ttl, min_hold=args.min_interval, **renewal)
        return locker.acquire(args.name, ttl=args.ttl, timeout=timeout, min_hold=args.min_interval, **renewal)

    if args.wait == 0 or sys.stderr.isatty():
        # One attempt; on SQLite it still waits (briefly) for another writer to finish.
        lease = take(None)
        if lease is not None or args.wait == 0:
            return lease
        # On a terminal someone is watching: say why nothing happens, and when it does.
        print(f"dblock: waiting up to {human_seconds(args.wait)} for lock {args.name!r}{_holder(locker, args.name)}",
              file=sys.stderr)
    try:
        lease = take(max(0.0, args.wait - (time.monotonic() - started)))
    except LockNotAcquired:
        return None
    if lease is None:  # a waiting acquire returns a lease or raises; for the type checker
        return None
    if sys.stderr.isatty():
        print(f"dblock: got lock {args.name!r} after {human_seconds(time.monotonic() - started)} (token {lease.token})",
              file=sys.stderr)
    return lease


def _holder(locker: Locker, name: str) -> str:
    """``: held by LABEL (token N, 12 s left)``, or nothing if it cannot be told (released meanwhile, an error)."""
    try:
        holder = next((i for i in locker.leases() if i.name == name), None)
    except DBLockError:
        holder = None
    if holder is None:
        return ""
    return f": held by {_shown(holder.label or holder.owner)} (token {holder.token}, {human_seconds(holder.remaining)} left)"


def _busy(locker: Locker, name: str, waited: float) -> str:
    what = f"lock {name!r} is busy" if waited == 0 else f"lock {name!r} stayed busy for {human_seconds(waited)}"
    return what + _holder(locker, name) + "; not running the command"


def _supervise(child: subprocess.Popen[bytes], lease: Lease, wake: threading.Event, args: argparse.Namespace) -> int:
    done = threading.Event()

    def reap() -> None:
        child.wait()
        done.set()
        wake.set()

    threading.Thread(target=reap, name="dblock-reap", daemon=True).start()
    # Signal handlers run while the main thread waits here, and forward.
    while not done.is_set() and not lease.lost.is_set():
        wake.wait()
        wake.clear()
    if lease.lost.is_set() and not done.is_set():
        print(f"dblock: lost the lease on {args.name!r} (token {lease.token}); stopping the command (SIGTERM)",
              file=sys.stderr)
        child.terminate()
        if not done.wait(args.grace):
            print(f"dblock: the command did not stop within {human_seconds(args.grace)}; sending SIGKILL", file=sys.stderr)
            child.kill()
            done.wait()
        return EXIT_LOST
    if lease.lost.is_set():  # lost as the command ended: its last steps may have run unprotected
        print(f"dblock: lost the lease on {args.name!r} (token {lease.token}) before the command ended", file=sys.stderr)
        return EXIT_LOST
    code = child.returncode
    return code if code >= 0 else 128 - code


def _release_quietly(lease: Lease) -> None:
    # A database that stopped answering must not keep us from exiting: the
    # lease ends at its TTL anyway, so waiting longer than that gains nothing.
    try:
        call_within(lease.release, min(lease.ttl, 30.0), "dblock-release")
        if lease.held_until is not None:
            log.debug("keeping %r until %s (--min-interval)", lease.name, lease.held_until.isoformat())
    except Overdue:
        print(f"dblock: could not release {lease.name!r} in time; it expires within {human_seconds(lease.ttl)}",
              file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - reported; the lease expires at its TTL
        if not lease.lost.is_set():
            print(f"dblock: could not release {lease.name!r} ({_first_line(exc)}); it expires within "
                  f"{human_seconds(lease.ttl)}", file=sys.stderr)


def _terminal_signals_our_group() -> bool:
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


# -- dblock status / release / migrate -------------------------------------------
def _status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    infos: list[LeaseInfo] = []
    waiters: dict[str, int] | None = {}  # None: this role may not read the queue
    if not _nothing_there(args):
        locker = _locker(args, parser)
        infos = locker.leases()
        if infos:
            try:
                waiters = locker.waiters()  # a second read: the count may be a moment newer than the leases
            except PermissionDenied:  # a monitoring role granted SELECT on the lock table only
                waiters = None
    if args.name is not None:
        infos = [i for i in infos if i.name == args.name]
    where = display_url(args.url) if args.url is not None else f"the embedded default {default_sqlite_path()}"
    print(f"dblock: table {args.table!r} in {where}", file=sys.stderr)  # stdout stays the table (or the JSON)
    if args.json:
        print(json.dumps([_as_json(i, None if waiters is None else waiters.get(i.name, 0)) for i in infos], indent=2))
    elif infos:
        rows = [("NAME", "OWNER", "TOKEN", "HELD FOR", "EXPIRES IN", "WAITERS")]
        rows += [
            (_shown(i.name), _shown(i.label or i.owner), str(i.token), _span(_held_for(i)), _span(i.remaining),
             "-" if waiters is None else str(waiters.get(i.name, 0)))
            for i in infos
        ]
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        for r in rows:
            print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  "
                  f"{r[4]:>{widths[4]}}  {r[5]:>{widths[5]}}".rstrip())
    elif args.name is not None:
        print(f"{_shown(args.name)} is not held")
    else:
        print("no leases held")
    return EXIT_NOT_HELD if args.name is not None and not infos else 0


def _held_for(info: LeaseInfo) -> float:
    """Seconds since the grant, by the database clock: its now is expires_at - remaining."""
    return max(0.0, (info.expires_at - info.acquired_at).total_seconds() - info.remaining)


def _span(seconds: float) -> str:
    """A table cell: ``52.3s`` up to two minutes, then ``5min``, ``2.5h``, ``3days``."""
    return f"{seconds:.1f}s" if seconds < 120 else human_seconds(seconds).replace(" ", "")


def _as_json(info: LeaseInfo, waiters: int | None) -> dict[str, Any]:
    return {
        "name": info.name,
        "label": info.label,
        "owner": info.owner,
        "token": info.token,
        "acquired_at": info.acquired_at.isoformat(),
        "expires_at": info.expires_at.isoformat(),
        "expires_in": round(info.remaining, 3),
        "held_for": round(_held_for(info), 3),
        "waiters": waiters,
        "shared": info.shared,
        "limit": info.limit,
    }


def _release(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.force:
        parser.error("release breaks whoever holds the lease: add --force if that is what you want")
    if not args.yes and not sys.stdin.isatty():
        parser.error("cannot ask for confirmation (stdin is not a terminal): add --yes")
    infos = [] if _nothing_there(args) else [i for i in _locker(args, parser).leases() if i.name == args.name]
    if not infos:
        print(f"dblock: {args.name!r} is not held; nothing to release", file=sys.stderr)
        return EXIT_NOT_HELD
    # A shared name (read lock, semaphore) may have several holders: each is broken.
    whos = [f"{_shown(i.label or i.owner)} (token {i.token}, {human_seconds(i.remaining)} left)" for i in infos]
    if not args.yes:
        sys.stderr.write(f"Break the lease on {args.name!r} held by {', '.join(whos)}? [y/N] ")
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            print("dblock: nothing released", file=sys.stderr)
            return EXIT_NOT_HELD
    released = 0
    for info, who in zip(infos, whos):
        if not _locker(args, parser).force_release(info):
            print(f"dblock: the lease on {info.name!r} (token {info.token}) ended or changed meanwhile", file=sys.stderr)
            continue
        released += 1
        print(f"dblock: released {info.name!r}, held by {who}", file=sys.stderr)
    if not released:
        print("dblock: nothing released", file=sys.stderr)
        return EXIT_NOT_HELD
    return 0


def _migrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import migrate  # Alembic: loaded only for this command

    if args.downgrade is not None:
        return _downgrade(args, parser)
    if args.sql:
        if args.url is None:
            url = URL.create("sqlite", database=str(default_sqlite_path()))  # not created: only printed
            if args.schema is not None:
                parser.error("schema is not supported on SQLite (the embedded default)")
        else:
            url = _locker(args, parser).engine.url
        print(migrate.sql(display_url(url), args.table, args.schema), end="")
        return 0
    locker = _locker(args, parser)
    migrated = locker.create_schema()
    print(f"dblock: {migrated} in {display_url(locker.engine.url)}", file=sys.stderr)
    return 0


def _downgrade(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import migrate

    known = migrate.revisions()
    if args.sql:
        parser.error("--sql prints the upgrade only; drop it to downgrade")
    if args.downgrade != "base" and args.downgrade not in known:
        parser.error(f"--downgrade takes base or one of dblock's revisions ({', '.join(known)}), not {args.downgrade!r}")
    if _nothing_there(args):
        print("dblock: the embedded default has no tables; nothing to downgrade", file=sys.stderr)
        return 0
    locker = _locker(args, parser)
    with migrate.database_errors(locker.engine, args.table):
        migrate.downgrade(locker.engine, args.table, args.schema, args.downgrade)
    where = display_url(locker.engine.url)
    if args.downgrade == "base":
        print(f"dblock: removed dblock's tables of {args.table!r} from {where}", file=sys.stderr)
    else:
        print(f"dblock: table {args.table!r} is at {args.downgrade} in {where}", file=sys.stderr)
    return 0


# -- output ----------------------------------------------------------------------
def _shown(text: str) -> str:
    return text if text.isprintable() else repr(text)


def _first_line(exc: BaseException) -> str:
    """The first line of an error's message, any password a driver quoted in it masked.

    Only messages and logs go through `redact`: data (names, labels, `--json`) is printed exactly.
    """
    text = redact(str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))
