"""The project's user-facing error type, in a module of its own so every layer can import it."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent; the message says which and why."""
