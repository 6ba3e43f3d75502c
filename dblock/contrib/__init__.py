"""Integrations with frameworks; each is imported only by applications that use it."""
