"""Secrets masked by where they stand in a URL, a DSN or a command line, never by their text."""

from __future__ import annotations

import socket

import pytest
from sqlalchemy.engine import make_url

from dblock import DatabaseUnavailable, Locker
from dblock._redact import display_url, redact, redact_argument
from dblock.locker import describe_process


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # in the userinfo, percent-encoded as SQLAlchemy wants it
        ("postgresql+psycopg://app:Sup3r%3As%40cret%2F%25@db/app", "postgresql+psycopg://app:***@db/app"),
        # in the query, any case, also sslpassword; passfile names a file, not a secret
        ("postgresql://app@db/app?password=s3cret", "postgresql://app@db/app?password=***"),
        ("postgresql://app@db/app?PASSWORD=s3cret&sslmode=require", "postgresql://app@db/app?PASSWORD=***&sslmode=require"),
        ("postgresql://app@db/app?sslpassword=k3y&passfile=/home/app/.pgpass",
         "postgresql://app@db/app?sslpassword=***&passfile=%2Fhome%2Fapp%2F.pgpass"),
        # both, the query's value percent-encoded (it holds a & and a space)
        ("postgresql://app:one@db/app?password=a%26b+c&application_name=x",
         "postgresql://app:***@db/app?password=***&application_name=x"),
        # the password is also the user, the host, the database and part of other values: only it goes
        ("postgresql://app:app@app/app?password=app&application_name=app-nightly",
         "postgresql://app:***@app/app?password=***&application_name=app-nightly"),
        # one letter: the rest stays readable
        ("postgresql://a:a@localhost:5432/data?password=a", "postgresql://a:***@localhost:5432/data?password=***"),
        # an '@' in the password, unencoded (SQLAlchemy would end it at the first '@'): all of it masked
        ("postgresql://app:p@ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:S3cr@tPass!@127.0.0.1/app", "postgresql://app:***@127.0.0.1/app"),
        # nothing secret: shown as it is
        ("postgresql+psycopg://app@db:5432/app?host=/run/postgresql", "postgresql+psycopg://app@db:5432/app?host=%2Frun%2Fpostgresql"),
        ("sqlite:////var/lib/app/locks.db", "sqlite:////var/lib/app/locks.db"),
        # libpq's keyword form: plain, quoted with escapes, spaces around '='
        ("host=db password=s3cret dbname=app", "host=db password=*** dbname=app"),
        ("host=db password='a b\\' c' dbname=app", "host=db password=*** dbname=app"),
        ("host=db password = s3cret dbname=app", "host=db password = *** dbname=app"),
        ("host=db sslpassword='' dbname=app", "host=db sslpassword=*** dbname=app"),
        ("password=app dbname=app-nightly", "password=*** dbname=app-nightly"),
        # not parseable by SQLAlchemy (bad port): masked by the same structure all the same
        ("postgresql://app:s3cret@db:port/app?password=s3cret", "postgresql://app:***@db:port/app?password=***"),
    ],
)
def test_display_url(url: str, shown: str) -> None:
    assert display_url(url) == shown
    if "://" in url and "port" not in url and url.count("@") < 2:
        assert display_url(make_url(url)) == shown  # a URL object (as an Engine has) renders the same


@pytest.mark.parametrize("url", ["postgresql://app:S3cr@tPass!@127.0.0.1/app", "sqlite://u:p@ss@h/x.db",
                                 "postgresql+psycopg2://app:a@b@db:5432/app?sslmode=require"])
def test_a_raw_at_in_a_password_is_refused_with_the_way_to_write_it(url: str) -> None:
    with pytest.raises(ValueError, match="percent-encoded, '@' as %40") as caught:
        Locker(url)
    assert "S3cr" not in str(caught.value) and "tPass" not in str(caught.value) and "ss@" not in str(caught.value)
    # Encoded, the same password is taken (and never shown).
    encoded = Locker("postgresql://app:S3cr%40tPass!@127.0.0.1/app")
    assert encoded.engine.url.password == "S3cr@tPass!" and "S3cr" not in repr(encoded)
    encoded.close()


def test_a_password_that_is_everywhere_else_too() -> None:
    # The old masking replaced the password's text: 'a' made this "p***ssword=***" at best.
    url = "postgresql://a:a@a/a?password=a&application_name=a"
    assert display_url(url) == "postgresql://a:***@a/a?password=***&application_name=a"


def test_redact_free_text() -> None:
    text = (
        'connection to "postgresql://app:s3cret@db/app?x=1&password=p2" failed; '
        "dsn: host=db password='q q' user=app; mypassword=x nopasswordhere passfile=/x app-nightly"
    )
    assert redact(text) == (
        'connection to "postgresql://app:***@db/app?x=1&password=***" failed; '
        "dsn: host=db password=*** user=app; mypassword=*** nopasswordhere passfile=/x app-nightly"
    )
    # Words about passwords are not secrets.
    message = 'FATAL:  password authentication failed for user "app"'
    assert redact(message) == message
    assert redact("lock 'app-nightly' is busy") == "lock 'app-nightly' is busy"
    # A raw '@' in a password: masked to the host, and a path's or a later word's '@' left alone.
    assert redact("cannot reach postgresql://app:S3cr@tPass!@db/app@x for mail@example.org") == (
        "cannot reach postgresql://app:***@db/app@x for mail@example.org"
    )


@pytest.mark.parametrize(
    ("word", "shown"),
    [
        ("PGPASSWORD=a b", "PGPASSWORD=***"),
        ("--db-password=x y", "--db-password=***"),
        ("postgresql://app:a b@db/app?password=c d&x=1", "postgresql://app:***@db/app?password=***&x=1"),
        ("--url=postgresql://app:S3cr@t P@ss@db/app", "--url=postgresql://app:***@db/app"),
        ("host=db password='x y' dbname=app", "host=db password=*** dbname=app"),
        ("app-nightly", "app-nightly"),
        ("--password", "--password"),
    ],
)
def test_redact_argument(word: str, shown: str) -> None:
    """One argv word: spaces are part of its values."""
    assert redact_argument(word) == shown


def test_process_labels_mask_every_form() -> None:
    label = describe_process(
        ["/usr/bin/report", "postgresql://app@db/app?password=app", "--url=postgresql://app:app@db/app",
         "PGPASSWORD=app", "host=db password=app", "app-nightly"]
    )
    assert label.endswith(
        " report 'postgresql://app@db/app?password=***' --url=postgresql://app:***@db/app "
        "PGPASSWORD=*** 'host=db password=***' app-nightly"
    ), label


def test_repr_and_connection_errors_do_not_show_the_password() -> None:
    with socket.socket() as s:  # a port nothing listens on: connecting fails
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql+psycopg://app:hunter2@127.0.0.1:{port}/app?password=app&sslpassword=k3y"
    shown = f"postgresql+psycopg://app:***@127.0.0.1:{port}/app?password=***&sslpassword=***"
    locker = Locker(url)
    try:
        assert repr(locker) == f"<Locker {shown} table='locks'>"
        with pytest.raises(DatabaseUnavailable) as caught:
            locker.leases()
        message = str(caught.value)
        assert shown in message
        assert "hunter2" not in message and "password=app" not in message and "k3y" not in message
    finally:
        locker.close()
