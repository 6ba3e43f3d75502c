"""dblock's tables at its Alembic revision dblock_0008: readers and semaphore waiters wait
in the fair queue, in one line with writers (PostgreSQL; nothing changes on SQLite)."""

from django.db import migrations

from dblock.contrib.django.operations import MigrateDBLock


class Migration(migrations.Migration):
    # dblock's migrations run on connections of their own (serialised by their own lock), not in Django's transaction.
    atomic = False
    dependencies = [("dblock", "0002_shared_leases")]
    operations = [MigrateDBLock(revision="dblock_0008", previous="dblock_0007")]
