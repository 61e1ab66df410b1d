"""The progress line of `megatron-rl eval`: prompts done of a set, for one checkpoint, on the driver.

On a terminal one line redrawn in place (`\\r`) as requests finish; into a file or pipe (a job's
log) only the finished line per set, so logs hold no bar frames. Nothing on other ranks.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class PromptProgress:
    WIDTH = 24  # characters of the bar

    def __init__(self, label: str, set_name: str, per_prompt: str, *, enabled: bool, stream: TextIO | None = None):
        self.label, self.set_name, self.per_prompt = label, set_name, per_prompt  # e.g. "4 samples + greedy"
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.live = enabled and self.stream.isatty()
        self.start = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        """runner.evaluate_set's `progress`: after each request."""
        if self.live:
            self.stream.write("\r" + self._line(done, total))
            self.stream.flush()

    def finish(self, total: int) -> None:
        if not self.enabled:
            return
        self.stream.write(("\r" if self.live else "") + self._line(total, total) + "\n")
        self.stream.flush()

    def _line(self, done: int, total: int) -> str:
        filled = self.WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        elapsed = time.perf_counter() - self.start
        return (f"eval {self.label} / {self.set_name}: [{bar}] {done}/{total} prompts "
                f"({self.per_prompt} each) {elapsed:.1f} s")
