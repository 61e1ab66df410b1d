"""Resolve a reward function from its configured name.

Names:

    "math"               math_answer.math_reward; params: require_boxed, use_math_verify
    "format"             format.make_format_reward; params: pattern, value
    "synthetic"          verifies synthetic-task records by their own "task" and
                         "response_format" metadata (one reward for any mix of tasks)
    "synthetic:<task>"   the verifier of one task; params: response_format
    "code_tests"         code_tests.code_tests_reward: the response's program against the record's
                         tests, in the sandbox; params: wall_seconds, cpu_seconds, memory_mb, mode,
                         isolation, harness (a program template with {code}: the response's code
                         goes there), cache_entries
    "pkg.module:attr"    any importable callable (attr may be dotted: "module:Class.method")
    "path/to/file.py:fn" a callable defined in a Python file (relative paths are resolved
                         against the current directory when the name is resolved)

For the two user forms, ``params`` are passed to every call as keyword arguments, and the function
may be batched (lists in, a list out; detected as ``functions.is_batched`` says). Every problem is
a ``ConfigError`` naming the reward and saying what is wrong (module not found, import failed
with which exception, attribute missing, object not callable, unknown parameter), raised when
the name is resolved, i.e. when the scorer is built and not at the first sample.

A record's metadata never set a reward's params: they reach the function as keyword arguments
too (data/prompts.py), so a configured param wins over a metadata field of the same name, which
is dropped with one warning per field and process (``WithParams``). The built-ins bind every param
they have, configured or not (its default), so a data row cannot choose one either: a row field
``isolation: none`` cannot take code_tests out of the sandbox, nor ``memory_mb`` raise its limit,
nor ``require_boxed`` change how math is graded. A user function's keyword arguments that no param
sets stay open to metadata, which is how its records reach it.

Resolution is a pure function of (name, params): the scorer's worker processes call it again
with the same arguments, which is how functions that cannot be pickled (closures, lambdas)
still run there.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import sys
from pathlib import Path
from typing import Any, Mapping

from megatron_rl.errors import ConfigError, not_a_file
from megatron_rl.rewards.code_tests import MODES, check_harness, code_tests_reward
from megatron_rl.rewards.format import make_format_reward
from megatron_rl.rewards.functions import RewardFunction, is_batched
from megatron_rl.rewards.math_answer import math_fast_path, math_reward, math_verify_available, prepare_math_verify
from megatron_rl.rewards.synthetic import TASKS, make_task, verify_synthetic

__all__ = ["BUILTIN_REWARDS", "resolve_reward", "absolute_reward_name", "WithParams", "NoSandbox"]

logger = logging.getLogger(__name__)

BUILTIN_REWARDS = ("math", "format", "code_tests", "synthetic", *(f"synthetic:{task}" for task in TASKS))


def _check_params(name: str, params: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        known = ", ".join(allowed) if allowed else "none"
        raise ConfigError(f"reward {name!r}: unknown parameter {unknown[0]!r} (known: {known})")


class WithParams:
    """``fn`` called with configured keyword ``params``, which win over record metadata of the same
    name (``functools.partial`` would let the metadata win): such a field is dropped, with one
    warning per field name (per instance, so per worker process). For a batched function the three
    arguments are lists and the metadata are columns; params stay plain values."""

    def __init__(self, fn, params: Mapping[str, Any], reward: str = ""):
        self.fn, self.params, self.reward = fn, dict(params), reward
        self.warned: set[str] = set()

    def __call__(self, prompt, response, answer, **metadata: Any) -> Any:
        for key in sorted(set(metadata) & set(self.params) - self.warned):
            self.warned.add(key)
            logger.warning("reward %r: the records' metadata field %r is ignored: it names one of the reward's "
                           "params, which only rewards.terms[].params sets (here %r); rename the field in the data "
                           "(data.columns) if the reward should not see it", self.reward, key, self.params[key])
        return self.fn(prompt, response, answer, **{**metadata, **self.params})


def _keyword_defaults(fn, names: tuple[str, ...]) -> dict[str, Any]:
    """The default values of `fn`'s keyword arguments `names`: what a built-in binds for a param
    the config leaves out, so that no record can set it."""
    parameters = inspect.signature(fn).parameters
    return {name: parameters[name].default for name in names}


MATH_PARAMS = ("require_boxed", "use_math_verify")


def _math(name: str, params: Mapping[str, Any]) -> RewardFunction:
    _check_params(name, params, MATH_PARAMS)
    for key in params:
        if not isinstance(params[key], bool):
            raise ConfigError(f"reward {name!r}: {key} must be true or false, got {params[key]!r}")
    bound = {**_keyword_defaults(math_reward, MATH_PARAMS), **params}
    if not (bound["use_math_verify"] and math_verify_available()):
        # Without sympy the whole check is the pure-Python fast path: linear, safe inline.
        return RewardFunction(name, WithParams(math_reward, {**bound, "use_math_verify": False}, name),
                              inline_safe=True)
    fast = WithParams(math_fast_path, {"require_boxed": bound["require_boxed"]}, name)
    # Not inline-safe: the full check may run sympy, which can take unbounded time on adversarial
    # output (e.g. towers of exponents). The fast path decides most samples without a worker.
    return RewardFunction(name, WithParams(math_reward, bound, name), inline_safe=False,
                          fast_path=fast, prepare=prepare_math_verify)


def _format(name: str, params: Mapping[str, Any]) -> RewardFunction:
    _check_params(name, params, ("pattern", "value"))
    fn = make_format_reward(**params)
    # A configured regex can backtrack exponentially; only the boxed check is linear.
    return RewardFunction(name, fn, inline_safe=params.get("pattern") is None)


class NoSandbox(ConfigError):
    """code_tests asks for the namespace sandbox and this machine cannot build it (`why`): a caller
    whose user sets the reward's params elsewhere (an eval set's option) names its own fix."""

    def __init__(self, message: str, why: str = ""):  # why's default: an unpickled one (args hold the message)
        super().__init__(message)
        self.why = why


# code_tests' params that are the scorer's to set, every one bound (module docstring); `harness`
# is not among them: a record may carry its own when no param sets one (the param then wins).
CODE_TESTS_SETTINGS = ("wall_seconds", "cpu_seconds", "memory_mb", "mode", "isolation", "cache_entries")


def _code_tests(name: str, params: Mapping[str, Any]) -> RewardFunction:
    _check_params(name, params, (*CODE_TESTS_SETTINGS, "harness"))
    try:
        check_harness(params.get("harness"))
    except ValueError as exc:
        raise ConfigError(f"reward {name!r}: {exc}") from None
    for key in ("wall_seconds", "cpu_seconds", "memory_mb"):
        value = params.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"reward {name!r}: {key} must be a number > 0, got {value!r}")
    cache = params.get("cache_entries", 0)
    if isinstance(cache, bool) or not isinstance(cache, int) or cache < 0:
        raise ConfigError(f"reward {name!r}: cache_entries must be an integer >= 0 (0: no cache), got {cache!r}")
    if params.get("mode", "fraction") not in MODES:
        raise ConfigError(f"reward {name!r}: mode must be one of {', '.join(MODES)}, got {params['mode']!r}")
    isolation = params.get("isolation", "namespaces")
    if isolation not in ("namespaces", "none"):
        raise ConfigError(f"reward {name!r}: isolation must be 'namespaces' or 'none', got {isolation!r}")
    if isolation == "namespaces":
        from megatron_rl.sandbox import namespaces_available

        why = namespaces_available()  # refused here, before any rollout, not at the first sample
        if why is not None:
            raise NoSandbox(f"reward {name!r} runs model-written code in a sandbox, which this machine cannot "
                            f"build: {why}. Allow user namespaces, or set params: {{isolation: none}} to run the "
                            "code with resource limits only (it can then use the network and this user's files)", why)
    # Not inline-safe: every test is a sandboxed process (tens of ms); the scorer's workers run it.
    bound = {**_keyword_defaults(code_tests_reward, CODE_TESTS_SETTINGS), **params}
    return RewardFunction(name, WithParams(code_tests_reward, bound, name), inline_safe=False)


def _synthetic_any(prompt: str, response: str, answer: str | None, *, task: str | None = None,
                   response_format: str = "plain", **metadata: Any) -> float:
    if task is None or answer is None:
        raise ValueError("the 'synthetic' reward needs records with 'task' metadata and an answer")
    return verify_synthetic(response, answer, task=task, response_format=response_format)


def _synthetic(name: str, params: Mapping[str, Any]) -> RewardFunction:
    if name == "synthetic":
        _check_params(name, params, ())
        return RewardFunction(name, _synthetic_any, inline_safe=True)
    _check_params(name, params, ("response_format",))
    task = make_task(task=name.split(":", 1)[1], **params)

    def synthetic_task_reward(prompt: str, response: str, answer: str | None, **metadata: Any) -> float:
        if answer is None:
            raise ValueError(f"reward {name!r} needs records with an answer")
        return task.verify(response, answer)

    return RewardFunction(name, synthetic_task_reward, inline_safe=True)


def absolute_reward_name(name: str) -> str:
    """The name with a relative file path made absolute (so other processes resolve the same file)."""
    module, sep, attr = name.rpartition(":")
    if sep and module.endswith(".py"):
        return f"{Path(module).resolve()}:{attr}"
    return name


def _load_file_module(name: str, path_text: str):
    path = Path(path_text).resolve()
    problem = not_a_file(path)
    if problem:
        raise ConfigError(f"reward {name!r}: file {path} {problem}")
    # One module per file path, registered so pickling and repeated resolution find it again.
    module_name = "megatron_rl_user_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"reward {name!r}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[module_name]
        raise ConfigError(f"reward {name!r}: executing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str, module_path: str):
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_path.startswith(exc.name) and module_path[len(exc.name):][:1] in ("", "."):
            raise ConfigError(
                f"reward {name!r}: no module named {exc.name!r} (is it installed, or on PYTHONPATH?)"
            ) from exc
        raise ConfigError(f"reward {name!r}: importing {module_path!r} failed: {type(exc).__name__}: {exc}") from exc
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"reward {name!r}: importing {module_path!r} failed: {type(exc).__name__}: {exc}") from exc


def _user(name: str, params: Mapping[str, Any]) -> RewardFunction:
    module_path, sep, attr_path = name.rpartition(":")
    if not sep or not module_path or not attr_path:
        raise ConfigError(
            f"reward {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "nor an import path 'package.module:function' or 'file.py:function'"
        )
    if module_path.endswith(".py"):
        obj = _load_file_module(name, module_path)
    else:
        obj = _import_module(name, module_path)
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"reward {name!r}: {getattr(obj, '__name__', module_path)!r} has no attribute {part!r}"
            ) from None
    if not callable(obj):
        raise ConfigError(f"reward {name!r} is not callable (it is an object of type {type(obj).__name__})")
    return RewardFunction(name, WithParams(obj, params, name) if params else obj, inline_safe=False,
                          batched=is_batched(obj))


def resolve_reward(name: str, params: Mapping[str, Any] | None = None) -> RewardFunction:
    """The ``RewardFunction`` for a configured name (see the module docstring)."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"a reward name must be a non-empty string, got {name!r}")
    params = dict(params or {})
    if name == "math":
        return _math(name, params)
    if name == "format":
        return _format(name, params)
    if name == "code_tests":
        return _code_tests(name, params)
    if name == "synthetic" or name.startswith("synthetic:"):
        if name != "synthetic" and name.split(":", 1)[1] not in TASKS:
            raise ConfigError(f"reward {name!r}: unknown synthetic task; known: {', '.join(TASKS)}")
        return _synthetic(name, params)
    return _user(name, params)
