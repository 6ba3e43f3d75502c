"""Database URLs, DSNs and command lines made fit to print: secrets masked by structure.

A secret is found by where it stands (the password of a URL's userinfo, the value
of a ``password=`` key), never by searching for its text: a password ``app`` must
not turn a lock named ``app-nightly`` into ``***-nightly``, and a one-letter
password must not shred every message.
"""

from __future__ import annotations

import re
import shlex
from typing import Sequence
from urllib.parse import quote_plus

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

MASK = "***"

# scheme://user:SECRET@ ; the user up to the first ':', the password up to the last '@'
# before the host: SQLAlchemy ends a password at its first '@', so a raw '@' in it
# would leave the rest in the "host" (dblock refuses such a URL: ``check_userinfo``),
# and masking to the last '@' keeps all of it out of a message all the same. In free
# text a space ends the URL; in one argv word it does not.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s:/@]*:)(?:[^\s@/]*@)+")
_USERINFO_WORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^:/@]*:)(?:[^@/]*@)+")
# ?password=SECRET or &sslpassword=SECRET in a URL's query: the value ends at '&' or '#'
# (in free text also at a space or a quote, which a URL would have percent-encoded).
_QUERY = re.compile(r"""(?i)([?&][\w.-]*password=)[^&#\s"'<>]*""")
_QUERY_WORD = re.compile(r"(?i)([?&][\w.-]*password=)[^&#]*")
# libpq's keyword form, host=x password=SECRET or password = 'a \' b': a value is
# quoted (with backslash escapes) or runs to the next space. The key must start a
# word, so a URL's ?password= (above) and a key like 'nopasswordx' are not taken.
_KEYWORD = re.compile(r"""(?i)(?<![\w.%?&-])([\w.-]*password\s*=\s*)('(?:[^'\\]|\\.)*'?|(?:[^\s\\]|\\.)*)""")
# A whole argv word that assigns a password: PGPASSWORD=a b, --db-password=x.
_ASSIGNMENT = re.compile(r"(?is)^([\w.-]*password=).+")


def is_secret(key: str) -> bool:
    """A connection parameter whose value is a secret: ``password``, ``sslpassword`` (any case)."""
    return key.lower().endswith("password")


def display_url(url: str | URL) -> str:
    """``url`` (a SQLAlchemy URL, a URL string or a libpq DSN) as it may be printed.

    The userinfo password becomes ``***``, and so does every ``password``-like query
    parameter or DSN keyword; everything else is shown as it is.
    """
    if isinstance(url, URL):
        parsed = url
    elif "://" not in url:
        return redact(url)  # a libpq DSN (host=... password=...), or not a URL at all
    elif raw_ats(url) > 1:
        return redact_argument(url)  # SQLAlchemy would read part of the password as the host
    else:
        try:
            parsed = make_url(url)
        except (ArgumentError, ValueError):  # unparseable: mask what looks like a secret all the same
            return redact_argument(url)
    shown = parsed.set(query={}).render_as_string(hide_password=True)
    pairs = []
    for key, value in parsed.query.items():
        # Rendered here, not by SQLAlchemy: it would percent-encode the mask and sort the keys.
        for one in (value,) if isinstance(value, str) else value:
            pairs.append(f"{quote_plus(key)}={MASK if is_secret(key) else quote_plus(one)}")
    return f"{shown}?{'&'.join(pairs)}" if pairs else shown


def raw_ats(url: str) -> int:
    """How many '@' stand between a URL's ``://`` and its host's end (one at most, in a URL SQLAlchemy
    reads as meant: a password's own '@' must be percent-encoded as %40)."""
    authority = url.partition("://")[2].split("/", 1)[0].split("?", 1)[0]
    return authority.count("@")


def check_userinfo(url: str) -> None:
    """Refuse a URL string whose password holds a raw '@' (SQLAlchemy would take the rest of the
    password for the host), saying how to write it; the message shows no part of the URL."""
    if raw_ats(url) > 1:
        raise ValueError(
            "the URL has more than one '@' before its host: a password holding '@' (or ':', '/', '?', '#', '%')"
            " must be percent-encoded, '@' as %40 (urllib.parse.quote(password, safe=''))"
        )


def redact(text: str) -> str:
    """Free text (a driver's message, a log line) with the secrets of any URL or DSN in it masked."""
    text = _USERINFO.sub(rf"\1{MASK}@", text)
    text = _QUERY.sub(rf"\1{MASK}", text)
    return _KEYWORD.sub(rf"\1{MASK}", text)


def redact_command(words: Sequence[str]) -> str:
    """A command line, quoted as `shlex.join` would, each word's secrets masked."""
    shown = []
    for word in map(redact_argument, words):
        # Quoted only if the word needs it with the mask left out: not merely for its '*'.
        plain = word.replace(MASK, "x")
        shown.append(word if shlex.quote(plain) == plain else shlex.quote(word))
    return " ".join(shown)


def redact_argument(word: str) -> str:
    """One word of a command line (spaces in it are part of its values) with its secrets masked."""
    if _ASSIGNMENT.match(word):
        return _ASSIGNMENT.sub(rf"\1{MASK}", word)
    word = _USERINFO_WORD.sub(rf"\1{MASK}@", word)
    word = _QUERY_WORD.sub(rf"\1{MASK}", word)
    return _KEYWORD.sub(rf"\1{MASK}", word)
