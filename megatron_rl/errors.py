"""The project's user-facing error type, in a module of its own so every layer can import it,
and the small helpers its messages share (where an exception was raised, why a path is no file)."""


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


def not_a_file(path) -> str | None:
    """Why `path` cannot be read as a file, or None when it can: it does not exist, is a
    directory, or is something else that exists (a FIFO, a device, a socket: read, it would
    block or never end). Decided without opening it."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    return "is not a regular file (a FIFO, device or socket)"


def nested_deeper(value, limit: int) -> bool:
    """Whether `value` (parsed JSON) nests arrays / objects more than `limit` levels deep, walked
    iteratively: a hostile body must be refused by name before anything recurses into it
    (copying, pickling, printing it hit Python's recursion limit)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
