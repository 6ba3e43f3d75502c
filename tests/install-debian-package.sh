#!/bin/sh
# install-debian-package.sh PACKAGE PROGRAM TEST: installs Debian's PACKAGE, which provides
# PROGRAM (a name on PATH, or a file), for TEST, which skips without it. Installs when run as
# root on a machine with apt-get (as CI is); anywhere else it says what to do and carries on.
# Always exits 0.
package=$1 program=$2 test=$3
if command -v "$program" >/dev/null 2>&1 || [ -e "$program" ]; then
    exit 0
fi
hint="$package not installed (apt-get install $package): $test will skip"
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "$hint" >&2
    exit 0
fi
echo "installing $package from Debian's packages, for $test" >&2
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing or stale (a fresh machine): update, then try again.
if ! apt-get install -y -q "$package" >"$log" 2>&1; then
    apt-get update -q >>"$log" 2>&1
    if ! apt-get install -y -q "$package" >>"$log" 2>&1; then
        tail -n 5 "$log" >&2
        echo "$hint" >&2
    fi
fi
rm -f "$log"
exit 0
