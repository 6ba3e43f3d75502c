"""Run by Django's own test runner (`manage.py test tests.django_app.runner_checks`) from tests/test_django.py:
dblock's tables are made in the test database, and dblock works there."""

from django.db import connection
from django.test import TestCase

from dblock.contrib.django import fenced_update, locker

from .models import Account


class UnderDjangosTestRunner(TestCase):
    # No close_lockers() here: the app closes its Lockers before the runner drops the test database.

    def test_dblock_locks_and_fences_in_the_test_database(self) -> None:
        name = connection.settings_dict["NAME"]
        self.assertTrue(name.startswith("test_"), name)
        self.assertEqual(locker().engine.url.database, name)
        account = Account.objects.create(balance=1)
        with locker().lock("runner") as lease:
            self.assertEqual(fenced_update(Account.objects.filter(pk=account.pk), lease, balance=2), 1)
        self.assertEqual(Account.objects.get(pk=account.pk).fence_token, lease.token)
