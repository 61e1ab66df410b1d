"""Test hook, active only with CONVERT_TEST_PAUSE set (tests/tools/test_convert.py puts this
directory on PYTHONPATH): wraps one function so that a conversion can be signalled at a known
point, in every process that imports it (the torchrun ranks included), or has it imported already
(a process forked from the tests' pre-imported server).

    CONVERT_TEST_PAUSE=package.module:function   the function to wrap
    CONVERT_TEST_MARKER=FILE                     written (with this pid) when the function is entered
    CONVERT_TEST_SLEEP=SECONDS                   then sleep this long before running it (default 0)
"""

import importlib.abc
import importlib.util
import os
import sys
import time


def _wrap(module, function: str) -> None:
    original = getattr(module, function)

    def paused(*args, **kwargs):
        with open(os.environ["CONVERT_TEST_MARKER"], "a") as handle:
            handle.write(f"{os.getpid()}\n")
        time.sleep(float(os.environ.get("CONVERT_TEST_SLEEP", "0")))
        return original(*args, **kwargs)

    setattr(module, function, paused)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, function: str):
        self.name, self.function = name, function

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # find the real spec without coming back here
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _wrap(module, self.function)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("CONVERT_TEST_PAUSE"):
    _module, _function = os.environ["CONVERT_TEST_PAUSE"].split(":")
    if _module in sys.modules:  # a process forked from a parent that imported it (tests/_support/zygote.py)
        _wrap(sys.modules[_module], _function)
    else:
        sys.meta_path.insert(0, _AfterImport(_module, _function))
