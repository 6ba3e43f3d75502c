"""dblock.contrib.django with real Django on PostgreSQL and SQLite: locker(alias), fenced_update, the field, manage.py dblock."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from typing import Any, Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

import dblock
from dblock import FencedOut, LeaseLost
from dblock.cli import EXIT_BUSY, EXIT_NOT_HELD, EXIT_USAGE

from .conftest import libpq_dsn, wait_for
from .django_support import ROOT, DjangoEnv, django_env, drop_database, manage  # noqa: F401 - django_env is a fixture

pytest.importorskip("django")


@pytest.fixture(params=["default", "sqlite"])
def alias(request: pytest.FixtureRequest, django_env: DjangoEnv) -> str:  # noqa: F811
    """The database a test runs on: "default" is PostgreSQL."""
    return str(request.param)


@pytest.fixture
def name() -> str:
    return "t-" + secrets.token_hex(4)


def _account(alias: str, balance: int = 100) -> Any:
    from tests.django_app.models import Account

    return Account.objects.using(alias).create(balance=balance)


def _row(alias: str, pk: int) -> tuple[int, int]:
    from tests.django_app.models import Account

    return tuple(Account.objects.using(alias).filter(pk=pk).values_list("balance", "fence_token").get())  # type: ignore[return-value]


class _Queries:
    """``with _Queries(alias) as sent``: ``sent.sql``, every statement Django sent on ``alias`` in the block."""

    def __init__(self, alias: str) -> None:
        from django.db import connections
        from django.test.utils import CaptureQueriesContext

        self._capture = CaptureQueriesContext(connections[alias])

    def __enter__(self) -> _Queries:
        self._capture.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._capture.__exit__(*exc)

    @property
    def sql(self) -> list[str]:
        return [query["sql"] for query in self._capture.captured_queries]


# -- the database of an alias ---------------------------------------------------
def test_database_url_comes_from_settings(django_env: DjangoEnv) -> None:  # noqa: F811
    from dblock.contrib.django import database_url

    pg = make_url(django_env.pg_url)
    url = database_url()
    assert (url.drivername, url.username, url.host, url.port, url.database) == (
        "postgresql+psycopg", pg.username, pg.host, pg.port, pg.database,
    )
    assert database_url("sqlite").render_as_string() == f"sqlite:///{django_env.sqlite}"


@pytest.mark.parametrize(
    ("alias_", "error", "words"),
    [
        ("oracle", ValueError, ["PostgreSQL, MariaDB and SQLite", "django.db.backends.oracle", "oracle database"]),
        ("memory", ValueError, ["in-memory", "['TEST']['NAME']"]),
        ("nowhere", ValueError, ["no database 'nowhere'", "'default'", "'sqlite'"]),
        (7, TypeError, ["alias must be a str"]),
    ],
)
def test_unsupported_databases_are_refused_before_any_connection(
    django_env: DjangoEnv, alias_: Any, error: type[Exception], words: list[str]  # noqa: F811
) -> None:
    from django.db import connections

    from dblock.contrib.django import database_url, locker

    for call in (database_url, locker):
        with pytest.raises(error) as refused:
            call(alias_)
        assert all(w in str(refused.value) for w in words), str(refused.value)
    if alias_ == "oracle":
        # Refused by its ENGINE: Django did not even load the backend (which needs Oracle's driver).
        assert "oracle" not in {c.alias for c in connections.all(initialized_only=True)}


def test_a_mariadb_alias_becomes_dblocks_mariadb_url(django_env: DjangoEnv) -> None:  # noqa: F811
    """Django's mysql ENGINE: NAME, USER, PASSWORD, HOST, PORT and the OPTIONS that name the
    connection, as dblock's own PyMySQL URL; nothing connects (Django's backend is not loaded)."""
    from django.db import connections

    from dblock.contrib.django import database_url

    url = database_url("mysql")
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
        "mariadb+pymysql", "app", "p@ss", "db", 3307, "app",
    )
    assert dict(url.query) == {"charset": "utf8mb4"}  # init_command is for Django's own connections
    assert "mysql" not in {c.alias for c in connections.all(initialized_only=True)}


def test_postgresql_settings_become_the_url_libpq_would_use(django_env: DjangoEnv) -> None:  # noqa: F811
    from dblock.contrib.django.database import _postgresql_url

    def url(**settings: Any) -> str:
        base = {"NAME": "app", "USER": "", "PASSWORD": "", "HOST": "", "PORT": "", "OPTIONS": {}}
        return _postgresql_url({**base, **settings}, "x").render_as_string(hide_password=False)

    assert url(USER="u", PASSWORD="p@ss:/w", HOST="db", PORT="6432") == "postgresql+psycopg://u:p%40ss%3A%2Fw@db:6432/app"
    assert make_url(url(USER="u", PASSWORD="p@ss:/w", HOST="db")).password == "p@ss:/w"
    # A Unix socket directory, or several hosts, stay in the query, as libpq takes them.
    assert url(HOST="/var/run/postgresql", PORT="5433") == (
        "postgresql+psycopg:///app?host=%2Fvar%2Frun%2Fpostgresql&port=5433"
    )
    assert url(HOST="db1,db2", PORT="5432,5433", OPTIONS={"target_session_attrs": "read-write"}) == (
        "postgresql+psycopg:///app?host=db1%2Cdb2&port=5432%2C5433&target_session_attrs=read-write"
    )
    assert url(NAME=None) == "postgresql+psycopg:///postgres"  # Django's meaning of NAME None
    assert url(NAME="", OPTIONS={"service": "billing"}) == "postgresql+psycopg://?service=billing"
    # Options for Django's own connections are left out; libpq's are kept.
    django_only = {"isolation_level": 3, "server_side_binding": True, "pool": True, "sslmode": "require", "connect_timeout": 4}
    assert url(OPTIONS=django_only) == "postgresql+psycopg:///app?connect_timeout=4&sslmode=require"
    assert url(OPTIONS={"assume_role": "app role", "options": "-c work_mem=8MB"}) == (
        "postgresql+psycopg:///app?options=-c+work_mem%3D8MB+-c+role%3Dapp%5C+role"
    )
    with pytest.raises(ValueError, match="DATABASES\\['x'\\]\\['OPTIONS'\\].*sslmod"):
        url(OPTIONS={"sslmod": "require"})  # a typo: refused here, not at the first acquire


def test_assume_role_is_the_role_dblock_works_as(django_env: DjangoEnv) -> None:  # noqa: F811
    """Django runs SET ROLE for OPTIONS["assume_role"]; dblock's connections take the same role."""
    from dblock._engine import engine_for
    from dblock.contrib.django.database import _postgresql_url

    pg = make_url(django_env.pg_url)
    role = "dj_role_" + secrets.token_hex(3)
    admin = psycopg.connect(libpq_dsn(django_env.pg_url), autocommit=True)
    admin.execute(f"CREATE ROLE {role} NOLOGIN")
    try:
        settings = {"NAME": pg.database, "USER": pg.username, "PASSWORD": pg.password or "",
                    "HOST": pg.query.get("host") or pg.host,  # pgserver's socket directory is in the query
                    "PORT": str(pg.port or pg.query.get("port") or 5432), "OPTIONS": {"assume_role": role}}
        engine, _, _ = engine_for(_postgresql_url(settings, "x"))
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT current_user, session_user").one() == (role, pg.username)
        engine.dispose()
    finally:
        admin.execute(f"DROP ROLE {role}")
        admin.close()


