"""dblock's tables at its Alembic revision dblock_0006: the lock table, its fences table and,
on PostgreSQL, the token sequence and the fair queue (tables and functions)."""

from django.db import migrations

from dblock.contrib.django.operations import MigrateDBLock


class Migration(migrations.Migration):
    # dblock's migrations run on connections of their own (serialised by their own lock), not in Django's transaction.
    atomic = False
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [MigrateDBLock(revision="dblock_0006", previous=None)]
