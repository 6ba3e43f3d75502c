#!/bin/sh
# Spin, the model checker, for tests/test_model.py, which skips without it (see
# install-debian-package.sh). It compiles the models with the machine's C compiler.
exec sh "$(dirname "$0")/install-debian-package.sh" spin spin tests/test_model.py
