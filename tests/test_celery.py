"""The Celery recipe (docs/celery.md), run as written: in a real Celery worker on Redis, else eagerly.

The recipe's module is written to a file with the test database, table and a
queue of its own swapped in. A real worker (``celery worker --pool=threads``,
a subprocess) runs it on the Redis at 127.0.0.1:6379; where none answers,
that test skips and the eager one (tasks run in this process, no broker)
still runs the recipe.
"""

from __future__ import annotations

import importlib
import re
import secrets
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

from .conftest import Db
from .docs import samples

celery = pytest.importorskip("celery", reason="Celery is not installed (pip install 'celery[redis]', in the test extra)")

REDIS = "redis://127.0.0.1:6379/0"
LOCKER = 'Locker("postgresql://app@db/app", table="jobs")'


def recipe() -> str:
    ((_, block),) = samples("celery.md")
    assert LOCKER in block and block.count(REDIS) == 2
    return block


def write_module(pg: Db, where: Path) -> tuple[str, str]:
    """The recipe as an importable module in ``where``: (its name, its queue)."""
    name, queue = f"readme_celery_{secrets.token_hex(4)}", f"dblock-test-{secrets.token_hex(4)}"
    code = recipe().replace(LOCKER, f"Locker({pg.url!r}, table={pg.table!r})")
    code += f"\napp.conf.task_default_queue = {queue!r}\n"  # the suite's own queue on a shared Redis
    (where / f"{name}.py").write_text(code)
    return name, queue


def load(name: str, where: Path) -> ModuleType:
    sys.path.insert(0, str(where))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(where))


def exercise(module: ModuleType, pg: Db) -> None:
    """What the page says the suite shows, through Celery's own calls (``delay``, ``get``)."""
    # celery beat on four machines sends the report one after another, each after the
    # last one finished: built once, kept for the period, skipped three times.
    results = [module.nightly_report.delay().get(timeout=60) for _ in range(4)]
    assert results == ["report built"] + ["skipped: built this period already"] * 3
    # Another process (here the test) holds the invoice's lock: the worker skips it;
    # once that lock is free, the worker sends it under a fresh token.
    other = pg.locker()
    with other.lock("invoice-7") as held:
        assert module.send_invoice.delay(7).get(timeout=60) == "skipped: invoice 7 is being sent by another worker"
    sent = module.send_invoice.delay(7).get(timeout=60)
    match = re.fullmatch(r"invoice 7 sent under token (\d+)", sent)
    assert match is not None and int(match.group(1)) > held.token, sent
    assert pg.query(f"SELECT name FROM {pg.table} WHERE owner IS NOT NULL") == [("nightly-report",)]


def redis_answers() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS, socket_connect_timeout=1, socket_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("readme_celery_")]:
        module = sys.modules.pop(name)
        module.locker.close()


def test_the_celery_recipe_in_a_real_worker_on_redis(pg: Db, module_dir: Path) -> None:
    if not redis_answers():
        pytest.skip(f"no Redis answers at {REDIS}: the real worker needs one (the eager test runs the recipe anyway)")
    name, queue = write_module(pg, module_dir)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", name, "worker", "--pool=threads", "--concurrency=4", "-Q", queue,
         "--without-heartbeat", "--without-mingle", "--without-gossip", "--loglevel=WARNING"],
        cwd=module_dir, env={"PYTHONPATH": str(module_dir), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    module = load(name, module_dir)
    try:
        exercise(module, pg)
    finally:
        worker.terminate()  # a warm shutdown: it finishes what it runs, then exits
        try:
            log, _ = worker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            log, _ = worker.communicate()
        module.app.control.purge()  # nothing left in the suite's queue
    assert worker.returncode == 0, log
    assert "Traceback" not in log, log


def test_the_celery_recipe_in_eager_mode(pg: Db, module_dir: Path) -> None:
    """No broker, no worker: Celery runs each task in this process when it is sent."""
    name, _ = write_module(pg, module_dir)
    module = load(name, module_dir)
    module.app.conf.task_always_eager = True
    exercise(module, pg)