# -- locker(alias) ----------------------------------------------------------------
def test_locker_is_one_per_alias_and_options(django_env: DjangoEnv) -> None:  # noqa: F811
    from dblock.contrib.django import database_url, locker

    assert locker() is locker("default")
    assert locker("sqlite") is locker("sqlite") is not locker()
    assert locker(ttl=5) is locker(ttl=5) is not locker()
    assert locker(ttl=5).ttl == 5
    assert locker("sqlite").engine.url == database_url("sqlite")


def test_locker_follows_the_settings_to_the_test_database(django_env: DjangoEnv, tmp_path: Any) -> None:  # noqa: F811
    """Django's test runner renames an alias's database in place; locker() then works on the new one."""
    from django.db import connections

    from dblock.contrib.django import locker

    before = locker("sqlite")
    settings = connections.settings["sqlite"]
    real = settings["NAME"]
    settings["NAME"] = str(tmp_path / "test_app.sqlite3")
    try:
        moved = locker("sqlite")
        assert moved is not before and moved.engine.url.database == settings["NAME"]
    finally:
        settings["NAME"] = real
    assert locker("sqlite") is before


def test_a_forked_child_makes_its_own_locker(django_env: DjangoEnv, name: str) -> None:  # noqa: F811
    from dblock.contrib.django import locker

    parent = locker("sqlite")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and never return into pytest
        try:
            mine = locker("sqlite")
            lease = mine.try_acquire(name)
            os.write(write, json.dumps([mine is parent, mine is locker("sqlite"), lease is not None]).encode())
            lease.release()
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = json.loads(pipe.read() or "null")
    os.waitpid(pid, 0)
    assert answer == [False, True, True]
    assert parent.try_acquire(name) is not None  # the child released its lease; the parent's Locker works on


