"""dblock's tables at its Alembic revision dblock_0012: a release and an acquire at the cost of their common case."""

from django.db import migrations

from dblock.contrib.django.operations import MigrateDBLock


class Migration(migrations.Migration):
    # dblock's migrations run on connections of their own (serialised by their own lock), not in Django's transaction.
    atomic = False
    dependencies = [("dblock", "0006_quick_handoff")]
    operations = [MigrateDBLock(revision="dblock_0012", previous="dblock_0011")]
