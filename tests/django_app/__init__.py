"""A Django app for dblock's tests: models with a fence column (tests/test_django.py)."""
