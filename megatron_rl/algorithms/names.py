"""Every algorithm name a user can write, declared once (no torch: the config imports this).

The config's fields are typed with these Literals, so a misspelt name is refused with the list
of choices when the config loads; the algorithm modules check their arguments against the
tuples derived from the same Literals.
"""

from __future__ import annotations

from typing import Literal, get_args

RecipeName = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "olmo3"]
# Group-relative estimators from outcome rewards (one reward per sample): what a run can use.
OutcomeAdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]
# ... and grpo_process, which needs per-step (process) rewards the trainer does not produce.
AdvantageEstimator = Literal[OutcomeAdvantageEstimator, "grpo_process"]
# Loss aggregation (verl's loss_agg_mode names).
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                      "token-sum"]
RatioLevel = Literal["token", "sequence", "sequence_token"]
TisLevel = Literal["token", "sequence"]
TisMode = Literal["truncate", "mask"]
# rl.off_policy.method: the correction against the engine's logprobs (algorithms/offpolicy.py).
OffPolicyMethod = Literal["tis", "icepop", "mis", "off"]

RECIPE_NAMES: tuple[str, ...] = get_args(RecipeName)
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
TIS_LEVELS: tuple[str, ...] = get_args(TisLevel)
TIS_MODES: tuple[str, ...] = get_args(TisMode)
OFF_POLICY_METHODS: tuple[str, ...] = get_args(OffPolicyMethod)
