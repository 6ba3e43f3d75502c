"""``@locker.synchronized(name)``: a function or coroutine function that runs holding a lease.

The lock's name may be a template formatted from the call's arguments
(``"report-{customer_id}"``). While the function runs, ``current_lease()``
returns its lease (for its fencing token). Not acquired in time: the call
raises ``LockNotAcquired``, as ``acquire`` does, and the function does not run.

Coroutine functions acquire and release on a worker thread
(``asyncio.to_thread``): the event loop never blocks on the database.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import string
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, ParamSpec, TypeVar

from ._validate import check_min_hold, check_name, check_owner, check_renew, check_timeout, check_ttl
from .lease import Lease
from .locker import Locker
from .renew import OnLost

if TYPE_CHECKING:
    from .aio import AsyncLocker

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("dblock.release")

_current: contextvars.ContextVar[Any] = contextvars.ContextVar("dblock_current_lease", default=None)


def current_lease() -> Any:
    """The lease of the innermost ``@synchronized`` function running in this thread or task, or None
    (a ``Lease``; an ``AsyncLease`` under ``AsyncLocker.synchronized``)."""
    return _current.get()


def locked(
    locker: Locker | AsyncLocker,
    name: str,
    *,
    ttl: float | None = None,
    timeout: float | None = None,
    renew: bool = False,
    on_lost: OnLost | None = None,
    min_hold: float | None = None,
    owner: str | None = None,
    on_expiring: OnLost | None = None,
    expiring_margin: float | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """See ``Locker.synchronized``."""
    if not isinstance(name, str):
        raise TypeError(f"lock name must be a str, not {type(name).__name__}")
    ttl = None if ttl is None else check_ttl(ttl)
    timeout = None if timeout is None else check_timeout(timeout)
    check_renew(renew, on_lost, on_expiring, expiring_margin)
    renewal: dict[str, Any] = dict(renew=renew, on_lost=on_lost, on_expiring=on_expiring, expiring_margin=expiring_margin)
    hold = check_min_hold(min_hold)
    fields = _fields(name)
    if not fields:
        check_name(name)
    if owner is not None and not isinstance(owner, str):
        raise TypeError(f"owner key must be a str or None, not {type(owner).__name__}")
    owner_fields = [] if owner is None else _fields(owner, "owner key")
    if owner is not None and not owner_fields:
        check_owner(owner)
    native = not isinstance(locker, Locker)  # an AsyncLocker: its own awaitable calls
    alocker: Any = locker
    slocker: Locker = locker  # type: ignore[assignment]  # used only when not native

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            # The lease would end when the generator is made, long before its items.
            raise TypeError(f"@synchronized cannot wrap the generator function {fn.__qualname__}: lock inside it instead")
        signature = inspect.signature(fn)
        extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        for what, template, used in (("lock name", name, fields), ("owner key", owner, owner_fields)):
            missing = [f for f in used if f not in signature.parameters]
            if missing and extra is None:  # with **kwargs, a field may name one: checked at each call
                raise ValueError(
                    f"{what} {template!r} names {', '.join(map(repr, missing))}, which {fn.__name__}() has no "
                    f"parameter for; its parameters: {', '.join(signature.parameters) or '(none)'}"
                )

        def fill(what: str, template: str, used: list[str], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            bound = signature.bind(*args, **kwargs)  # a bad call raises the TypeError the function would
            bound.apply_defaults()
            values = dict(bound.arguments)
            if extra is not None:
                values = {**values.pop(extra), **values}
            absent = [f for f in used if f not in values]
            if absent:
                raise ValueError(f"{what} {template!r} needs the argument {absent[0]!r}, which this call of {fn.__name__}() lacks")
            return template.format_map(values)

        def lock_name(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            return check_name(fill("lock name", name, fields, args, kwargs)) if fields else name

        def owner_key(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
            if owner is None or not owner_fields:
                return owner
            return check_owner(fill("owner key", owner, owner_fields, args, kwargs))

        if native and not inspect.iscoroutinefunction(fn):
            raise TypeError(
                f"AsyncLocker.synchronized wraps coroutine functions; {fn.__qualname__} is not one (use a Locker's @synchronized)"
            )
        if native:

            @functools.wraps(fn)
            async def run_native(*args: Any, **kwargs: Any) -> Any:
                async with alocker.lock(
                    lock_name(args, kwargs), ttl=ttl, timeout=timeout, min_hold=hold, **renewal,
                    owner=owner_key(args, kwargs),
                ) as lease:
                    mark = _current.set(lease)
                    try:
                        return await fn(*args, **kwargs)  # type: ignore[misc]
                    finally:
                        _current.reset(mark)

            return run_native  # type: ignore[return-value]

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                key, holder = lock_name(args, kwargs), owner_key(args, kwargs)
                lease = await _acquire_off_loop(lambda: slocker.acquire(
                    key, ttl=ttl, timeout=timeout, min_hold=hold, **renewal, owner=holder
                ))
                mark = _current.set(lease)
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    _current.reset(mark)
                    await _off_loop(lambda: lease.__exit__(type(exc), exc, exc.__traceback__))
                    raise
                _current.reset(mark)
                await _off_loop(lambda: lease.__exit__(None, None, None))  # LeaseLost if it was lost meanwhile
                return result

            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with slocker.lock(
                lock_name(args, kwargs), ttl=ttl, timeout=timeout, min_hold=hold, **renewal,
                owner=owner_key(args, kwargs),
            ) as lease:
                mark = _current.set(lease)
                try:
                    return fn(*args, **kwargs)
                finally:
                    _current.reset(mark)

        return run

    return decorate


def _fields(template: str, what: str = "lock name") -> list[str]:
    """The argument names a lock-name (or owner-key) template uses (``{customer_id}``, ``{order.id}``:
    customer_id, order)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{what} {template!r} is not a valid format template: {exc}") from None
    names = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        head = field.split(".", 1)[0].split("[", 1)[0]
        if not head or head.isdigit():
            raise ValueError(
                f"{what} {template!r}: name the argument in each {{}} field (e.g. {{customer_id}}), not by position"
            )
        names.append(head)
    return list(dict.fromkeys(names))


