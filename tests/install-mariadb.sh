#!/bin/sh
# MariaDB for the tests that run dblock on it (the backend contract, both faces, the guarantees'
# race, fencing, shared leases), which start throwaway servers of their own and skip without
# one. Installs Debian's mariadb-server (and galera-4, for the Galera cluster tests) when run as
# root on a machine with apt-get (as CI is); anywhere else it says what to do and carries on.
# Always exits 0. (Debian's package also starts its own service on 3306; the tests start their own.)
if { command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ]; } && [ -e /usr/lib/galera/libgalera_smm.so ] && command -v rsync >/dev/null 2>&1; then
    exit 0
fi
hint="MariaDB, Galera or rsync not installed (apt-get install mariadb-server galera-4 rsync): their tests will skip"
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "$hint" >&2
    exit 0
fi
echo "installing mariadb-server and galera-4 from Debian's packages, for dblock's MariaDB tests" >&2
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q mariadb-server galera-4 rsync >"$log" 2>&1; then
    apt-get update -q >>"$log" 2>&1
    if ! apt-get install -y -q mariadb-server galera-4 rsync >>"$log" 2>&1; then
        tail -n 5 "$log" >&2
        echo "$hint" >&2
    fi
fi
rm -f "$log"
exit 0
