"""The project's user-facing error type, in a module of its own so every layer can import it."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent; the message says which and why."""


class TrainingStopped(RuntimeError):
    """The run stopped itself to protect what it has written (a diverged update, every reward
    failing); the message says why and what was kept. `megatron-rl` prints it and exits 1."""
