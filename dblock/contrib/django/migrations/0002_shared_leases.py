"""dblock's tables at its Alembic revision dblock_0007: shared leases (read locks and
semaphores), a holders table and, on PostgreSQL, its three functions."""

from django.db import migrations

from dblock.contrib.django.operations import MigrateDBLock


class Migration(migrations.Migration):
    # dblock's migrations run on connections of their own (serialised by their own lock), not in Django's transaction.
    atomic = False
    dependencies = [("dblock", "0001_initial")]
    operations = [MigrateDBLock(revision="dblock_0007", previous="dblock_0006")]
