"""``manage.py dblock run|status|release ...``: dblock's command line on a database of settings.DATABASES.

The arguments, options, output and exit codes are the ``dblock`` command's
(``dblock --help``), except for where the database comes from: ``--database
ALIAS`` (default ``default``) instead of ``--url`` or ``$DBLOCK_URL``. Tables
come from ``manage.py migrate``, so ``dblock migrate`` is not offered here.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS

EXIT_USAGE = 2  # as the dblock command's: bad arguments, nothing touched
# Options of manage.py itself, applied before the command runs; dblock does not know them.
_MANAGE_VALUED = ("--settings", "--pythonpath")
_MANAGE_FLAGS = ("--traceback", "--no-color", "--force-color", "--skip-checks")
_DBLOCK_VALUED = ("--table", "--schema")  # dblock's options that take a value, before the command name


class Command(BaseCommand):
    help = (
        "dblock's command line (run, status, release) on a database of settings.DATABASES: "
        "`manage.py dblock status`, `manage.py dblock run NAME --database other -- CMD ARGS`. "
        "See `dblock --help`; the exit codes are the same."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--database", default=DEFAULT_DB_ALIAS, help="alias in settings.DATABASES (default: default)"
        )
        parser.add_argument(
            "args", nargs=argparse.REMAINDER, metavar="COMMAND", help="dblock's command and its arguments"
        )

    def run_from_argv(self, argv: list[str]) -> None:
        # The dblock command's parser reads the arguments, not Django's: the
        # process exits with its code (75 busy, 76 lease lost, CMD's status...).
        program = os.path.basename(argv[0])
        program = "python -m django" if program == "__main__.py" else program  # as Django names it
        sys.exit(run(argv[2:], prog=f"{program} {argv[1]}"))

    def handle(self, *args: str, database: str = DEFAULT_DB_ALIAS, **options: Any) -> None:
        # call_command("dblock", "status", database="other")
        code = run(["--database", database, *args])
        if code:
            raise CommandError(f"dblock exited with status {code}", returncode=code)


def run(argv: list[str], prog: str = "manage.py dblock") -> int:
    """Run dblock's command line with the database of ``--database ALIAS``; its exit code."""
    from dblock import cli

    at = argv.index("--") if "--" in argv else len(argv)
    before, after = argv[:at], argv[at:]
    database = DEFAULT_DB_ALIAS
    rest: list[str] = []
    words = iter(before)
    for word in words:
        if word == "--database":
            database = next(words, "")
        elif word.startswith("--database="):
            database = word.split("=", 1)[1]
        elif word in _MANAGE_VALUED:
            next(words, None)
        elif not word.startswith(tuple(f"{o}=" for o in _MANAGE_VALUED)) and word not in _MANAGE_FLAGS:
            rest.append(word)
    if "-h" in rest or "--help" in rest:
        # dblock's help as it applies here: --database ALIAS, no --url, no migrate.
        try:
            cli.build_parser(prog, django=True).parse_args([*rest, "--database", database])
        except SystemExit as done:
            return int(done.code or 0)
    if any(word == "--url" or word.startswith("--url=") for word in rest):
        return _usage(prog, "the database comes from settings.DATABASES here: use --database ALIAS, not --url")
    if _command(rest) == "migrate":
        return _usage(
            prog, "dblock's tables are made by Django's migrations here: run `manage.py migrate dblock` "
            "(`manage.py sqlmigrate dblock 0001` prints the DDL)"
        )
    if not database:
        return _usage(prog, "--database needs an alias of settings.DATABASES")
    try:
        from dblock.contrib.django.database import database_url

        url = database_url(database)
    except (TypeError, ValueError) as exc:
        return _usage(prog, str(exc))
    return cli.main(["--url", url.render_as_string(hide_password=False), *rest, *after])


def _command(words: list[str]) -> str | None:
    """The command name among dblock's arguments before ``--``: the first word that is no option or option value."""
    it = iter(words)
    for word in it:
        if word in _DBLOCK_VALUED:
            next(it, None)
        elif not word.startswith("-"):
            return word
    return None


def _usage(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE
