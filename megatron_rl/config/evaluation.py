"""rl.eval: prompt sets measured during training, between steps, with the figures `megatron-rl eval`
reports (pass@k, avg@n, maj@k; evaluation/metrics.py), on the training engines:

    rl:
      eval:
        sets: {heldout: heldout, humaneval: data/HumanEval.jsonl.gz}   # NAME: PATH
        n: 8                 # samples per prompt
        k: [1, 4, 8]         # pass@k / maj@k; null: 1, 2, 4, ... below n, and n
        temperature: 1.0
        every_steps: 25      # null: rl.eval_every; 0: only before RL and after the last step

A PATH is what `megatron-rl eval --set NAME=PATH` takes (a prompt file or directory, or a
HumanEval-format .jsonl / .jsonl.gz), read with the run's data section; the word `heldout`
names the run's own held-out set (data.heldout or the synthetic task's). Each set's figures go
to metrics.jsonl as eval/NAME/pass@1, eval/NAME/avg@8, ... at the steps it runs. Without sets
(the default) nothing is added: the held-out greedy accuracy (rl.eval_every, eval/accuracy)
is measured as before either way. The sets' files are read and checked before any model is
built (train/eval_sets.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from megatron_rl.errors import ConfigError

HELDOUT = "heldout"  # a set PATH naming the run's held-out set
MAX_SAMPLES = 1 << 10  # samples per prompt: a typo's bound, as rl.group_size's


def is_set_name(name: object) -> bool:
    """A set's name (rl.eval.sets, `megatron-rl eval --set`): letters, digits, '_' or '-', as it
    stands in metric keys (eval/NAME/pass@1) and in set.NAME.OPTION=VALUE."""
    return isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_-]+", name) is not None


@dataclass
class EvalConfig:
    sets: dict[str, str] = field(default_factory=dict)  # NAME: PATH (or `heldout`); empty: off
    n: int = 8  # samples per prompt
    k: list[int] | None = None  # the ks of pass@k and maj@k, each 1..n; null: 1, 2, 4, ... below n, and n
    temperature: float = 1.0  # 0: greedy (every sample alike)
    top_p: float = 1.0
    every_steps: int | None = None  # RL steps between evaluations; null: rl.eval_every; 0: start and end only
    prompts: int | None = None  # the first this many prompts of each set; null: all
    max_tokens: int | None = None  # response budget; null: rl.max_response_tokens

    def validate(self, where: str) -> None:
        for name, path in self.sets.items():
            if not is_set_name(name):
                raise ConfigError(f"{where}.sets: set name {name!r} must be letters, digits, '_' or '-' (it is the "
                                  f"NAME of the metrics eval/NAME/pass@k)")
            if not isinstance(path, str) or not path.strip():
                raise ConfigError(f"{where}.sets.{name}: expected a path (or {HELDOUT!r}), got {path!r}")
        for name in ("n", "prompts", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{where}.{name} must be >= 1{'' if name == 'n' else ' or null'}, got {value}")
        if self.n > MAX_SAMPLES:
            raise ConfigError(f"{where}.n must be at most {MAX_SAMPLES} samples per prompt, got {self.n}")
        key = where.rpartition(": ")[2]  # "rl.eval", without the config's source, inside a sentence
        for k in self.k or ():
            if k > self.n:
                raise ConfigError(f"{where}.k: {k} is more than {key}.n={self.n}, the samples per prompt pass@{k} "
                                  f"draws from; ask for k <= {self.n} or raise {key}.n")
            if k < 1:
                raise ConfigError(f"{where}.k: {k} must be an integer from 1 to n={self.n}")
        if self.k is not None and not self.k:
            raise ConfigError(f"{where}.k is an empty list; list the ks (e.g. [1, {self.n}]) or leave it null")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"{where}.temperature must be a finite number >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{where}.top_p must be in (0, 1], got {self.top_p}")
        if self.every_steps is not None and self.every_steps < 0:
            raise ConfigError(f"{where}.every_steps must be >= 0 (0: before RL and after the last step only) or "
                              f"null (rl.eval_every), got {self.every_steps}")

    def due(self, step: int, last_step: int, eval_every: int) -> bool:
        """Whether the sets run after `step` (0: before RL): the start, the last step, and every
        every_steps (rl.eval_every when null) steps; never without sets."""
        if not self.sets:
            return False
        every = eval_every if self.every_steps is None else self.every_steps
        return step == 0 or step == last_step or bool(every and step % every == 0)
