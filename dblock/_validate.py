"""Argument checks that run before any SQL (guarantee G7: bad input changes nothing)."""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from ._core import Drift, least_ttl, trust_span

MAX_NAME_LENGTH = 255
MIN_TTL = 0.001  # 1 ms: below that the database rounds the lease to nothing
MAX_TTL = 366 * 24 * 3600.0  # a year; longer is almost certainly a unit mistake
# Identifiers are spliced into SQL (quoted); keep them plain so every backend
# accepts them and "<table>_token_seq" stays within PostgreSQL's 63 bytes.
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,52}$")


# Units for reading durations (the CLI's "90s", "5m") and for printing them.
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|min|m|h|d)?\s*$")


def parse_duration(text: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"1.5m"``, ``"2h"``, ``"1d"``, ``"250ms"`` or ``"inf"``."""
    try:
        return float(text)  # plain seconds, as before: 30, 0.5, 1e3, inf (and -1, NaN: the checks refuse them)
    except ValueError:
        pass
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (e.g. 30, 90s, 5m, 1h, 1d, 250ms)")
    return float(match.group(1)) * UNITS[match.group(2) or "s"]


def human_seconds(seconds: float) -> str:
    """A duration as people write it: ``1 ms``, ``45 s``, ``90 s``, ``5 min``, ``2.5 h``, ``366 days``."""
    if math.isinf(seconds):
        return "for ever" if seconds > 0 else "-inf"
    size = abs(seconds)
    if size == 0:
        return "0 s"
    for limit, unit, name in ((1, 0.001, "ms"), (120, 1, "s"), (7200, 60, "min"), (172800, 3600, "h")):
        if size < limit:
            return f"{round(seconds / unit, 1):g} {name}"
    return f"{round(seconds / 86400, 1):g} days"


def _number(value: object, what: str) -> float:
    # bool is an int subclass; True as a TTL is a bug, not one second.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    number = float(value)
    if math.isnan(number):
        raise ValueError(f"{what} must be a number of seconds, not NaN")
    return number


def check_text(value: object, what: str = "lock name", limit: int = MAX_NAME_LENGTH) -> str:
    """A str of 1 to ``limit`` characters, no NUL, valid Unicode (lock names, labels, resources)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    if len(value) > limit:
        raise ValueError(f"{what} is {len(value)} characters long; the limit is {limit}")
    if "\x00" in value:
        raise ValueError(f"{what} must not contain NUL characters")
    if not value.isascii():  # ASCII always encodes: no bytes made for the usual name
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{what} is not valid Unicode text: {exc.reason}") from None
    return value


check_name = check_text  # a lock name: its defaults (one call on every acquire, not two)


def check_names(names: object) -> list[str]:
    """Several lock names, held together: a collection of distinct names, in the canonical order
    (sorted by code point, which is also their UTF-8 bytes' order) in which every caller takes them."""
    if isinstance(names, (str, bytes)):
        raise TypeError(f"names must be a collection of lock names (a list, a set, ...), not one {type(names).__name__}")
    try:
        listed = list(names)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"names must be a collection of lock names, not {type(names).__name__}") from None
    if not listed:
        raise ValueError("names must hold at least one lock name")
    checked = [check_name(name) for name in listed]
    repeated = sorted({name for name in checked if checked.count(name) > 1}) if len(set(checked)) < len(checked) else []
    if repeated:
        raise ValueError(f"names must be distinct; given more than once: {', '.join(map(repr, repeated))}")
    return sorted(checked)


def check_owner(owner: object) -> str | None:
    """An owner key (``acquire(name, owner=key)``): None, or a str of 1 to 255 characters."""
    return None if owner is None else check_text(owner, "owner key")


def check_ttl(ttl: object, what: str = "ttl") -> float:
    """A span of seconds a lease lasts (or, ``what``, another span checked alike: ``older_than``)."""
    kind = type(ttl)
    if (kind is float or kind is int) and MIN_TTL <= ttl <= MAX_TTL:  # type: ignore[operator]
        return float(ttl)  # type: ignore[arg-type]  # the usual ttl, with no further call (NaN fails the range)
    number = _number(ttl, what)
    if not MIN_TTL <= number <= MAX_TTL:
        raise ValueError(
            f"{what} must be between {human_seconds(MIN_TTL)} and {human_seconds(MAX_TTL)}, not {human_seconds(number)}"
        )
    return number


