"""Rewards: rule verifiers (math answers, format, synthetic tasks) and user functions by import path.

Public API (what the trainer calls):

* ``build_scorer(RewardConfig.from_dict(section))``, or directly
  ``RewardScorer(terms, timeout_s=..., num_workers=...)`` with ``RewardTerm(name, weight, params)``:
  ``.score([RewardInput(prompt, response, answer, metadata)]) -> ScoreResult`` (per-sample
  rewards, per-term rewards, error/timeout counts, ``metrics()``); ``.close()``.
* ``resolve_reward(name, params) -> RewardFunction``: the registry ("math", "format",
  "synthetic", "synthetic:<task>", "module:function", "file.py:function").
* ``@batched``: marks a user reward function as batched (lists in, a list of rewards out);
  ``is_batched(fn)`` is the detection rule.
* ``make_task(...)`` / ``TaskConfig``: synthetic tasks (records + verifiers).
* ``math_answer``: ``extract_answer``, ``answers_match``, ``math_reward``.

The reward-function contract is documented in ``functions.py``. Importing this package does not
import torch or sympy.
"""

from megatron_rl.rewards.config import RewardConfig, build_scorer
from megatron_rl.rewards.functions import RewardFunction, as_reward, batched, is_batched
from megatron_rl.rewards.math_answer import answers_match, extract_answer, extract_boxed, math_reward
from megatron_rl.rewards.registry import BUILTIN_REWARDS, resolve_reward
from megatron_rl.rewards.scoring import RewardInput, RewardScorer, RewardTerm, ScoreResult
from megatron_rl.rewards.synthetic import TASKS, SyntheticTask, TaskConfig, make_task

__all__ = [
    "BUILTIN_REWARDS",
    "TASKS",
    "RewardConfig",
    "RewardFunction",
    "RewardInput",
    "RewardScorer",
    "RewardTerm",
    "ScoreResult",
    "SyntheticTask",
    "TaskConfig",
    "answers_match",
    "as_reward",
    "batched",
    "build_scorer",
    "extract_answer",
    "extract_boxed",
    "is_batched",
    "make_task",
    "math_reward",
    "resolve_reward",
]
