"""The project's user-facing error type, in a module of its own so every layer can import it."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent; the message says which and why."""


class TrainingStopped(RuntimeError):
    """The run stopped itself to protect what it has written (a diverged update, every reward
    failing); the message says why and what was kept. `megatron-rl` prints it and exits 1."""


def raised_at(exc: BaseException) -> str:
    """' (at FILE:LINE)': where `exc` was raised, the innermost frame of its traceback (the user's
    own code, for an error in a function we called); '' when it has no traceback."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