def test_locker_works_on_the_tables_django_made(alias: str, name: str) -> None:
    """Grants, the fences table, and a waiter handed the lease (PostgreSQL: the fair queue's functions)."""
    from dblock.contrib.django import locker

    other = locker(alias, label="other")
    lease = locker(alias).acquire(name, ttl=30)
    assert [i.name for i in locker(alias).leases() if i.name == name] == [name]
    assert other.try_acquire(name) is None
    handed: list[dblock.Lease] = []
    waiter = threading.Thread(target=lambda: handed.append(other.acquire(name, timeout=30)))
    waiter.start()
    if alias == "default":
        wait_for(lambda: other.waiters().get(name) == 1, what="the waiter to queue")
    lease.release()
    waiter.join(30)
    (next_lease,) = handed
    assert next_lease.token > lease.token
    with other.engine.begin() as conn:
        dblock.fence(conn, next_lease)  # the fences table
        with pytest.raises(FencedOut):
            dblock.fence(conn, lease)
    next_lease.release()


# -- fenced_update -----------------------------------------------------------------
def test_a_holder_that_paused_past_its_lease_cannot_write(alias: str, name: str, dblock_expire: Any) -> None:
    """The two-lease scenario: the stale holder's write is refused, the newer one's stands."""
    from django.db import transaction
    from django.db.models import F

    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Account

    account = _account(alias)
    rows = Account.objects.using(alias).filter(pk=account.pk)
    stale = locker(alias).acquire(name)
    dblock_expire(stale)  # it pauses past its TTL...
    fresh = locker(alias, label="fresh").acquire(name, timeout=5)  # ...and another holder takes over
    assert fresh.token > stale.token
    with transaction.atomic(using=alias):
        assert fenced_update(rows, fresh, balance=F("balance") - 30) == 1
    assert _row(alias, account.pk) == (70, fresh.token)
    with pytest.raises(FencedOut) as refused, transaction.atomic(using=alias):
        fenced_update(rows, stale, balance=0)  # the stale holder wakes up and writes
    assert (refused.value.token, refused.value.newer) == (stale.token, fresh.token)
    assert refused.value.resource == "table 'django_app_account'"
    assert f"newer token {fresh.token}" in str(refused.value)
    assert _row(alias, account.pk) == (70, fresh.token)  # nothing was written
    fresh.release()


