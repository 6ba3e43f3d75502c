"""dblock's tables at its Alembic revision dblock_0010: the upgradeable read lock."""

from django.db import migrations

from dblock.contrib.django.operations import MigrateDBLock


class Migration(migrations.Migration):
    # dblock's migrations run on connections of their own (serialised by their own lock), not in Django's transaction.
    atomic = False
    dependencies = [("dblock", "0004_walk_by_index")]
    operations = [MigrateDBLock(revision="dblock_0010", previous="dblock_0009")]
