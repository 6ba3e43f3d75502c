#!/bin/sh
# MariaDB for the tests that run dblock on it (the backend contract, both faces, the guarantees'
# race, fencing, shared leases), which start throwaway servers of their own and skip without
# one, and Galera (with rsync, its state transfer) for the Galera cluster tests (see
# install-debian-package.sh). (Debian's mariadb-server also starts its own service on 3306;
# the tests start their own.)
here=$(dirname "$0")
sh "$here/install-debian-package.sh" mariadb-server /usr/sbin/mariadbd "dblock's MariaDB tests"
sh "$here/install-debian-package.sh" galera-4 /usr/lib/galera/libgalera_smm.so tests/test_galera.py
sh "$here/install-debian-package.sh" rsync rsync tests/test_galera.py
exit 0
