"""Importing this module fails (the registry test checks the message)."""

raise RuntimeError("this module is broken on purpose")
