"""rl.eval (config/evaluation.py): prompt sets measured between training steps with the code
`megatron-rl eval` runs, evaluation/runner.py's evaluate_set and evaluation/metrics.py's figures,
on the training engines and with the weights the next step samples from.

    sets = load_eval_sets(config, datasets)      # before the runtime: each set read and checked
    evals = TrainingEvals(config, sets, tokenizer, runtime)
    metrics.update(evals.run(step, generation, scorer))   # collective; {} where the step is not due
    evals.close()

Each set's figures become metrics.jsonl keys eval/NAME/pass@k, eval/NAME/avg@n, eval/NAME/maj@k,
eval/NAME/length_mean, ... (evaluation/metrics.flat_metrics). Every evaluation samples prompt i
of a set with the same seed (the run's seed), so the curve follows the weights, not the sampler.
A set is scored by the run's reward functions unless its format brings its own (a HumanEval
set: code_tests in the sandbox), then by a scorer of its own, built once. The held-out greedy
accuracy (train/evaluate.py, eval/accuracy) is not touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from megatron_rl.config.evaluation import HELDOUT
from megatron_rl.errors import ConfigError


@dataclass
class EvalSet:
    name: str
    path: str
    records: list  # data.PromptRecord's, the first rl.eval.prompts of the set
    rewards: object | None  # a rewards.RewardConfig of the set's format; None: the run's rewards


def load_eval_sets(config, datasets) -> list[EvalSet]:
    """Every rl.eval set read and checked as `megatron-rl eval` checks a --set (evaluation/sets.py):
    the file, its rows, the fields its reward reads, a reward of its own resolved (a HumanEval
    set's sandbox), its prompts' length against the engine's context. `datasets`: preflight's
    (train, held-out). ConfigError naming rl.eval.sets.NAME."""
    from megatron_rl.evaluation.sets import SetSpec, check_reward_columns, load_set
    from megatron_rl.rewards import build_scorer

    settings, loaded = config.rl.eval, []
    for name, path in settings.sets.items():
        where = f"rl.eval.sets.{name}"
        if path == HELDOUT:
            heldout = datasets[1]
            if heldout is None or len(heldout) == 0:
                raise ConfigError(f"{where}: {HELDOUT!r} names the run's held-out set, and this run has none; set "
                                  "data.heldout (a prompt file) or give the set's own path")
            item = EvalSet(name, heldout.source, list(heldout), None)
        else:
            try:
                found = load_set(SetSpec(name=name, path=path), config.data)
                terms = found.rewards.terms if found.rewards is not None else config.rewards.terms
                check_reward_columns(found, [term.name for term in terms])
                if found.rewards is not None:  # its own reward resolved now (code_tests: can the sandbox run?)
                    build_scorer(found.rewards).close()
            except ConfigError as exc:
                raise ConfigError(f"{where}: {str(exc).removeprefix(f'set {name!r}: ')}") from None
            item = EvalSet(name, path, found.records, found.rewards)
        if settings.prompts is not None:
            item.records = item.records[:settings.prompts]
        _check_lengths(config, item)
        loaded.append(item)
    return loaded


def _check_lengths(config, item: EvalSet) -> None:
    """Every prompt leaves room for rl.eval's response budget in the engine's context."""
    from megatron_rl.data import PromptDataset
    from megatron_rl.train.preflight import overlong_prompts, run_tokenizer

    budget = config.rl.eval.max_tokens or config.rl.max_response_tokens
    limit = config.rollout.max_model_len - budget
    if limit < 1:
        raise ConfigError(f"rl.eval: rollout.max_model_len={config.rollout.max_model_len} leaves no room for a prompt "
                          f"next to the evaluation's response budget of {budget} tokens; raise rollout.max_model_len "
                          "or lower rl.eval.max_tokens")
    over = overlong_prompts(PromptDataset(item.records, item.path), run_tokenizer(config), config.data, limit)
    if over:
        index, tokens = over[0]
        raise ConfigError(f"rl.eval.sets.{item.name}: {item.records[index].location or item.path}: the prompt is "
                          f"{tokens} tokens, over the limit of {limit} (rollout.max_model_len="
                          f"{config.rollout.max_model_len} - a response budget of {budget}); {len(over)} of "
                          f"{len(item.records)} prompts are over it. Raise rollout.max_model_len, or evaluate "
                          "fewer prompts (rl.eval.prompts)")


class TrainingEvals:
    """The rl.eval sets of one run, their own scorers (built once) and the sampling settings."""

    def __init__(self, config, sets: list[EvalSet], tokenizer, runtime):
        from megatron_rl.rollout.protocol import SamplingParams
        from megatron_rl.train.scoring import GroupScorer

        self.config, self.sets = config, sets
        settings = config.rl.eval
        self.params = SamplingParams(n=settings.n, temperature=settings.temperature, top_p=settings.top_p,
                                     max_tokens=settings.max_tokens or config.rl.max_response_tokens, seed=config.seed)
        # A set whose format brings its rewards (HumanEval's code_tests) gets a scorer of its own.
        self.scorers = {item.name: GroupScorer(item.rewards, tokenizer, runtime)
                        for item in sets if item.rewards is not None}

    def due(self, step: int) -> bool:
        rl = self.config.rl
        return rl.eval.due(step, rl.steps, rl.eval_every)

    def run(self, step: int, generation, scorer) -> dict:
        """Collective: every set's figures after `step` (0: before RL) as eval/NAME/... metrics,
        or {} where rl.eval says this step is not one. `generation`, `scorer`: the trainer's."""
        if not self.due(step):
            return {}
        from megatron_rl.evaluation.metrics import flat_metrics, set_figures
        from megatron_rl.evaluation.runner import evaluate_set

        tick, metrics = time.perf_counter(), {}
        for item in self.sets:
            outcome = evaluate_set(item.records, generation=generation, scorer=self.scorers.get(item.name, scorer),
                                   params=self.params, name=item.name, path=item.path, greedy=False)
            # The curve plots each figure's value; the intervals are for `megatron-rl eval`'s report.
            figures = set_figures(outcome, self.config.rl.eval.k, resamples=1)
            metrics.update(flat_metrics(item.name, figures))
        metrics["time/eval_sets_s"] = time.perf_counter() - tick
        return metrics

    def close(self) -> None:
        for scorer in self.scorers.values():
            scorer.close()
