#!/bin/sh
# The high-availability cluster of tests/test_ha.py (which skips without it):
# etcd from Debian's packages (etcd-server; Debian 12 has no package named etcd)
# and Patroni from PyPI, in a virtualenv of its own built from Debian's
# /usr/bin/python3 (Patroni runs as the postgres user, which cannot execute a
# python kept in root's home, as a pyenv build is). The PostgreSQL nodes use
# the machine's own PostgreSQL binaries (Debian's postgresql package).
# Installs when run as root on a machine with apt-get (as CI is); anywhere
# else it says what to do and carries on. Always exits 0.
# (The package's own etcd service is not wanted: the tests start their own
# member on a free loopback port.)
venv=${DBLOCK_HA_VENV:-/opt/dblock-ha}
hint="the HA tests (tests/test_ha.py) will skip: they need etcd (apt-get install etcd-server), PostgreSQL server binaries (apt-get install postgresql) and Patroni in $venv (run this script as root)"
have_etcd() { command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]; }
have_pg() { ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; }
have_patroni() { [ -x "$venv/bin/patroni" ]; }
if have_etcd && have_pg && have_patroni; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "$hint" >&2
    exit 0
fi
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
packages=""
have_etcd || packages="$packages etcd-server"
have_pg || packages="$packages postgresql"
/usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || packages="$packages python3-venv"
if [ -n "$packages" ]; then
    echo "installing$packages from Debian's packages, for tests/test_ha.py" >&2
    # The package lists may be missing or stale (a fresh machine): update, then try again.
    if ! apt-get install -y -q $packages >"$log" 2>&1; then
        apt-get update -q >>"$log" 2>&1
        apt-get install -y -q $packages >>"$log" 2>&1 || tail -n 5 "$log" >&2
    fi
fi
if ! have_patroni && [ -x /usr/bin/python3 ]; then
    echo "installing Patroni from PyPI into $venv, for tests/test_ha.py" >&2
    # Patroni 4 (its etcd3 client and a psycopg driver of its own); Debian's python so the
    # postgres user can run it.
    if ! { /usr/bin/python3 -m venv "$venv" &&
           "$venv/bin/pip" install -q 'patroni[etcd3,psycopg3]>=4,<5'; } >"$log" 2>&1; then
        tail -n 5 "$log" >&2
        rm -rf "$venv"
    else
        chmod -R a+rX "$venv"
    fi
fi
rm -f "$log"
if ! { have_etcd && have_pg && have_patroni; }; then
    echo "$hint" >&2
fi
exit 0
