"""dblock's tables at its Alembic revision dblock_0009: a hand-over reads the head of the
line through the index, not the whole line (PostgreSQL; nothing changes on SQLite)."""

from django.db import migrations

from dblock.contrib.django.operations import MigrateDBLock


class Migration(migrations.Migration):
    # dblock's migrations run on connections of their own (serialised by their own lock), not in Django's transaction.
    atomic = False
    dependencies = [("dblock", "0003_shared_queue")]
    operations = [MigrateDBLock(revision="dblock_0009", previous="dblock_0008")]
