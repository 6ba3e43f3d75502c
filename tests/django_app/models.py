from django.db import models

from dblock.contrib.django import FenceTokenField


class Owner(models.Model):
    name = models.CharField(max_length=50)


class Account(models.Model):
    owner = models.ForeignKey(Owner, null=True, on_delete=models.CASCADE)
    balance = models.IntegerField(default=0)
    fence_token = FenceTokenField()


class Savings(Account):
    """A multi-table child: its fence column lives in Account's table."""

    rate = models.IntegerField(default=0)


class Ledger(models.Model):
    """A fence under another name, and columns that cannot be fences."""

    entry = models.TextField(default="")
    epoch = FenceTokenField()
    loose = models.BigIntegerField(null=True)
    small = models.IntegerField(default=0)
