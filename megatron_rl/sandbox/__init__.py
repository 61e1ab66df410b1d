"""Sandboxed execution of model-written code (runner.py: the host side; launcher.py: the jail)."""

from megatron_rl.sandbox.runner import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable, namespaces_available

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "namespaces_available"]
