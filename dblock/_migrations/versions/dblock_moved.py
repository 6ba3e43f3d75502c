"""What an app finds where dblock's revisions used to be: a clear error, and no place for its own.

dblock's wheel used to carry its revisions in ``dblock/_migrations/versions``, and
an older dblock's instructions let an app list ``dblock:_migrations/versions`` in its
``version_locations``, making them a branch of the app's own history. That gave the
app two heads, and in an app without revisions of its own, ``alembic revision``
wrote the app's first revision in here, inside the installed package, where the
next reinstall lost it. The revisions now live in ``dblock/_alembic`` and run with
the app's through ``dblock.migrate.run_with(context)``. Alembic loads every ``.py``
file of a version location before any command, so this one stops every command of an
app still set up the old way, before it writes anything, saying what to do instead.
"""

from alembic.util import CommandError

raise CommandError(
    "dblock's revisions are no longer part of your app's Alembic history: remove "
    "'dblock:_migrations/versions' from version_locations in your alembic.ini, and call "
    "dblock.migrate.run_with(context) in your env.py instead; your next `alembic upgrade head` "
    "moves dblock's revision from your alembic_version into its own table "
    '(https://dblock.readthedocs.io/en/latest/alembic/#adding-dblock-to-an-existing-app)'
)
