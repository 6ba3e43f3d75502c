#!/bin/sh
# libfaketime, for tests/test_clock.py, which runs a PostgreSQL of its own with its clock run
# fast and stepped, and skips without it (see install-debian-package.sh). Debian's faketime
# command brings the preload library (libfaketime) with it.
exec sh "$(dirname "$0")/install-debian-package.sh" faketime faketime tests/test_clock.py
