"""Maintainers' scripts, run from the checkout (``python tools/<script>.py``).

A package so that the tests import them and share their code rather than copy it.
"""