def test_tokens_in_grant_order_all_write(alias: str, name: str) -> None:
    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Account

    account = _account(alias)
    rows = Account.objects.using(alias).filter(pk=account.pk)
    for balance in (1, 2):
        with locker(alias).lock(name) as lease:
            assert fenced_update(rows, lease, balance=balance) == 1
            assert fenced_update(rows, lease, balance=balance * 10) == 1  # one lease, any number of writes
            assert _row(alias, account.pk) == (balance * 10, lease.token)


def test_no_rows_matched_is_not_a_refusal(alias: str, name: str) -> None:
    """Zero rows written: FencedOut only if a row the queryset matches holds a newer token."""
    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Account

    newer_elsewhere = _account(alias)
    old = locker(alias).acquire(name)
    old.release()
    with locker(alias).lock(name) as lease:
        fenced_update(Account.objects.using(alias).filter(pk=newer_elsewhere.pk), lease, balance=1)
    queryset = Account.objects.using(alias).filter(pk=-1)
    assert fenced_update(queryset, old, balance=5) == 0
    both = Account.objects.using(alias).filter(pk__in=[newer_elsewhere.pk, -1])
    with pytest.raises(FencedOut):
        fenced_update(both, old, balance=5)


def test_several_rows_write_those_no_newer_lease_stamped(alias: str, name: str) -> None:
    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Account

    first, second = _account(alias), _account(alias)
    both = Account.objects.using(alias).filter(pk__in=[first.pk, second.pk])
    older = locker(alias).acquire(name)
    older.release()
    with locker(alias).lock(name) as newer:
        fenced_update(Account.objects.using(alias).filter(pk=second.pk), newer, balance=2)
    assert fenced_update(both, older, balance=1) == 1
    assert _row(alias, first.pk) == (1, older.token) and _row(alias, second.pk) == (2, newer.token)


def test_strict_lets_each_grant_write_a_row_once(alias: str, name: str) -> None:
    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Account

    rows = Account.objects.using(alias).filter(pk=_account(alias).pk)
    with locker(alias).lock(name) as lease:
        assert fenced_update(rows, lease, strict=True, balance=1) == 1
        with pytest.raises(FencedOut) as refused:
            fenced_update(rows, lease, strict=True, balance=2)
        assert refused.value.newer == lease.token and "once already" in str(refused.value)
        assert fenced_update(rows, lease, balance=3) == 1  # the default mode lets it through
    with locker(alias).lock(name) as later:
        assert fenced_update(rows, later, strict=True, balance=4) == 1


def test_a_bare_token_and_another_column(alias: str, name: str) -> None:
    """An int token (as from $DBLOCK_TOKEN) fences like its Lease; ``column=`` names the fence."""
    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Ledger

    entry = Ledger.objects.using(alias).create()
    rows = Ledger.objects.using(alias).filter(pk=entry.pk)
    with locker(alias).lock(name) as old:
        token = int(str(old.token))
    with locker(alias).lock(name) as new:
        assert fenced_update(rows, new.token, column="epoch", entry="new") == 1
    with pytest.raises(FencedOut):
        fenced_update(rows, token, column="epoch", entry="old")
    assert rows.values_list("entry", "epoch").get() == ("new", new.token)


def test_the_check_and_the_stamp_are_one_update(alias: str, name: str) -> None:
    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Account

    rows = Account.objects.using(alias).filter(pk=_account(alias).pk)
    with locker(alias).lock(name) as lease, _Queries(alias) as sent:
        fenced_update(rows, lease, balance=1)
    (update,) = sent.sql
    assert update.startswith("UPDATE") and '"fence_token" <=' in update and '"fence_token" = ' in update
    older = lease.token - 1
    with _Queries(alias) as sent, pytest.raises(FencedOut):
        fenced_update(rows, older, balance=2)
    assert [s.split()[0] for s in sent.sql] == ["UPDATE", "SELECT"]  # the look only after writing nothing


