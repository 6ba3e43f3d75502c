"""An app's own Alembic with dblock.migrate.run_with: one `alembic upgrade head`, one head.

Each app is made by `alembic init` and runs the `alembic` and `dblock` commands of a fresh
virtualenv with dblock installed from its built wheel (``wheel_venv``), as a user's would;
its env.py is the one `alembic init` wrote, plus the lines docs/alembic.md's "With your
migrations" adds to it. A newer dblock is this one copied with one more revision.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import create_engine, inspect, text

from dblock import DBLockError, Locker, migrate
from dblock.schema import DEFAULT_TABLE, fences_table_name, version_table_name

from .conftest import libpq_dsn, lock_once, scratch_database
from .docs import blocks, section

DBLOCK_HEAD = ScriptDirectory(str(migrate.migrations_dir())).get_current_head()
ITEMS = 'Table("items", metadata, Column("id", Integer, primary_key=True), Column("body", Text))\n'
TAGS = 'Table("tags", metadata, Column("id", Integer, primary_key=True))\n'
NEWER = '''"""A newer dblock's revision (tests only): a note on each fenced resource."""
import sqlalchemy as sa
from alembic import op

from dblock.migrate import target
from dblock.schema import fences_table_name

revision = "dblock_9001"
down_revision = {head!r}
branch_labels = None
depends_on = None


def upgrade():
    table, schema = target()
    op.add_column(fences_table_name(table), sa.Column("note", sa.Text), schema=schema)


def downgrade():
    table, schema = target()
    op.drop_column(fences_table_name(table), "note", schema=schema)
