"""The app for ``INSTALLED_APPS``: ``"dblock.contrib.django"``, label ``dblock``."""

from __future__ import annotations

from django.apps import AppConfig


class DBLockConfig(AppConfig):
    name = "dblock.contrib.django"
    label = "dblock"  # `manage.py migrate dblock`, `manage.py dblock status`
    verbose_name = "dblock"