@pytest.mark.parametrize("through_a_join", [False, True], ids=["plain", "filtered-through-a-relation"])
def test_an_older_write_waiting_for_a_newer_stamp_is_refused(
    django_env: DjangoEnv, name: str, through_a_join: bool  # noqa: F811
) -> None:
    """PostgreSQL, READ COMMITTED: the newer holder's stamp is uncommitted when the older holder's
    UPDATE arrives; it waits for the row, and once the stamp commits, the fence refuses it. The fence
    must be checked on the row the UPDATE writes: also when the queryset filters through a relation,
    where Django puts the filters in a subquery."""
    from django.db import connections, transaction

    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Account, Owner

    owner = Owner.objects.create(name=name)
    account = Account.objects.create(owner=owner, balance=100)
    rows = Account.objects.filter(owner__name=name) if through_a_join else Account.objects.filter(pk=account.pk)
    older = locker().acquire(name)
    older.release()
    newer = locker().acquire(name)
    outcome: list[BaseException | int] = []

    def late_write() -> None:
        try:
            with transaction.atomic():
                outcome.append(fenced_update(rows, older, balance=0))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)
        finally:
            connections.close_all()

    with transaction.atomic():
        fenced_update(rows, newer, balance=70)
        writer = threading.Thread(target=late_write)
        writer.start()
        with psycopg.connect(libpq_dsn(django_env.pg_url), autocommit=True) as watcher:
            wait_for(
                lambda: watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
                ).fetchone() == (1,),
                what="the older holder's UPDATE to wait for the row",
            )
    writer.join(30)
    (result,) = outcome
    assert isinstance(result, FencedOut), result
    assert result.newer == newer.token
    assert _row("default", account.pk) == (70, newer.token)
    newer.release()


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda f, m, lease: f(m.all(), "7", balance=1), TypeError, "not str"),
        (lambda f, m, lease: f(m.all(), True, balance=1), TypeError, "not bool"),
        (lambda f, m, lease: f(m.all(), 0, balance=1), ValueError, "token must be between 1"),
        (lambda f, m, lease: f(list(m.none()), lease, balance=1), TypeError, "needs a QuerySet"),
        (lambda f, m, lease: f(m.all()[:1], lease, balance=1), TypeError, "sliced"),
        (lambda f, m, lease: f(m.all(), lease, strict=1, balance=1), TypeError, "strict must be"),
        (lambda f, m, lease: f(m.all(), lease, fence_token=9), ValueError, "do not set 'fence_token'"),
        (lambda f, m, lease: f(m.all(), lease, nothing=1), ValueError, "Account has no field 'nothing'"),
        (lambda f, m, lease: f(m.all(), lease, column="balance", owner=None), ValueError, "BigIntegerField"),
        (lambda f, m, lease: f(m.all(), lease, column="nope", balance=1), ValueError, "FenceTokenField()"),
        (lambda f, m, lease: f(m.all(), lease, owner__name="x"), ValueError, "no field 'owner__name'"),
    ],
)
def test_bad_arguments_are_refused_before_any_sql(
    alias: str, name: str, call: Any, error: type[Exception], words: str
) -> None:
    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Account

    with locker(alias).lock(name) as lease, _Queries(alias) as sent:
        with pytest.raises(error) as refused:
            call(fenced_update, Account.objects.db_manager(alias), lease)
    assert words in str(refused.value)
    assert sent.sql == []


@pytest.mark.parametrize(
    ("model", "options", "words"),
    [
        ("Ledger", {"column": "loose", "entry": "x"}, "NOT NULL"),
        ("Ledger", {"column": "small", "entry": "x"}, "BigIntegerField"),
        ("Owner", {"name": "x"}, "Owner has no field 'fence_token'"),
        ("Savings", {"rate": 1}, "stored in Account's table"),  # the fence is in the parent's table
        ("Savings", {"column": "epoch", "rate": 1}, "no field 'epoch'"),
    ],
)
def test_models_that_cannot_be_fenced_are_refused_before_any_sql(
    alias: str, model: str, options: dict[str, Any], words: str
) -> None:
    from tests.django_app import models

    from dblock.contrib.django import fenced_update

    with _Queries(alias) as sent, pytest.raises(ValueError) as refused:
        fenced_update(getattr(models, model).objects.using(alias).all(), 5, **options)
    assert words in str(refused.value)
    assert sent.sql == []


