#!/bin/sh
# PgBouncer for tests/test_pgbouncer.py, which skips without it. Installs
# Debian's package when run as root on a machine with apt-get (as CI is);
# anywhere else it says what to do and carries on. Always exits 0.
# (On a Debian machine running systemd the package also starts its own
# pgbouncer service, on 127.0.0.1:6432; the tests start their own.)
if command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; then
    exit 0
fi
hint="pgbouncer not installed (apt-get install pgbouncer): tests/test_pgbouncer.py will skip"
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "$hint" >&2
    exit 0
fi
echo "installing pgbouncer from Debian's packages, for tests/test_pgbouncer.py" >&2
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing or stale (a fresh machine): update, then try again.
if ! apt-get install -y -q pgbouncer >"$log" 2>&1; then
    apt-get update -q >>"$log" 2>&1
    if ! apt-get install -y -q pgbouncer >>"$log" 2>&1; then
        tail -n 5 "$log" >&2
        echo "$hint" >&2
    fi
fi
rm -f "$log"
exit 0
