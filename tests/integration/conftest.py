"""Fixtures live in tests/conftest.py; the harness (Node, Cluster, ...) in tests/framework."""