# -- FenceTokenField ---------------------------------------------------------------
def test_a_plain_save_does_not_lower_the_fence(alias: str, name: str) -> None:
    """save() of an object loaded before a newer stamp keeps that stamp: an older lease stays out."""
    from dblock.contrib.django import fenced_update, locker
    from tests.django_app.models import Account

    account = _account(alias)
    assert account.fence_token == 0  # a new row
    loaded = Account.objects.using(alias).get(pk=account.pk)  # fence_token 0
    older = locker(alias).acquire(name)
    older.release()
    with locker(alias).lock(name) as newer:
        fenced_update(Account.objects.using(alias).filter(pk=account.pk), newer, balance=70)
    loaded.balance = 71
    loaded.save()  # writes balance; writing back fence_token = 0 would reopen the row to any token
    assert _row(alias, account.pk) == (71, newer.token)
    with pytest.raises(FencedOut):
        fenced_update(Account.objects.using(alias).filter(pk=account.pk), older, balance=0)


def test_fence_token_field_defaults() -> None:
    from dblock.contrib.django import FenceTokenField
    from tests.django_app.models import Account

    field = Account._meta.get_field("fence_token")
    assert (field.default, field.null, field.editable, field.get_internal_type()) == (0, False, False, "BigIntegerField")
    assert FenceTokenField().deconstruct()[3] == {}
    assert FenceTokenField(editable=True, default=5).deconstruct()[3] == {"editable": True, "default": 5}
    name, path, args, kwargs = FenceTokenField(db_index=True).deconstruct()
    rebuilt = FenceTokenField(*args, **kwargs)
    assert (rebuilt.default, rebuilt.editable, rebuilt.db_index) == (0, False, True)
    assert path == "dblock.contrib.django.fields.FenceTokenField"


def test_under_djangos_test_runner(django_env: DjangoEnv) -> None:  # noqa: F811
    """`manage.py test`: the test database gets dblock's tables from the migration, and locker() locks there."""
    try:
        out = manage(django_env, "test", "tests.django_app.runner_checks", "--noinput", DBLOCK_DJANGO_REFUSED="0")
    finally:  # left behind when the runner could not drop it
        test_db = make_url(django_env.pg_url).set(database="test_" + make_url(django_env.pg_url).database)
        drop_database(django_env.pg_url, test_db.render_as_string(hide_password=False))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Ran 1 test" in out.stderr and "OK" in out.stderr and "error" not in out.stderr.lower()


