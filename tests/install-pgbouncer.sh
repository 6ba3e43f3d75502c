#!/bin/sh
# PgBouncer for tests/test_pgbouncer.py, which skips without it (see install-debian-package.sh).
# (On a Debian machine running systemd the package also starts its own pgbouncer service, on
# 127.0.0.1:6432; the tests start their own.)
exec sh "$(dirname "$0")/install-debian-package.sh" pgbouncer /usr/sbin/pgbouncer tests/test_pgbouncer.py
