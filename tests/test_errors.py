"""dblock's errors: one tree, every leaf pickles, and trouble outside the SQL comes out in it too."""

from __future__ import annotations

import inspect
import os
import pickle
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import pytest

import dblock
import dblock.cli  # noqa: F401 - imported so that every DBLockError subclass dblock defines exists
import dblock.fencing  # noqa: F401
import dblock.locker  # noqa: F401
from dblock import DBLockError, FencedOut, Locker, LockNotAcquired

# Classes whose __init__ is not DBLockError's need an example here: a new one
# without it fails test_every_error_has_an_example, and then its pickling is checked.
EXAMPLES: dict[type[DBLockError], Callable[[], DBLockError]] = {
    LockNotAcquired: lambda: LockNotAcquired("nightly-report", 2.5),
    FencedOut: lambda: FencedOut("refused", token=7, resource="accounts", newer=9),
}


def _with_state(exc: DBLockError) -> DBLockError:
    """The example, with a sqlstate and an attribute set after construction, as code that raises may do."""
    exc.sqlstate = "40001"
    exc.detail = {"attempt": 2}  # type: ignore[attr-defined]
    return exc


def _all_errors() -> list[type[DBLockError]]:
    """Every DBLockError class dblock exports, then any private one its modules define (e.g. SQLite's Busy)."""
    exported = [getattr(dblock, name) for name in dblock.__all__]
    found = [c for c in exported if isinstance(c, type) and issubclass(c, DBLockError)]
    pending = [DBLockError]
    while pending:
        for sub in pending.pop().__subclasses__():
            pending.append(sub)
            if sub not in found and sub.__module__.startswith("dblock"):
                found.append(sub)
    return found


def _example(cls: type[DBLockError]) -> DBLockError:
    if cls in EXAMPLES:
        return EXAMPLES[cls]()
    return cls("the message", sqlstate="42501")


def test_the_tree_is_whole() -> None:
    errors = _all_errors()
    names = {c.__name__ for c in errors}
    assert {"DBLockError", "LockNotAcquired", "LeaseLost", "FencedOut", "SchemaMissing",
            "DatabaseUnavailable", "PermissionDenied"} <= names
    assert all(c.__name__ in dblock.__all__ for c in errors if c.__module__ == "dblock.errors")


def test_every_error_has_an_example() -> None:
    for cls in _all_errors():
        own_init = any("__init__" in vars(k) for k in cls.__mro__[: cls.__mro__.index(DBLockError)])
        assert not own_init or cls in EXAMPLES, f"add an example of {cls.__name__} to EXAMPLES"


@pytest.mark.parametrize("cls", _all_errors(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("protocol", [0, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_every_error_pickles_with_its_attributes(cls: type[DBLockError], protocol: int) -> None:
    for exc in (_example(cls), _with_state(_example(cls))):
        back = pickle.loads(pickle.dumps(exc, protocol))
        assert type(back) is cls
        assert str(back) == str(exc) and back.args == exc.args
        assert vars(back) == vars(exc)
        assert back.sqlstate == exc.sqlstate


def test_examples_keep_what_their_constructors_took() -> None:
    """The examples carry real attributes, so the round trip above compares something."""
    waited = pickle.loads(pickle.dumps(_example(LockNotAcquired)))
    assert (waited.name, waited.timeout, waited.sqlstate) == ("nightly-report", 2.5, None)  # type: ignore[attr-defined]
    refused = pickle.loads(pickle.dumps(_example(FencedOut)))
    assert (refused.token, refused.resource, refused.newer) == (7, "accounts", 9)  # type: ignore[attr-defined]
    for cls in _all_errors():
        params = inspect.signature(cls).parameters
        if "sqlstate" in params:
            assert pickle.loads(pickle.dumps(cls("m", sqlstate="08006"))).sqlstate == "08006"


def _acquire_held(url: str) -> None:
    # In a worker process: the lock is held by the parent, so this raises LockNotAcquired.
    Locker(url).acquire("held", timeout=0.05)


def test_lock_not_acquired_crosses_a_process_pool(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.sqlite3'}"
    locker = Locker(url)
    locker.create_schema()
    lease = locker.try_acquire("held", ttl=60)
    assert lease is not None
    with ProcessPoolExecutor(max_workers=1) as pool:
        future = pool.submit(_acquire_held, url)
        with pytest.raises(LockNotAcquired) as caught:
            future.result(timeout=60)
    assert (caught.value.name, caught.value.timeout, caught.value.sqlstate) == ("held", 0.05, None)
    assert "'held' was not acquired within 0.05 s" in str(caught.value)
    lease.release()
    locker.close()


# -- the embedded default and SQLite files that are not databases --------------------
JUNK = b"these bytes are not a SQLite database, whatever the file is called\n" * 3


def test_dblock_home_that_is_a_file_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.write_bytes(b"a file, not a directory")
    for value in (home, home / "below"):
        monkeypatch.setenv("DBLOCK_HOME", str(value))
        with pytest.raises(DBLockError, match=f"DBLOCK_HOME='{value}'.* {home} is a file") as caught:
            Locker()
        assert type(caught.value) is DBLockError and not isinstance(caught.value, OSError)
        assert "set DBLOCK_HOME to a directory" in str(caught.value)
        assert sorted(os.listdir(tmp_path)) == ["home"] and home.read_bytes() == b"a file, not a directory"


def test_embedded_default_that_is_a_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "locks.sqlite3").mkdir()
    monkeypatch.setenv("DBLOCK_HOME", str(tmp_path))
    with pytest.raises(DBLockError, match="locks.sqlite3 .*is a directory"):
        Locker()
    assert os.listdir(tmp_path / "locks.sqlite3") == []


def test_embedded_default_on_a_file_that_is_not_a_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "locks.sqlite3"
    path.write_bytes(JUNK)
    monkeypatch.setenv("DBLOCK_HOME", str(tmp_path))
    locker = Locker()  # the file is first read on first use
    with pytest.raises(DBLockError, match=f"{path} is not a SQLite database .*DBLOCK_HOME") as caught:
        locker.try_acquire("job")
    assert type(caught.value) is DBLockError and caught.value.__cause__ is not None
    with pytest.raises(DBLockError, match="is not a SQLite database"):
        locker.try_acquire("job")  # again, not a half-made schema
    assert os.listdir(tmp_path) == ["locks.sqlite3"] and path.read_bytes() == JUNK


def test_create_schema_on_a_sqlite_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    path.write_bytes(JUNK)
    with pytest.raises(DBLockError, match=f"{path} is not a SQLite database.*use another file"):
        Locker(f"sqlite:///{path}").create_schema()
    assert os.listdir(tmp_path) == ["app.db"] and path.read_bytes() == JUNK