def test_importing_dblock_does_not_import_django() -> None:
    code = (
        "import sys, dblock, dblock.locker, dblock.fencing, dblock.cli, dblock.orm, dblock.migrate\n"
        "dblock.Locker, dblock.fenced_update\n"
        "print(sorted(m for m in sys.modules if m == 'django' or m.startswith('django.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- manage.py dblock --------------------------------------------------------------
@pytest.fixture
def held(alias: str, name: str) -> Iterator[dblock.Lease]:
    from dblock.contrib.django import locker

    lease = locker(alias, label="held by the test").acquire(name, ttl=60)
    yield lease
    lease.release()


def test_manage_dblock_status(django_env: DjangoEnv, alias: str, name: str, held: dblock.Lease) -> None:  # noqa: F811
    out = manage(django_env, "dblock", "status", name, "--json", "--database", alias)
    assert out.returncode == 0, out.stderr
    (info,) = json.loads(out.stdout)
    assert (info["name"], info["token"], info["label"]) == (name, held.token, "held by the test")
    out = manage(django_env, "dblock", "--database", alias, "status", name + "-free")
    assert (out.returncode, out.stdout) == (EXIT_NOT_HELD, f"{name}-free is not held\n")


def test_manage_dblock_run(django_env: DjangoEnv, alias: str, name: str) -> None:  # noqa: F811
    from dblock.contrib.django import locker

    show = [sys.executable, "-c", "import os; print(os.environ['DBLOCK_NAME'], os.environ['DBLOCK_TOKEN'])"]
    out = manage(django_env, "dblock", "run", name, "--database", alias, "--ttl", "10s", "--", *show)
    assert out.returncode == 0, out.stderr
    got, token = out.stdout.split()
    assert got == name and [i for i in locker(alias).leases() if i.name == name] == []  # released after
    with locker(alias).lock(name) as lease:
        assert lease.token > int(token)
        out = manage(django_env, "dblock", "run", name, "--database", alias, "--", *show)
    assert out.returncode == EXIT_BUSY and out.stdout == ""
    assert f"lock {name!r} is busy" in out.stderr


def test_manage_dblock_release(django_env: DjangoEnv, alias: str, held: dblock.Lease) -> None:  # noqa: F811
    out = manage(django_env, "dblock", "release", held.name, "--force", "--yes", f"--database={alias}")
    assert out.returncode == 0, out.stderr
    assert f"released {held.name!r}" in out.stderr
    with pytest.raises(LeaseLost):
        held.extend()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--url", "sqlite:///x.db", "status"], "use --database ALIAS, not --url"),
        (["status", "--url=sqlite:///x.db"], "not --url"),
        (["--table", "migrate", "migrate", "--sql"], "manage.py migrate dblock"),
        (["status", "--database", "nowhere"], "no database 'nowhere'"),
        (["status", "--database", "oracle"], "PostgreSQL, MariaDB and SQLite"),
        (["status", "--database"], "--database needs an alias"),
    ],
)
def test_manage_dblock_refuses_what_does_not_apply(
    django_env: DjangoEnv, argv: list[str], words: str, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    from dblock.contrib.django.management.commands.dblock import run

    assert run(argv) == EXIT_USAGE
    assert words in capsys.readouterr().err


def test_manage_dblock_bad_arguments_exit_as_dblocks_do(django_env: DjangoEnv) -> None:  # noqa: F811
    out = manage(django_env, "dblock", "--url", "sqlite:///x.db", "status", "--settings", "tests.django_settings")
    assert out.returncode == EXIT_USAGE and "not --url" in out.stderr
    out = manage(django_env, "dblock", "run", "job", "--database", "sqlite", "--ttl", "-1", "--", "true")
    assert out.returncode == EXIT_USAGE and "ttl" in out.stderr


def test_call_command_dblock(django_env: DjangoEnv, name: str, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    from django.core.management import CommandError, call_command

    from dblock.contrib.django import locker

    with locker("sqlite").lock(name):
        call_command("dblock", "status", "--json", database="sqlite")
        assert name in [i["name"] for i in json.loads(capsys.readouterr().out)]
    with pytest.raises(CommandError) as failed:
        call_command("dblock", "status", name, database="sqlite")
    assert failed.value.returncode == EXIT_NOT_HELD


def test_the_command_is_dblocks_own(django_env: DjangoEnv) -> None:  # noqa: F811
    """`manage.py dblock --help` is dblock's help as it applies here (--database, no --url, no migrate);
    `manage.py help dblock` names --database."""
    out = manage(django_env, "dblock", "--help")
    assert out.returncode == 0 and "release" in out.stdout and "status" in out.stdout
    assert "--database ALIAS" in out.stdout and "--url" not in out.stdout and "DBLOCK_URL" not in out.stdout
    assert "migrate" not in out.stdout.replace("manage.py migrate dblock", "")
    assert out.stdout.startswith("usage: python -m django dblock ")  # how the suite runs manage.py
    out = manage(django_env, "dblock", "run", "--help")
    assert out.returncode == 0 and "--database ALIAS" in out.stdout and "--url" not in out.stdout
    assert "usage: python -m django dblock run NAME" in out.stdout
    out = manage(django_env, "help", "dblock")
    assert out.returncode == 0 and "--database" in out.stdout