async def _off_loop(call: Callable[[], R]) -> R:
    """``call()`` on a worker thread; a cancelled task still waits for it, so a release is never half done."""
    task = asyncio.ensure_future(asyncio.to_thread(call))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])  # the thread cannot be stopped: let it finish, then stop
        raise


async def _acquire_off_loop(acquire: Callable[[], Lease]) -> Lease:
    """``acquire()`` on a thread of its own. If the task is cancelled while it waits, the thread
    cannot be stopped: it goes on, and releases at once a lease it gets after all (with
    renewal, such a lease would otherwise be kept as long as the process lives). Not the loop's
    executor, which ``asyncio.run`` waits for on its way out: a cancelled wait must not hold that up."""
    done: concurrent.futures.Future[Lease] = concurrent.futures.Future()
    guard = threading.Lock()
    abandoned = False

    def work() -> None:
        try:
            lease = acquire()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting task
            done.set_exception(exc)
            return
        with guard:
            if not abandoned:
                done.set_result(lease)
                return
        _release_quietly(lease)

    threading.Thread(target=work, name="dblock-acquire", daemon=True).start()
    try:
        # Shielded: a cancel must not cancel ``done``, which the thread still completes.
        return await asyncio.shield(asyncio.wrap_future(done))
    except asyncio.CancelledError:
        with guard:
            abandoned = True
            got = done.result() if done.done() and done.exception() is None else None
        if got is not None:  # granted just before the cancel
            threading.Thread(target=_release_quietly, args=(got,), name="dblock-release", daemon=True).start()
        raise


def _release_quietly(lease: Lease) -> None:
    try:
        lease.release()
    except Exception:  # noqa: BLE001 - the lease ends at its TTL anyway
        log.warning("could not release %r after its waiter was cancelled", lease.name, exc_info=True)


__all__ = ["current_lease", "locked"]
