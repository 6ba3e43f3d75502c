"""dblock's tables at its Alembic revision dblock_0011: hand-offs in fewer steps, liveness in O(1)."""

from django.db import migrations

from dblock.contrib.django.operations import MigrateDBLock


class Migration(migrations.Migration):
    # dblock's migrations run on connections of their own (serialised by their own lock), not in Django's transaction.
    atomic = False
    dependencies = [("dblock", "0005_upgradeable_reads")]
    operations = [MigrateDBLock(revision="dblock_0011", previous="dblock_0010")]
