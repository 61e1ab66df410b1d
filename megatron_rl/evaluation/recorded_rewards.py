"""What `megatron-rl eval` takes from the rewards section a checkpoint's run recorded
(trainer_state.json's config.rewards), checked where a set is scored with it.

A checkpoint is untrusted, and so is the run config it records: unless the user passes
TRUST_FLAG, its rewards may name only built-in functions, code_tests only in the namespace
sandbox, and the limits it sets for scoring on this machine are taken up to RECORDED_*_BOUNDS.

Only what a set uses is checked (evaluation/set_rewards.py says which set uses what):
    a set scored with the run's rewards (no reward of its own, not HumanEval-format):
        the recorded terms (names, code_tests' isolation and limits) and the scorer's limits;
    a set with its own reward (set.NAME.reward): the recorded scorer's limits only (its timeouts
        and workers score the set's reward);
    a HumanEval-format set: nothing recorded (the format's code_tests, default limits).
Before, every recorded term was checked when the checkpoint was read, so a stranger's run with a
custom reward was refused even when every set named its own; and the advice was to retype the
term as rewards.terms, which dropped its params, its weight and the other terms, so it could
score otherwise than the run did. TRUST_FLAG keeps the section exactly as recorded.
"""

from __future__ import annotations

from megatron_rl.errors import ConfigError
from megatron_rl.evaluation.checkpoints import TRAINER_STATE

TRUST_FLAG = "--trust-recorded-rewards"
# The most eval takes from a checkpoint's recorded rewards section and code_tests params without
# the user's word: several times what the project's own recipes and sets use (rewards.timeout_s
# 10, num_workers up to 32; code_tests wall 5-10 s, CPU 2-10 s, 512-1024 MB; HumanEval's cache
# 4096), so a run of ours passes and a stranger's `memory_mb: 1000000` or `num_workers: 10000`
# does not reach this machine. The command's own rewards.KEY (or rewards.terms) override is taken
# as it is.
RECORDED_REWARDS_BOUNDS = {"timeout_s": 600, "batch_timeout_s": 3600, "startup_timeout_s": 600, "num_workers": 64}
RECORDED_CODE_TESTS_BOUNDS = {"wall_seconds": 60, "cpu_seconds": 60, "memory_mb": 4096, "cache_entries": 65536}


def check_recorded_rewards(source, rewards, overrides: list[str], set_name: str, *, terms_used: bool,
                           trusted: bool) -> None:
    """ConfigError when set `set_name` would be scored with something the checkpoint `source`
    (an evaluation.checkpoints.CheckpointSource) chose beyond what eval takes on its say:
    `rewards` is the checkpoint's RewardConfig (its recorded section under the command's
    overrides); `terms_used`: the set is scored with its terms, not only its limits. Nothing is
    checked for a checkpoint no run wrote (its rewards are --config's), or when `trusted`."""
    if source.run_config is None or trusted:
        return
    recorded = source.run_config.get("rewards") or {}
    named = {item.split("=", 1)[0].strip() for item in overrides}
    where = f"set {set_name!r}: --ckpt {source.path}: the config recorded in {source.resolved / TRAINER_STATE}"
    trust = f"if you trust the checkpoint, pass {TRUST_FLAG} (its rewards as recorded)"
    for key, bound in RECORDED_REWARDS_BOUNDS.items():
        value = getattr(rewards, key)
        if key in recorded and f"rewards.{key}" not in named and value is not None and value > bound:
            raise ConfigError(f"{where} sets rewards.{key}={value:g}, above the {bound} eval takes from a checkpoint; "
                              f"if you mean it, set it yourself: rewards.{key}={value:g}, or {trust}")
    # The command's own rewards.terms is the user's word, taken as it is.
    if not terms_used or "terms" not in recorded or any(key.startswith("rewards.terms") for key in named):
        return
    own = f"or score the set with a reward of your own: set.{set_name}.reward=NAME"
    _check_recorded_terms(rewards.terms, where, f"{trust}, {own}")


def _check_recorded_terms(terms, where: str, advice: str) -> None:
    """The recorded terms name only built-in functions, run code_tests only in the namespace
    sandbox and within RECORDED_CODE_TESTS_BOUNDS. Before, a recorded `{name: some/file.py:fn}`
    was imported and run on the checkpoint's say, `params: {isolation: none}` ran the model's
    programs on this machine, and `memory_mb: 1000000` let each program take what it has."""
    from megatron_rl.rewards.registry import BUILTIN_REWARDS

    for index, term in enumerate(terms):
        if term.name not in BUILTIN_REWARDS:
            raise ConfigError(f"{where} names the reward {term.name!r} (rewards.terms[{index}]), code that eval does "
                              f"not run on a checkpoint's say; {advice}")
        if term.name != "code_tests":
            continue
        isolation = term.params.get("isolation", "namespaces")
        if isolation != "namespaces":
            raise ConfigError(f"{where} runs code_tests with isolation={isolation!r} (rewards.terms[{index}].params), "
                              f"which would run the model's programs outside the sandbox; {advice}")
        for key, bound in RECORDED_CODE_TESTS_BOUNDS.items():
            value = term.params.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > bound:
                raise ConfigError(f"{where} runs code_tests with {key}={value:g} (rewards.terms[{index}].params), "
                                  f"above the {bound} eval takes from a checkpoint; {advice}")
