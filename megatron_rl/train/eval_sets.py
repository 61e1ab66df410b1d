"""rl.eval (config/evaluation.py): prompt sets measured between training steps with the code
`megatron-rl eval` runs, evaluation/runner.py's evaluate_set and evaluation/metrics.py's figures,
on the training engines and with the weights the next step samples from.

    sets = load_eval_sets(config, heldout)       # before the runtime: each set read and checked
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


@dataclass
class EvalSet:
    name: str
    path: str
    records: list  # data.PromptRecord's, the first rl.eval.prompts of the set
    rewards: object | None  # a rewards.RewardConfig of the set's format; None: the run's rewards


def load_eval_sets(config, heldout) -> list[EvalSet]:
    """Every rl.eval set read and checked by the code that reads and checks a `megatron-rl eval
    --set` (evaluation/sets.py): the file, its rows, the fields its reward reads, a reward of its
    own resolved (a HumanEval set's sandbox), its prompts' length against the engine's context.
    `heldout`: the run's held-out dataset as preflight read it (data.load_datasets' second, what
    eval/accuracy measures; None: the run has none), which the set PATH `heldout` names: not
    read a second time. ConfigError naming rl.eval.sets.NAME and the run's keys (data.*,
    rl.eval.*) that fix it."""
    from megatron_rl.evaluation.set_rewards import set_rewards
    from megatron_rl.evaluation.sets import SetNaming, SetSpec, check_prompt_lengths, load_set
    from megatron_rl.train.preflight import run_tokenizer

    settings, found = config.rl.eval, {}
    for name, path in settings.sets.items():
        naming = SetNaming.training(name)
        found[name] = load_set(SetSpec(name=name, path=path, prompts=settings.prompts), config.data, naming,
                               read_heldout=lambda: heldout)
        # The run's rewards were resolved by preflight; a set format's own (code_tests) is resolved here.
        set_rewards(found[name], config.rewards, naming, run_rewards_resolved=True)
    if found:  # counted with the run's tokenizer, once every set is read
        budget, tokenizer = settings.max_tokens or config.rl.max_response_tokens, run_tokenizer(config)
        for name, item in found.items():
            check_prompt_lengths(item, tokenizer, config.data, config.rollout.max_model_len, budget,
                                 SetNaming.training(name))
    return [EvalSet(name, item.source, item.records, item.rewards) for name, item in found.items()]


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
