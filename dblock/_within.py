"""A call bounded in time on a thread of its own (``dblock run``'s helper; importable from ``dblock.renew``).

Thread code with no async twin, so it is written by hand here rather than in
``_arenew.py``, from which ``renew.py`` is generated.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Overdue(Exception):
    """``call_within``'s call did not finish in time."""


def call_within(call: Callable[[], T], timeout: float, name: str) -> T:
    """``call()`` on a daemon thread: its result or its exception, or Overdue after ``timeout`` s.

    On a timeout the call goes on in the background; its outcome is dropped.
    """
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(max(timeout, 0.0)):
        raise Overdue(f"{name} did not finish within {timeout:.3g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


__all__ = ["Overdue", "call_within"]
