"""dblock's tables at its Alembic revision dblock_0013: a hand-off in fewer steps on the server."""

from django.db import migrations

from dblock.contrib.django.operations import MigrateDBLock


class Migration(migrations.Migration):
    # dblock's migrations run on connections of their own (serialised by their own lock), not in Django's transaction.
    atomic = False
    dependencies = [("dblock", "0007_lean_release")]
    operations = [MigrateDBLock(revision="dblock_0013", previous="dblock_0012")]