MAX_DRIFT = 0.5  # the clock allowance's share of a ttl: at most half of it
MAX_DRIFT_FIXED = 60.0  # and its fixed part: at most a minute


def check_drift(drift: object, fixed: object) -> Drift:
    """The clock allowance taken off every lease's trust: ``drift``, a fraction of the ttl (0 to
    0.5), plus ``fixed`` seconds (0 to 60)."""
    if isinstance(drift, bool) or not isinstance(drift, (int, float)):
        raise TypeError(f"drift must be a fraction of the ttl (0.01 is 1%), not {type(drift).__name__}")
    if not 0 <= drift <= MAX_DRIFT:  # NaN fails too
        raise ValueError(f"drift must be a fraction of the ttl between 0 and {MAX_DRIFT:g} (0.01 is 1%), not {drift!r}")
    seconds = _number(fixed, "drift_fixed")
    if not 0 <= seconds <= MAX_DRIFT_FIXED:
        raise ValueError(
            f"drift_fixed must be between 0 s and {human_seconds(MAX_DRIFT_FIXED)}, not {human_seconds(seconds)}"
        )
    return Drift(float(drift), seconds)


def _exact(seconds: float) -> str:
    """A short duration to three digits (``2.02 ms``), where ``human_seconds`` would round it away."""
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def check_trusted(ttl: float, drift: Drift, what: str = "ttl", tunable: bool = True) -> float:
    """A ``ttl`` (checked already) that leaves some time to trust a lease once the clock allowance
    ``drift`` is taken off (``tunable``: the caller chose the allowance, a Locker's option)."""
    if trust_span(ttl, drift) > 0:
        return ttl
    raise ValueError(
        f"{what} {_exact(ttl)} leaves no time to trust the lease once the clock allowance is taken off "
        f"({drift.rate * 100:.3g}% of the ttl + {_exact(drift.fixed)}): give a ttl of more than "
        f"{_exact(least_ttl(drift))}" + (", or the Locker a smaller drift or drift_fixed" if tunable else "")
    )


MAX_LIMIT = 2**31 - 1  # the holders table's lim is a 32-bit integer