'''


def readme_env_lines() -> tuple[str, str]:
    """The env.py lines of docs/alembic.md: the import, and the call that goes just before context.run_migrations()."""
    (block,) = [b for b in blocks(section("alembic.md", "Adding dblock to an existing app")) if "run_with(context" in b]
    compile(block, "docs/alembic.md", "exec")  # whole functions, indented as alembic init writes them
    lines = block.splitlines()
    (imported,) = [line.split("  #")[0] for line in lines if line.startswith("from dblock")]
    at = [line.strip() for line in lines].index("context.run_migrations()")
    assert lines[at - 2].strip() == "with context.begin_transaction():", block  # in the app's transaction
    call = lines[at - 1].strip().split("  #")[0]
    assert call == "run_with(context)", block
    online = lines[at + 1:]
    at = [line.strip() for line in online].index("context.run_migrations()")
    assert [line.strip() for line in online[at - 2 : at]] == ["with context.begin_transaction():", "run_with(context)  # added"]
    return imported, call


def down_revision(source: str) -> str:
    (found,) = re.findall(r"^down_revision(?::[^=]*)? = (.+)$", source, re.M)
    return found


class App:
    """An app made by `alembic init`, with run_with in its env.py, on its own database."""

    def __init__(self, path: Path, bin_dir: Path, url: str, table: str, schema: str | None) -> None:
        self.path, self.bin, self.url, self.table, self.schema = path, bin_dir, url, table, schema
        self.pythonpath: str | None = None  # a newer dblock, when set
        path.mkdir()
        self.alembic("init", "migrations")
        ini = (path / "alembic.ini").read_text()
        placeholder = "sqlalchemy.url = driver://user:pass@localhost/dbname\n"
        assert placeholder in ini
        (path / "alembic.ini").write_text(ini.replace(placeholder, "sqlalchemy.url = " + url.replace("%", "%%") + "\n"))
        imported, call = readme_env_lines()
        if (table, schema) != (DEFAULT_TABLE, None):
            call = call.replace("run_with(context)", f"run_with(context, table={table!r}, schema={schema!r})", 1)
        env = path / "migrations" / "env.py"
        lines: list[str] = []
        for line in env.read_text().splitlines():
            if line.strip() == "context.run_migrations()":  # offline and online
                lines.append(line[: len(line) - len(line.lstrip())] + call)
            elif line == "target_metadata = None":
                line = "from models import metadata as target_metadata"
            elif line == "from alembic import context":
                line += "\n" + imported
            elif schema is not None and line.strip() == "connection=connection, target_metadata=target_metadata":
                line += ", include_schemas=True"  # autogenerate compares dblock's schema too
            lines.append(line)
        source = "\n".join(lines) + "\n"
        assert source.count(call) == 2 and imported in source and "models import" in source
        assert (schema is None) == ("include_schemas" not in source)
        env.write_text(source)
        self.models(ITEMS)

    def models(self, *tables: str) -> None:
        (self.path / "models.py").write_text(
            "from sqlalchemy import Column, Integer, MetaData, Table, Text\n\nmetadata = MetaData()\n" + "".join(tables)
        )

    def run(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.path)}
        if self.pythonpath is not None:
            env["PYTHONPATH"] = self.pythonpath
        done = subprocess.run(command, cwd=self.path, env=env, capture_output=True, text=True, timeout=120)
        assert (done.returncode == 0) == ok, (command, done.stdout, done.stderr)
        return done

    def alembic(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("alembic", *args, ok=ok)

    def dblock(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        where = ["--table", self.table] + ([] if self.schema is None else ["--schema", self.schema])
        return self.run("dblock", "--url", self.url, *args, *where, ok=ok)

    def revision(self, message: str) -> tuple[str, str]:
        """`alembic revision --autogenerate`: the new file's revision id and text, checked to be in the app's versions."""
        before = set((self.path / "migrations" / "versions").glob("*.py"))
        done = self.alembic("revision", "--autogenerate", "-m", message)
        (made,) = set((self.path / "migrations" / "versions").glob("*.py")) - before
        assert str(made) in done.stdout, done.stdout
        source = made.read_text()
        (revision,) = re.findall(r"^revision(?::[^=]*)? = '(\w+)'$", source, re.M)
        upgrade = source.split("def downgrade", 1)[0]
        ours = (self.table, fences_table_name(self.table), version_table_name(self.table), f"{self.table}_waiters")
        assert "drop_" not in upgrade and not any(f"'{name}'" in source for name in ours), source  # not the app's
        return revision, source

    def query(self, sql: str) -> list[tuple]:
        engine = create_engine(self.url)
        try:
            with engine.begin() as conn:
                result = conn.execute(text(sql))
                return [tuple(row) for row in result] if result.returns_rows else []
        finally:
            engine.dispose()

    def versions(self, name: str = "alembic_version") -> set[str] | None:
        """What a version table records (dblock's lives in dblock's schema); None if it does not exist."""
        schema = self.schema if name != "alembic_version" else None
        engine = create_engine(self.url)
        try:
            if not inspect(engine).has_table(name, schema=schema):
                return None
        finally:
            engine.dispose()
        qualified = f"{schema}.{name}" if schema else name
        return {row[0] for row in self.query(f"SELECT version_num FROM {qualified}")}

    def dblock_versions(self) -> set[str] | None:
        return self.versions(version_table_name(self.table))

    def tables(self) -> set[str]:
        engine = create_engine(self.url)
        try:
            return set(inspect(engine).get_table_names()) | set(inspect(engine).get_table_names(schema=self.schema))
        finally:
            engine.dispose()

    def dblock_catalog(self) -> list[tuple]:
        """dblock's objects (tables, columns, sequences, functions) and its version table's rows."""
        prefixes = (self.table, fences_table_name(self.table), version_table_name(self.table))
        if self.url.startswith("postgresql"):
            rows = self.query(
                "SELECT c.relkind::text, n.nspname::text, c.relname::text, a.attname::text FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace LEFT JOIN pg_attribute a ON a.attrelid = c.oid "
                "AND a.attnum > 0 AND NOT a.attisdropped WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') "
                "AND n.nspname NOT LIKE 'pg_toast%' UNION ALL SELECT 'function', n.nspname::text, p.proname::text, "
                "md5(p.prosrc) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2, 3, 4"
            )
        else:
            rows = self.query("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY 1, 2, 3")
        ours = [r for r in rows if str(r[2]).startswith(prefixes)]
        return ours + sorted((v,) for v in self.dblock_versions() or ())

    def site_packages(self) -> list[Path]:
        """Every file of the dblock that the app imports: where no app revision may ever land."""
        where = self.run("python", "-c", "import dblock, os; print(os.path.dirname(dblock.__file__))").stdout.strip()
        return sorted(p for p in Path(where).rglob("*") if "__pycache__" not in p.parts)

    def newer_dblock(self, tmp_path: Path) -> Path:
        """From now on, the app runs a newer dblock: this one, copied, with one more revision (dblock_9001)."""
        installed = Path(self.run("python", "-c", "import dblock; print(dblock.__file__)").stdout.strip()).parent
        copy = tmp_path / "newer"
        shutil.copytree(installed, copy / "dblock", ignore=shutil.ignore_patterns("__pycache__"))
        (copy / "dblock" / "_alembic" / "versions" / "9001_note.py").write_text(NEWER.format(head=DBLOCK_HEAD))
        self.pythonpath = str(copy)
        assert self.run("python", "-c", "import dblock.migrate as m; print(m.migrations_dir())").stdout.startswith(
            str(copy)
        )
        return copy / "dblock"

@pytest.fixture(params=["postgresql", "sqlite"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of the app's empty database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.db'}"
    else:
        with scratch_database(request.getfixturevalue("pg_url"), "alembic_app_") as url:
            yield url


@pytest.fixture
def pg_database(pg_url: str) -> Iterator[str]:
    with scratch_database(pg_url, "alembic_app_") as url:
        yield url


def make_app(tmp_path: Path, wheel_venv: Path, url: str, *, custom: bool) -> App:
    """On PostgreSQL with ``custom``, dblock's tables under another name in a schema of their own."""
    table, schema = ("app_locks", "ops") if custom and url.startswith("postgresql") else (DEFAULT_TABLE, None)
    return App(tmp_path / "app", wheel_venv, url, table, schema)


def test_upgrade_head_runs_dblock_beside_the_app_with_one_head(database: str, wheel_venv: Path, tmp_path: Path) -> None:
    app = make_app(tmp_path, wheel_venv, database, custom=True)
    package = app.site_packages()
    app.alembic("upgrade", "head")  # the app has no revision yet: dblock's tables, in its own version table
    assert app.dblock_versions() == {DBLOCK_HEAD} and app.versions() == set()
    assert {app.table, fences_table_name(app.table)} <= app.tables()

    first, source = app.revision("items")  # its first revision: in the app's versions, on nothing of dblock's
    assert "op.create_table('items'" in source and down_revision(source) == "None"
    app.alembic("upgrade", "head")
    assert app.versions() == {first} and "items" in app.tables()
    assert "No new upgrade operations detected" in app.alembic("check").stdout
    app.models(ITEMS, TAGS)
    second, source = app.revision("tags")
    assert down_revision(source) == repr(first)
    app.alembic("upgrade", "head")
    assert app.versions() == {second} and app.alembic("heads").stdout.split() == [second, "(head)"]
    assert app.site_packages() == package  # nothing of the app's landed in the installed dblock
    assert lock_once(app.url, app.table, app.schema) >= 1

    dblock = app.dblock_catalog()
    app.alembic("downgrade", "-1")
    assert app.versions() == {first} and "tags" not in app.tables()
    app.alembic("downgrade", "base")
    assert app.versions() == set() and not {"items", "tags"} & app.tables()
    assert app.dblock_catalog() == dblock  # the app's downgrades left dblock's tables alone
    app.alembic("upgrade", "head")
    assert app.versions() == {second} and app.dblock_catalog() == dblock

    gone = app.dblock("migrate", "--downgrade", "base")  # the reverse: dblock's tables go, the app's stay
    assert "removed dblock's tables" in gone.stderr
    assert app.dblock_catalog() == [] and {"items", "tags"} <= app.tables() and app.versions() == {second}
    app.alembic("upgrade", "head")  # the app at its head: dblock's tables come back all the same
    assert app.dblock_catalog() == dblock and app.versions() == {second}


def test_a_newer_dblock_comes_with_the_apps_upgrade_head(database: str, wheel_venv: Path, tmp_path: Path) -> None:
    app = make_app(tmp_path, wheel_venv, database, custom=False)
    first, _ = app.revision("items")
    app.alembic("upgrade", "head")
    newer = app.newer_dblock(tmp_path)
    package = sorted(newer.rglob("*.py"))
    dblock = app.dblock_catalog()
    # Only an upgrade brings dblock's new revision: not current, check, stamp, nor a downgrade.
    for command in (["current"], ["check"], ["stamp", first], ["downgrade", "base"]):
        app.alembic(*command)
        assert app.dblock_catalog() == dblock and app.dblock_versions() == {DBLOCK_HEAD}, command
    assert app.versions() == set()
    app.alembic("upgrade", "head")
    assert app.dblock_versions() == {"dblock_9001"} and app.versions() == {first}
    engine = create_engine(app.url)
    assert "note" in {c["name"] for c in inspect(engine).get_columns(fences_table_name(app.table))}
    engine.dispose()
    app.alembic("upgrade", "head")  # the app has nothing to do, nor has dblock
    assert app.alembic("heads").stdout.split() == [first, "(head)"]
    app.models(ITEMS, TAGS)
    second, _ = app.revision("tags")  # still nothing of dblock's to drop, nothing landing in dblock
    assert sorted(newer.rglob("*.py")) == package
    app.alembic("upgrade", "head")
    assert app.versions() == {second} and app.dblock_versions() == {"dblock_9001"}
    app.dblock("migrate", "--downgrade", DBLOCK_HEAD)  # the newer dblock takes its own revision back
    assert app.dblock_versions() == {DBLOCK_HEAD} and app.versions() == {second}
    assert app.dblock_catalog() == dblock


def test_dblocks_migrations_share_the_apps_transaction(pg_database: str, wheel_venv: Path, tmp_path: Path) -> None:
    """A failing app migration takes dblock's tables back with it (PostgreSQL: one transaction, DDL included)."""
    app = make_app(tmp_path, wheel_venv, pg_database, custom=False)
    done = app.alembic("revision", "-m", "boom")
    (path,) = re.findall(r"Generating (\S+\.py)", done.stdout)
    source = Path(path).read_text()
    assert source.count("    pass\n") == 2
    Path(path).write_text(source.replace("    pass\n", '    op.execute("SELECT 1 / 0")\n', 1))
    failed = app.alembic("upgrade", "head", ok=False)
    assert "division by zero" in failed.stderr
    assert app.tables() == set()  # dblock's tables came and went with the app's transaction
    Path(path).write_text(source)
    app.alembic("upgrade", "head")
    assert app.dblock_versions() == {DBLOCK_HEAD} and app.versions() is not None


def test_offline_scripts_hold_dblocks_ddl_in_the_apps_transaction(
    pg_database: str, wheel_venv: Path, tmp_path: Path
) -> None:
    app = make_app(tmp_path, wheel_venv, pg_database, custom=True)
    first, _ = app.revision("items")
    script = app.alembic("upgrade", "head", "--sql").stdout  # from base: dblock's tables from scratch too
    assert re.findall(r"^(BEGIN|COMMIT);$", script, re.M) == ["BEGIN", "COMMIT"], script
    assert script.index("CREATE TABLE ops.app_locks") < script.index("CREATE TABLE items")
    assert f"INSERT INTO ops.{version_table_name(app.table)}" in script
    app.query("DROP TABLE alembic_version")  # the empty one autogenerate made: the database is as new
    with psycopg.connect(libpq_dsn(pg_database), autocommit=True) as conn:
        conn.execute(script)  # as psql -f would run it
    offline = app.dblock_catalog()
    assert app.versions() == {first} and app.dblock_versions() == {DBLOCK_HEAD}
    app.query("DROP SCHEMA ops CASCADE")
    app.query("DROP TABLE items, alembic_version")
    app.alembic("upgrade", "head")  # online makes the same
    assert app.dblock_catalog() == offline and app.versions() == {first}

    # From a starting revision, dblock's part starts where -x dblock_start says.
    app.newer_dblock(tmp_path)
    refused = app.alembic("upgrade", f"{first}:head", "--sql", ok=False)
    assert "-x dblock_start=REV" in refused.stderr and "ALTER TABLE" not in refused.stdout
    bad = app.alembic("-x", "dblock_start=dblock_0000", "upgrade", f"{first}:head", "--sql", ok=False)
    assert "dblock_start must be base or one of dblock's revisions" in bad.stderr
    script = app.alembic("-x", f"dblock_start={DBLOCK_HEAD}", "upgrade", f"{first}:head", "--sql").stdout
    assert "ALTER TABLE ops.app_locks_fences ADD COLUMN note TEXT" in script
    assert "CREATE TABLE" not in script and "dblock_9001" in script


def test_an_old_branch_set_up_stops_before_it_writes(wheel_venv: Path, tmp_path: Path) -> None:
    """dblock:_migrations/versions in version_locations: every command fails, saying what to do, and writes nothing."""
    app = make_app(tmp_path, wheel_venv, f"sqlite:///{tmp_path / 'app.db'}", custom=False)
    ini = (app.path / "alembic.ini").read_text()
    assert "\npath_separator = os\n" in ini
    (app.path / "alembic.ini").write_text(
        ini.replace("\npath_separator = os\n", "\npath_separator = space\nversion_locations = "
                    "%(here)s/migrations/versions dblock:_migrations/versions\n")
    )
    package = app.site_packages()
    for command in (["revision", "-m", "first"], ["revision", "--autogenerate", "-m", "first"], ["upgrade", "head"]):
        failed = app.alembic(*command, ok=False).stdout  # where Alembic prints its FAILED line
        assert "FAILED: dblock's revisions are no longer part of your app's Alembic history" in failed
        assert "run_with(context)" in failed
    assert app.site_packages() == package and list((app.path / "migrations" / "versions").glob("*.py")) == []
    assert app.query("SELECT name FROM sqlite_master") == []  # env.py connected; nothing was created


def test_a_database_of_the_old_branch_set_up_moves_to_dblocks_own_version_table(
    database: str, wheel_venv: Path, tmp_path: Path
) -> None:
    app = make_app(tmp_path, wheel_venv, database, custom=True)
    first, _ = app.revision("items")
    app.alembic("upgrade", "head")
    dblock = app.dblock_catalog()
    version_table = version_table_name(app.table) if app.schema is None else f"{app.schema}.{version_table_name(app.table)}"

    def as_the_branch_left_it(revision: str) -> None:
        """dblock's revision recorded in the app's alembic_version, and no version table of dblock's."""
        engine = create_engine(app.url)
        if revision != DBLOCK_HEAD:
            migrate.downgrade(engine, app.table, app.schema, revision)
        engine.dispose()
        app.query(f"DROP TABLE {version_table}")
        app.query(f"INSERT INTO alembic_version VALUES ('{revision}')")
        assert app.versions() == {first, revision} and app.dblock_versions() is None

    # At dblock's head: create_schema() and `dblock migrate` recognise the tables and change nothing.
    as_the_branch_left_it(DBLOCK_HEAD)
    before = app.dblock_catalog(), app.versions()
    Locker(app.url, table=app.table, schema=app.schema).create_schema()
    app.dblock("migrate")
    assert (app.dblock_catalog(), app.versions()) == before
    # Commands other than upgrade say what to do, and change nothing.
    for command in (["current"], ["downgrade", "-1"], ["check"]):
        refused = app.alembic(*command, ok=False)
        assert "records dblock's revision" in refused.stderr and "run `alembic upgrade head` once" in refused.stderr
        assert (app.dblock_catalog(), app.versions()) == before
    app.alembic("upgrade", "head")  # moves dblock's revision to its own table
    assert app.versions() == {first} and app.dblock_catalog() == dblock

    # Behind: create_schema() and `dblock migrate` refuse, pointing to run_with; upgrade head moves and upgrades.
    as_the_branch_left_it("dblock_0003")
    before = app.dblock_catalog(), app.versions()
    with pytest.raises(DBLockError, match=r"created by your app's Alembic history.*dblock_0003.*run_with\(context\)"):
        Locker(app.url, table=app.table, schema=app.schema).create_schema()
    assert "run_with(context)" in app.dblock("migrate", ok=False).stderr
    assert (app.dblock_catalog(), app.versions()) == before
    app.alembic("upgrade", "head")
    assert app.versions() == {first} and app.dblock_catalog() == dblock

    # Merged into the app's history (no dblock revision recorded anywhere): at the head, it is recorded...
    app.query(f"DROP TABLE {version_table}")
    app.alembic("upgrade", "head")
    assert app.dblock_catalog() == dblock
    # ...and behind, where nothing says which revision the tables are at, refused with nothing changed.
    engine = create_engine(app.url)
    migrate.downgrade(engine, app.table, app.schema, "dblock_0003")
    engine.dispose()
    app.query(f"DROP TABLE {version_table}")
    before = app.dblock_catalog(), app.versions()
    refused = app.alembic("upgrade", "head", ok=False)
    assert "no dblock history made it" in refused.stderr and (app.dblock_catalog(), app.versions()) == before


def test_run_with_refuses_bad_input_before_any_sql() -> None:
    from alembic import context
    from alembic.config import Config

    with pytest.raises(TypeError, match="Alembic's context"):
        migrate.run_with(Config())
    with pytest.raises(ValueError, match="table"):
        migrate.run_with(context, table="locks; DROP TABLE items")
    with pytest.raises(ValueError, match="schema"):
        migrate.run_with(context, schema="")
    cfg = migrate.alembic_config(DEFAULT_TABLE, None)
    with pytest.raises(CommandError, match=r"after context.configure\(\.\.\.\)"):
        migrate.run_with(EnvironmentContext(cfg, ScriptDirectory.from_config(cfg)))
