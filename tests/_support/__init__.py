"""Helpers shared by the test modules and the worker scripts pytest imports (tests/ is on sys.path
through tests/conftest.py, so `from _support.processes import ...` works from any of them)."""
