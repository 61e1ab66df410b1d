"""The reward terms that score a prompt set of `megatron-rl eval` or rl.eval (evaluation/sets.py
reads the set): its own (set.NAME.reward), its format's (a HumanEval set's code_tests), else the
run's; resolved before any model or engine exists, with the fields they read checked in the set's
records. ConfigError in the set's words (a SetNaming)."""

from __future__ import annotations

import dataclasses

from megatron_rl.errors import ConfigError
from megatron_rl.evaluation.sets import LoadedSet, SetNaming


def set_rewards(loaded: LoadedSet, run_rewards, naming: SetNaming, *, run_rewards_resolved: bool = False):
    """The reward terms (a rewards.RewardConfig) that score the set: its own (spec.reward with
    spec.reward_params), its format's (HumanEval's code_tests, spec.reward_params over the format's
    params), else the run's (`run_rewards`); each function resolved now, not at the first sample
    (unless they are the run's and the caller resolved them), and the fields they read checked in
    the set's records."""
    from megatron_rl.rewards import build_scorer
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rewards.scoring import RewardTerm

    spec = loaded.spec
    if loaded.rewards is not None and not isinstance(loaded.rewards, RewardConfig):
        raise TypeError(f"{naming.where}: a set format's loader returned {type(loaded.rewards).__name__} as its "
                        "rewards")
    if spec.reward is not None:
        rewards = dataclasses.replace(run_rewards, terms=[RewardTerm(spec.reward, params=spec.reward_params)])
    elif loaded.rewards is not None:  # the format's terms (HumanEval's code_tests), the set's reward_params over theirs
        rewards = dataclasses.replace(loaded.rewards, terms=[
            dataclasses.replace(term, params={**term.params, **spec.reward_params}) for term in loaded.rewards.terms])
    elif spec.reward_params:
        raise ConfigError(f"{naming.where}: reward_params are the parameters of the set's own reward, and it names "
                          f"none: name it with set.{spec.name}.reward=NAME (the run's rewards take "
                          "rewards.terms[].params)")
    else:
        rewards = run_rewards
    if rewards is not run_rewards or not run_rewards_resolved:
        try:
            build_scorer(rewards).close()
        except ConfigError as exc:
            raise ConfigError(_resolve_error(exc, loaded, own=rewards is not run_rewards, naming=naming)) from None
    check_reward_columns(loaded, [term.name for term in rewards.terms], naming)
    return rewards


def _resolve_error(exc: ConfigError, loaded: LoadedSet, own: bool, naming: SetNaming) -> str:
    """A set's reward that could not be resolved, in the set's words. code_tests refused for want of
    the namespace sandbox names the set's own way out when the reward is the set's (its option or
    its format's): rewards.terms[].params, which the registry names, does not reach it."""
    from megatron_rl.rewards.registry import NoSandbox

    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, NoSandbox):
        cause = cause.__cause__  # the scorer re-raises the registry's error naming its term
    if not own or cause is None:
        return f"{naming.where}: {exc}"
    return (f"{naming.where}: its reward code_tests runs the model's programs in a namespace sandbox, which this "
            f"machine cannot build: {cause.why}. Allow user namespaces, or run them with resource limits only (they "
            f"can then use the network and this user's files): "
            f"{naming.sandbox_opt_out(loaded.spec.name, loaded.spec.path)}")


def check_reward_columns(loaded: LoadedSet, reward_names: list[str], naming: SetNaming | None = None) -> None:
    """The fields the set's reward functions read are in its records: a reference answer for
    "math" and the synthetic verifiers, `tests` for "code_tests". ConfigError naming the set, the
    file, the field and the key to set."""
    spec, records = loaded.spec, loaded.records
    naming = naming or SetNaming.command(spec.name)
    if not records:
        raise ConfigError(f"{naming.where}: {loaded.source} holds no prompts")
    first = records[0]
    for name in reward_names:
        if name == "code_tests" and "tests" not in first.metadata:
            fields = ", ".join(sorted(first.metadata)) or "none"
            raise ConfigError(f"{naming.where}: the reward code_tests reads each record's 'tests', and "
                              f"{first.location or loaded.source} has no such field (its other fields: {fields}); "
                              f"map the field that holds the tests with {naming.fix('columns.FIELD', 'tests')}")
        if (name == "math" or name.startswith("synthetic")) and first.answer is None:
            raise ConfigError(f"{naming.where}: the reward {name} compares each response with the record's answer, "
                              f"and {loaded.source} is read without one (answer_key null); name the answer field "
                              f"with {naming.key('answer_key')}=FIELD")
