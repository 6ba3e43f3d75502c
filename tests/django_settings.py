"""Django settings for dblock's tests, from the environment (tests/django_support.py sets it).

DBLOCK_DJANGO_PG: a PostgreSQL URL (the "default" database); DBLOCK_DJANGO_SQLITE:
a SQLite file (the "sqlite" database). "oracle" and "memory" are databases dblock
refuses, and "mysql" one whose URL it makes without connecting; nothing connects to
them (DBLOCK_DJANGO_REFUSED=0 leaves them out, for `makemigrations`, which loads every
database's backend).
"""

import os

from sqlalchemy.engine import make_url

_pg = make_url(os.environ["DBLOCK_DJANGO_PG"])

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _pg.database,
        "USER": _pg.username or "",
        "PASSWORD": _pg.password or "",
        "HOST": _pg.query.get("host") or _pg.host or "",
        "PORT": str(_pg.port or ""),
    },
    "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["DBLOCK_DJANGO_SQLITE"]},
}
if os.environ.get("DBLOCK_DJANGO_REFUSED", "1") == "1":
    DATABASES["mysql"] = {
        "ENGINE": "django.db.backends.mysql", "NAME": "app", "USER": "app", "PASSWORD": "p@ss", "HOST": "db",
        "PORT": "3307", "OPTIONS": {"charset": "utf8mb4", "init_command": "SET sql_mode='STRICT_TRANS_TABLES'"},
    }
    DATABASES["oracle"] = {"ENGINE": "django.db.backends.oracle", "NAME": "app"}
    DATABASES["memory"] = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}

INSTALLED_APPS = ["dblock.contrib.django", "tests.django_app"]
SECRET_KEY = "dblock tests"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