def check_limit(limit: object) -> int:
    """A semaphore's limit: how many leases of a name may be held at once (an int, 1 or more)."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, not {type(limit).__name__}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
    return limit


def check_min_hold(value: object, what: str = "min_hold") -> float:
    """How long a lease is kept after its grant, released or not: None or 0 (no hold) up to a year.

    It may exceed the ttl: a release before it has passed keeps the lease until then.
    """
    if value is None:
        return 0.0
    number = _number(value, what)
    if not 0 <= number <= MAX_TTL:
        raise ValueError(f"{what} must be between 0 s and {human_seconds(MAX_TTL)}, not {human_seconds(number)}")
    return number


def check_timeout(timeout: object) -> float:
    """A wait in seconds: 0 tries once, ``math.inf`` waits for ever."""
    number = _number(timeout, "timeout")
    if number < 0:
        raise ValueError(f"timeout must be >= 0 seconds (inf waits for ever), not {human_seconds(number)}")
    return number


def check_blocking(blocking: object, timeout: float | None) -> float | None:
    """threading's ``blocking=``: True waits (``timeout``, checked already, or the Locker's own);
    False tries once (a timeout of 0)."""
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be True or False, not {type(blocking).__name__}")
    if blocking:
        return timeout
    if timeout not in (None, 0):
        raise ValueError(
            "blocking=False tries once and does not wait: give it no timeout (try_acquire() also tries once, "
            "returning None instead of raising)"
        )
    return 0.0


def check_interval(value: object, what: str) -> float:
    number = _number(value, what)
    if not 0 < number <= 60:
        raise ValueError(f"{what} must be more than 0 and at most 60 s, not {human_seconds(number)}")
    return number


def check_identifier(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not _IDENTIFIER.match(value):
        raise ValueError(
            f"{what} {value!r} is not a plain SQL identifier: use letters, digits and _, "
            "starting with a letter or _, at most 53 characters"
        )
    return value


MAX_TOKEN = 2**63 - 1  # BIGINT


def check_token(token: object) -> int:
    """A fencing token: what a grant returned, a positive 64-bit integer."""
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"token must be an int (a Lease's token), not {type(token).__name__}")
    if not 1 <= token <= MAX_TOKEN:
        raise ValueError(f"token must be between 1 and {MAX_TOKEN}, not {token}")
    return token


def check_renew(renew: object, on_lost: object, on_expiring: object = None, expiring_margin: object = None) -> None:
    """``renew``, ``on_lost``, ``on_expiring`` and ``expiring_margin`` of an acquire: a bool, and
    callables (and a margin in seconds) only with renewal."""
    if renew is False and on_lost is None and on_expiring is None and expiring_margin is None:
        return  # the defaults: every acquire without renewal
    if not isinstance(renew, bool):
        raise TypeError(f"renew must be True or False, not {type(renew).__name__}")
    check_callbacks(on_lost, on_expiring, expiring_margin)
    for what, given in (("on_lost", on_lost), ("on_expiring", on_expiring), ("expiring_margin", expiring_margin)):
        if given is not None and not renew:
            raise ValueError(f"{what} is for renewal: pass renew=True with it")


def check_callbacks(on_lost: object, on_expiring: object = None, expiring_margin: object = None) -> float | None:
    """Renewal's callbacks (each a callable taking the lease, or None) and the warning's margin
    (seconds of trust left, or None: a third of the ttl)."""
    for what, callback in (("on_lost", on_lost), ("on_expiring", on_expiring)):
        if callback is not None and not callable(callback):
            raise TypeError(f"{what} must be a callable taking the lease, or None; not {type(callback).__name__}")
    if expiring_margin is None:
        return None
    if on_expiring is None:
        raise ValueError("expiring_margin says when on_expiring is called: pass on_expiring with it")
    return check_ttl(expiring_margin, "expiring_margin")


class Options(NamedTuple):
    """A Locker's (or AsyncLocker's) settings, checked."""

    table: str
    schema: str | None
    label: str | None
    ttl: float
    timeout: float
    poll_min: float
    poll_max: float
    fair: bool
    notify: bool
    prepare: bool
    op_timeout: float
    max_connections: int
    drift: Drift


def check_options(
    embedded: bool, table: object, schema: object, label: object, ttl: object, timeout: object, poll_min: object,
    poll_max: object, fair: object, notify: object, prepare: object, op_timeout: object, max_connections: object,
    drift: object, drift_fixed: object,
) -> Options:
    """The keyword arguments of ``Locker``/``AsyncLocker``, checked (``embedded``: no URL given)."""
    table = check_identifier(table, "table")
    schema = None if schema is None else check_identifier(schema, "schema")
    if embedded and schema is not None:
        # Checked before the engine is made, which creates the embedded default's directory.
        raise ValueError("schema is not supported on SQLite (the embedded default); leave it None")
    from .schema import LABEL_LENGTH  # noqa: PLC0415 - schema loads SQLAlchemy; the plain checks need not

    label = None if label is None else check_text(label, "label", LABEL_LENGTH)
    low, high = check_interval(poll_min, "poll_min"), check_interval(poll_max, "poll_max")
    if high < low:
        raise ValueError(f"poll_max ({poll_max:g}) must not be smaller than poll_min ({poll_min:g})")
    for option, value in (("fair", fair), ("notify", notify), ("prepare", prepare)):
        if not isinstance(value, bool):
            raise TypeError(f"{option} must be True or False, not {type(value).__name__}")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int):
        raise TypeError(f"max_connections must be an int, not {type(max_connections).__name__}")
    if not 1 <= max_connections <= 1000:
        raise ValueError(f"max_connections must be between 1 and 1000, not {max_connections}")
    allowance = check_drift(drift, drift_fixed)
    return Options(
        table, schema, label, check_trusted(check_ttl(ttl), allowance), check_timeout(timeout), low, high, bool(fair),
        bool(notify), bool(prepare), check_interval(op_timeout, "op_timeout"), max_connections, allowance,
    )
