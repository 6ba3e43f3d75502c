"""Optional OpenTelemetry metrics (the documentation's "Metrics" page): ``enable()``, ``disable()``, ``enabled()``.

Off until ``enable()``; then every Locker of this process records through
OpenTelemetry's metrics API, into the meter provider given or the global one.
``import dblock`` never imports OpenTelemetry. While off, each hook is one
call of a method that does nothing (``Recorder``), and a lease's hold is
``UNHELD``.

The Lockers call ``recorder`` (``OFF``, or what ``enable()`` made) with plain
values: the database system, the lock's name, monotonic start times and what
came of a call. So a sync and an async Locker record alike, and what the
instruments mean is written once, below.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .errors import LockNotAcquired

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.util.types import AttributeValue

    Attributes = dict[str, AttributeValue]

OUTCOME = "dblock.lock.outcome"
LOCK_NAME = "dblock.lock.name"
SYSTEM = "db.system.name"
ERROR_TYPE = "error.type"

# Advisory bucket boundaries (seconds): a wait takes from a round trip to minutes, a hold up to hours.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)


class Hold:
    """One lease's hold, from its grant; it ends once, released or lost."""

    __slots__ = ("_start", "_system", "_name")

    def __init__(self, system: str, name: str) -> None:
        self._start = [time.monotonic()]  # popped by the first end: atomic, so a release racing renewal records once
        self._system = system
        self._name = name

    def end(self, lost: bool) -> None:
        """The holder released the lease, or found it ``lost``; later calls do nothing."""
        try:
            started = self._start.pop()
        except IndexError:
            return
        recorder.held(self._system, self._name, started, lost)


class _Unheld(Hold):
    """The hold of a lease granted while metrics were off: records nothing."""

    __slots__ = ()

    def __init__(self) -> None:
        pass

    def end(self, lost: bool) -> None:
        pass


UNHELD = _Unheld()


class Recorder:
    """Metrics off: every hook does nothing."""

    def waited(self, system: str, name: str, started: float, result: object) -> None:
        """An acquire call that started at ``started`` (monotonic) came to ``result``.

        ``result``: the Lease it returned, None (``try_acquire``: held by
        another owner), or the exception it raised.
        """

    def hold(self, system: str, name: str) -> Hold:
        """A lease of ``name`` was granted now: its hold, for the lease to end."""
        return UNHELD

    def held(self, system: str, name: str, started: float, lost: bool) -> None:
        """A hold that started at ``started`` ended (``Hold.end`` calls this)."""

    def fenced_out(self, name: str | None) -> None:
        """A fenced write with a token of lock ``name`` (None: a bare token) was refused."""


class _Recording(Recorder):
    """Metrics on: instruments of one meter."""

    def __init__(self, provider: MeterProvider | None, lock_names: bool) -> None:
        from opentelemetry import metrics

        from . import __version__

        meter = metrics.get_meter("dblock", __version__, meter_provider=provider)
        self.lock_names = lock_names
        self.wait = meter.create_histogram(
            "dblock.lock.wait.duration", unit="s", explicit_bucket_boundaries_advisory=WAIT_BUCKETS,
            description="How long acquire calls took, from their start to their grant or their end",
        )
        self.hold_time = meter.create_histogram(
            "dblock.lock.hold.duration", unit="s", explicit_bucket_boundaries_advisory=HOLD_BUCKETS,
            description="How long leases were held, from their grant to their release or loss",
        )
        self.grants = meter.create_counter("dblock.lock.grants", unit="{grant}", description="Leases granted")
        self.timeouts = meter.create_counter(
            "dblock.lock.timeouts", unit="{timeout}", description="Acquires that ran out of time (LockNotAcquired)"
        )
        self.losses = meter.create_counter(
            "dblock.lock.losses", unit="{lease}",
            description="Leases their holder found gone without releasing them: taken over, or not extended in time",
        )
        self.refusals = meter.create_counter(
            "dblock.fence.refusals", unit="{write}", description="Fenced writes refused: a newer token wrote first (FencedOut)"
        )

    def _attributes(self, system: str, name: str) -> Attributes:
        return {SYSTEM: system, LOCK_NAME: name} if self.lock_names else {SYSTEM: system}

    def waited(self, system: str, name: str, started: float, result: object) -> None:
        seconds = time.monotonic() - started
        attributes = self._attributes(system, name)
        if result is None:
            outcome: Attributes = {OUTCOME: "busy"}
        elif isinstance(result, LockNotAcquired):
            outcome = {OUTCOME: "timeout"}
            self.timeouts.add(1, attributes)
        elif isinstance(result, BaseException):
            cls = type(result)
            outcome = {OUTCOME: "error", ERROR_TYPE: f"{cls.__module__}.{cls.__qualname__}"}
        else:
            outcome = {OUTCOME: "acquired"}
            self.grants.add(1, attributes)
        self.wait.record(seconds, {**attributes, **outcome})

    def hold(self, system: str, name: str) -> Hold:
        return Hold(system, name)

    def held(self, system: str, name: str, started: float, lost: bool) -> None:
        attributes = self._attributes(system, name)
        if lost:
            self.losses.add(1, attributes)
        self.hold_time.record(time.monotonic() - started, {**attributes, OUTCOME: "lost" if lost else "released"})

    def fenced_out(self, name: str | None) -> None:
        self.refusals.add(1, {LOCK_NAME: name} if self.lock_names and name is not None else {})


OFF = Recorder()
recorder: Recorder = OFF  # what the Lockers call: OFF, or the recording set by enable()


def enable(meter_provider: MeterProvider | None = None, *, lock_names: bool = False) -> None:
    """Record dblock's metrics from now on, for every Locker of this process.

    ``meter_provider``: an OpenTelemetry ``MeterProvider``; None (the default)
    takes the global one, ``opentelemetry.metrics.get_meter_provider()``, which
    records nothing until the application sets up the SDK (before or after
    this call). ``lock_names=True`` adds each lock's name as the attribute
    ``dblock.lock.name``: leave it off when names are many. Calling it again
    replaces the settings; ``disable()`` turns metrics off.

    Needs the ``opentelemetry-api`` package (``pip install 'dblock[otel]'``).
    """
    if not isinstance(lock_names, bool):
        raise TypeError(f"lock_names must be True or False, not {type(lock_names).__name__}")
    try:
        from opentelemetry.metrics import MeterProvider
    except ImportError as exc:
        raise ImportError(
            "dblock.metrics.enable needs OpenTelemetry's API: pip install 'dblock[otel]' (or opentelemetry-api)"
        ) from exc
    if meter_provider is not None and not isinstance(meter_provider, MeterProvider):
        raise TypeError(
            f"meter_provider must be an opentelemetry MeterProvider or None, not {type(meter_provider).__name__}"
        )
    global recorder
    recorder = _Recording(meter_provider, lock_names)


def disable() -> None:
    """Stop recording (the default state). Leases granted while enabled record nothing more."""
    global recorder
    recorder = OFF


def enabled() -> bool:
    """True between ``enable()`` and ``disable()``."""
    return recorder is not OFF


__all__ = ["disable", "enable", "enabled"]
