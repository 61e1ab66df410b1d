"""Example environments to copy (docs/agents.md)."""
