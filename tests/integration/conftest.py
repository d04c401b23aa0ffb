"""Fixtures live in tests/conftest.py; helpers in tests/support.py."""
