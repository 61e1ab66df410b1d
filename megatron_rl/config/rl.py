"""The RL loop's section: what one step generates, how it trains on it, and the algorithm.

The algorithm names are declared once, in megatron_rl/algorithms/names.py (no torch); the
recipe this section selects, with its overrides and run-dependent defaults, is built by
megatron_rl/algorithms/from_config.py (`recipe_for(config.rl, config.response_budget)`).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_rl.algorithms.names import (LossAggMode, OffPolicyMethod, OutcomeAdvantageEstimator, RatioLevel,
                                          RecipeName, TisLevel, TisMode)
from megatron_rl.config.evaluation import EvalConfig
from megatron_rl.config.teacher import TeacherConfig, validate_distillation
from megatron_rl.errors import ConfigError

# The estimators a run can use (a config names them as algorithms/names.py does).
AdvantageEstimator = OutcomeAdvantageEstimator
# YAML reads a bare `off` as false; "off" turns TIS off even where the recipe has it.
TisLevelSetting = Literal[TisLevel, "off"]


RoutingReplay = Literal["off", "training", "rollout"]

# Below this rl.temperature samples greedily in practice: softmax(logits / T) gives a token d logits
# behind the top exp(-d / T) times its probability (at 0.05, one logit behind: e^-20 = 2e-9), and in
# float32 a token more than 104 x T behind gets exactly 0. Every sample of a group is then the same
# answer, every group's advantage 0, and no update is taken: rl.temperature=1e-6 ran every step
# with 0 updates and ended "done".
MIN_TEMPERATURE = 0.05
# What one step holds at once: every prompt's group_size samples (tokens, logprobs, rewards) are
# generated, scored and packed together before it trains. DAPO's 512 prompts x 16 samples is 2^13;
# these bounds are far beyond any recipe and stop a typo before it allocates.
MAX_GROUP_SIZE = 1 << 10
MAX_STEP_SAMPLES = 1 << 20  # prompts_per_step x group_size
# Tokens of one response: it must also fit rollout.max_model_len (checked with the prompts).
MAX_RESPONSE_TOKENS = 1 << 24


def _routing_replay_value(value: Any) -> Any:
    """rl.routing_replay as written: true / false (the former boolean key, and YAML's reading of a
    bare `off`) mean training / off; anything else is checked against RoutingReplay."""
    if value is True:
        return "training"
    if value is False:
        return "off"
    return value


def _off_value(value: Any) -> Any:
    """YAML reads a bare `off` as false: rl.tis_level: off / false mean "off"."""
    return "off" if value is False else value


def _check_choice(where: str, name: str, value: Any, hint: Any) -> None:
    allowed = typing.get_args(hint)
    if value is not None and value not in allowed:
        raise ConfigError(f"{where}.{name}: {value!r} is not one of {', '.join(map(repr, allowed))} (or null for "
                          f"the recipe's value)")


# The legacy spelling of the correction (rl.tis_*), refused beside rl.off_policy.method.
LEGACY_TIS_KEYS = ("tis_level", "tis_mode", "tis_upper", "tis_lower")


@dataclass
class OffPolicyConfig:
    """rl.off_policy: corrections against the rollout engine's own per-token logprobs mu, with
    rho = pi_old / mu per token (algorithms/offpolicy.py, docs/algorithms.md). Any of them combines
    with every recipe, loss and aggregation; a masked token leaves the loss and its normaliser."""

    # tis     truncated importance sampling: the loss times min(rho, high) (token) or the
    #         truncated product over the sample (sequence); low, if set, floors the weight
    # icepop  Ring-1T: a token whose rho leaves [low, high] is masked, inside the band rho corrects
    #         (token level; low 0.5, high 5.0 when null)
    # mis     masked importance sampling: a weight above high drops the token (token level) or the
    #         whole sample (sequence level: the product over its tokens) instead of truncating it;
    #         low, if set, drops weights below it too
    # off     none (also where the recipe has one); null: the recipe's, or the legacy rl.tis_* keys
    method: OffPolicyMethod | None = field(default=None, metadata={"coerce": lambda value: "off" if value is False
                                                                    else value})
    level: TisLevel | None = None  # token | sequence (tis, mis); null: token
    low: float | None = None  # in (0, 1)
    high: float | None = None  # > 1; null: 2.0 (tis, mis), 5.0 (icepop)
    # DeepSeek-V3.2's off-policy sequence mask, with any method: a sample with a negative
    # advantage whose KL from the sampling policy, mean over its tokens of log mu - log pi_theta
    # (pi_theta: the policy being updated), exceeds this delta leaves the loss. null: off.
    opsm_delta: float | None = None

    def validate(self, where: str, rl: "RLConfig") -> None:
        where = f"{where}.off_policy"
        _check_choice(where, "method", self.method, OffPolicyMethod)
        _check_choice(where, "level", self.level, TisLevel)
        for name in ("low", "high", "opsm_delta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ConfigError(f"{where}.{name} must be a finite number >= 0 (or null), got {value!r}")
        if self.low is not None and self.high is not None and self.low >= self.high:
            raise ConfigError(f"{where}.low={self.low} must be < high={self.high}")
        if self.low is not None and not 0 < self.low < 1:
            raise ConfigError(f"{where}.low={self.low} must be in (0, 1): the band must hold rho = 1, an "
                              f"on-policy token")
        if self.high is not None and not self.high > 1:
            raise ConfigError(f"{where}.high={self.high} must be > 1: the band must hold rho = 1, an on-policy "
                              f"token")
        given = [name for name in ("level", "low", "high") if getattr(self, name) is not None]
        if self.method in (None, "off") and given:
            raise ConfigError(f"{where}.{given[0]} has no effect without a correction; set {where}.method to tis, "
                              f"icepop or mis")
        if self.method == "icepop" and self.level == "sequence":
            raise ConfigError(f"{where}.level=sequence: icepop masks tokens; for a sequence-level mask use "
                              f"{where}.method=mis with level sequence")
        legacy = [name for name in LEGACY_TIS_KEYS if getattr(rl, name) is not None]
        if self.method is not None and legacy:
            raise ConfigError(f"{where}.method and rl.{legacy[0]} both choose the off-policy correction; keep "
                              f"rl.off_policy (rl.tis_level / tis_mode / tis_upper / tis_lower are its former spelling: "
                              f"tis_mode truncate is method tis, mask is mis (icepop with a tis_lower at token "
                              f"level), tis_upper is high, tis_lower is low)")


@dataclass
class RLConfig:
    """The RL loop: what one step generates, how it trains on it, and the algorithm."""

    # grpo | dr_grpo | dapo | gspo | cispo | olmo3 (megatron_rl.algorithms.recipes); the
    # algorithm fields below that are None keep the recipe's value.
    recipe: RecipeName = "dapo"
    kl_coef: float | None = None
    entropy_coef: float | None = None
    eps_low: float | None = None
    eps_high: float | None = None
    dynamic_sampling: bool | None = None
    # Group-relative advantage: grpo ((r - mean) / std), dr_grpo (r - mean), rloo (leave-one-out
    # mean), reinforce_plus_plus_baseline (r - group mean, whitened over the batch).
    advantage_estimator: AdvantageEstimator | None = None
    # Loss reduction: token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum,
    # seq-mean-token-sum-norm (Dr. GRPO; L_norm = the response budget, below), token-sum.
    loss_agg_mode: LossAggMode | None = None
    # Importance ratio: token (PPO), sequence (GSPO), sequence_token (GSPO-token).
    ratio_level: RatioLevel | None = None
    # DAPO overlong reward shaping: 0 up to overlong_max_length - overlong_buffer_length, then a
    # linear ramp to -overlong_penalty_factor at overlong_max_length. DAPO's 20480 / 4096 are its
    # generation budget and a fifth of it, so when the recipe shapes (dapo) or either length is set
    # here, a length left null follows that rule at this run's response budget (the model tokens
    # of one trajectory: max_response_tokens single-turn; multi-turn, rollout.max_turns of them,
    # at most rollout.max_total_tokens; RunConfig.response_budget): overlong_max_length = the
    # budget and overlong_buffer_length = round(0.2 * overlong_max_length), at least 1 (DAPO's
    # own numbers would never penalize a response budget up to 16384). A soft budget at or beyond
    # the response budget is refused (it would never apply); overlong_penalty_factor: 0 turns
    # shaping off.
    overlong_max_length: int | None = None
    overlong_buffer_length: int | None = None
    overlong_penalty_factor: float | None = None
    # Truncated responses (cut at max_response_tokens) leave the loss (DAPO overlong filtering).
    mask_truncated: bool | None = None
    # Train/inference mismatch correction (truncated importance sampling against the engine's
    # logprobs, weight pi_old_train / pi_rollout): tis_level token | sequence | off (null: the
    # recipe's; the olmo3 recipe has token-level TIS); tis_mode truncate (clip the weight to
    # [tis_lower, tis_upper]) | mask (weight 0 outside it). Setting tis_upper alone (e.g. 2.0)
    # turns token-level TIS on, as before.
    tis_level: TisLevelSetting | None = field(default=None, metadata={"coerce": _off_value})
    tis_mode: TisMode | None = None
    tis_upper: float | None = None
    tis_lower: float | None = None
    # The off-policy corrections by name (tis, icepop, mis) and DeepSeek-V3.2's sequence mask; the
    # tis_* keys above are their former spelling (not both).
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    # Samples may come from a policy at most this many versions older than the one being
    # updated; 0 = synchronous. At >= 1, unless tis_level is set, the loss is AReaL's decoupled
    # objective (arXiv:2505.24298): the PPO ratio against the proximal policy (old logprobs the
    # trainer recomputes at the step's start) times the behaviour weight proximal / engine,
    # which is token-level TIS, truncated at tis_upper (2.0 when null).
    max_staleness: int = 0
    # Dual clip for negative advantages (c > 1), None = off.
    dual_clip_c: float | None = None
    # Defaults: the built-in tiny run (about 3 minutes of RL on 2 CPU cores).
    steps: int = 150  # RL steps (one rollout batch each)
    prompts_per_step: int = 32
    group_size: int = 8  # samples per prompt (G)
    # Optimizer updates per rollout batch (mini-batches). With more than one, the old-policy
    # logprobs are recomputed before the first update and the ratio departs from 1.
    updates_per_rollout: int = 2
    # Optimizer updates in a row skipped for a non-finite gradient before the run stops (without
    # a checkpoint of that step; train/update_guard.py). One is a fluke; three is a cause.
    max_bad_steps: int = 3
    # The most one optimizer update may multiply the policy's weight norm by; beyond it the run
    # stops before that step's checkpoint and weight push (train/update_guard.py). Adam moves each
    # weight by about lr per update: the tiny default's updates change the norm by under 1%
    # (warm start) and 0.01% (RL). 0 turns the check off.
    max_weight_norm_growth: float = 2.0
    max_response_tokens: int = 6
    # The rollout engines sample from softmax(logits / temperature), and the trainer trains on that
    # same distribution: its logprobs, ratio, KL, entropy and gradient are of logits / temperature,
    # and the engines return the logprobs after temperature (vLLM logprobs_mode
    # processed_logprobs; SGLang's default). > 0: greedy (0) has no distribution to train on
    # (rl.eval_temperature may be 0).
    temperature: float = 1.0
    # Nucleus sampling is not supported for training; only 1 is accepted. The truncated
    # distribution gives every token outside the nucleus probability 0, so a token the engine
    # sampled can fall outside the nucleus of the old, updated or reference policy (ratio 0 or
    # infinite, KL infinite); the nucleus needs a sort of the whole vocabulary per token, which
    # the vocabulary-parallel logprob never gathers; and SGLang returns logprobs before its
    # top-p / top-k filter, so the two engines would disagree. (Top-k is not a setting at all.)
    top_p: float = 1.0
    # Dynamic sampling: extra generate rounds allowed to refill the batch after dropping groups
    # whose rewards are all equal.
    max_refill_rounds: int = 3
    # MoE routing across the forwards of a step (megatron_rl/model/routing.py):
    #   off       every forward routes by itself; `moe/routing_drift` counts the training
    #             forward's routes that differ from the old-logprob forward's
    #   training  the experts chosen in the old-logprob forward are replayed in the training
    #             forward (Megatron-Core router replay), so the ratio compares one routed network
    #   rollout   R3 (rollout routing replay): the rollout engine's own routes of every token it
    #             ran are replayed in the old-logprob, reference and training forwards, so the
    #             trainer computes the network the engine sampled from; `moe/rollout_routing_drift`
    #             counts the trainer's own choices that differ from the engine's. vLLM engines only.
    # true / false are read as training / off (YAML reads a bare `off` as false).
    routing_replay: RoutingReplay = field(default="off", metadata={"coerce": _routing_replay_value})
    eval_every: int = 25  # RL steps between held-out evaluations (0: only before and after)
    eval_prompts: int | None = None  # None: the whole held-out set
    eval_temperature: float = 0.0  # greedy by default: accuracy of the policy's best answer
    # Prompt sets with pass@k, avg@n, maj@k between steps (config/evaluation.py); no sets: off.
    eval: EvalConfig = field(default_factory=EvalConfig)
    # On-policy distillation (config/teacher.py, docs/algorithms.md): a teacher scores every sampled
    # token, and a token's advantage is (1 - distill_coef) x the reward's advantage + distill_coef x
    # (log pi_teacher - log pi_student). distill_coef null: 1 (distillation alone) with a teacher.
    teacher: TeacherConfig | None = None
    distill_coef: float | None = None

    def __post_init__(self):
        self.routing_replay = _routing_replay_value(self.routing_replay)
        self.tis_level = _off_value(self.tis_level)

    def validate(self, where: str) -> None:
        if self.routing_replay not in typing.get_args(RoutingReplay):
            raise ConfigError(f"{where}.routing_replay: {self.routing_replay!r} is not one of "
                              f"{', '.join(map(repr, typing.get_args(RoutingReplay)))}")
        for name in ("steps", "prompts_per_step", "updates_per_rollout", "max_response_tokens", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        growth = self.max_weight_norm_growth
        if not (math.isfinite(growth) and (growth == 0 or growth > 1)):
            raise ConfigError(f"{where}.max_weight_norm_growth must be a finite factor > 1 (or 0: no check), "
                              f"got {growth}")
        if self.group_size < 2:
            raise ConfigError(f"{where}.group_size must be >= 2 (group-relative advantages need a group)")
        if self.group_size > MAX_GROUP_SIZE:
            raise ConfigError(f"{where}.group_size must be at most {MAX_GROUP_SIZE} (samples per prompt, held together "
                              f"until the step trains), got {self.group_size}")
        if self.prompts_per_step * self.group_size > MAX_STEP_SAMPLES:
            raise ConfigError(f"{where}: prompts_per_step x group_size = {self.prompts_per_step} x {self.group_size} "
                              f"samples per step is beyond {MAX_STEP_SAMPLES}: a step holds all of them at once")
        if self.max_response_tokens > MAX_RESPONSE_TOKENS:
            raise ConfigError(f"{where}.max_response_tokens must be at most {MAX_RESPONSE_TOKENS} (and fit "
                              f"rollout.max_model_len with the prompt), got {self.max_response_tokens}")
        if self.prompts_per_step % self.updates_per_rollout:
            raise ConfigError(f"{where}.updates_per_rollout={self.updates_per_rollout} must divide "
                              f"prompts_per_step={self.prompts_per_step} (whole groups per update)")
        if self.max_refill_rounds < 0 or self.eval_every < 0:
            raise ConfigError(f"{where}.max_refill_rounds and eval_every must be >= 0")
        if not self.temperature > 0 or self.temperature == float("inf"):  # also NaN
            raise ConfigError(f"{where}.temperature must be a finite number > 0, got {self.temperature}: the "
                              f"trainer trains on the sampling distribution softmax(logits / temperature), which "
                              f"greedy decoding (0) does not have; rl.eval_temperature may be 0")
        if self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"{where}.temperature={self.temperature:g} samples greedily in practice: every sample of "
                              f"a group would be the same answer, every advantage 0 and no update taken (a token one "
                              f"logit behind the top is exp(-1 / T) as likely). Use at least {MIN_TEMPERATURE} "
                              f"(0.6 .. 1.0 is usual); rl.eval_temperature may be 0")
        if self.top_p != 1:
            raise ConfigError(f"{where}.top_p={self.top_p}: nucleus sampling is not supported for training; set "
                              f"rl.top_p=1 (and lower rl.temperature for sharper samples). A truncated "
                              f"distribution gives a sampled token probability 0 under the old, updated or "
                              f"reference policy whose nucleus it left (ratio 0 or infinite, KL infinite), and "
                              f"SGLang reports logprobs before its top-p filter (docs/algorithms.md)")
        if not self.eval_temperature >= 0 or self.eval_temperature == float("inf"):
            raise ConfigError(f"{where}.eval_temperature must be a finite number >= 0 (0: greedy), "
                              f"got {self.eval_temperature}")
        self._validate_algorithm(where)
        validate_distillation(self.teacher, self.distill_coef, where)
        self.eval.validate(f"{where}.eval")
        if self.teacher is not None and self.off_policy.opsm_delta is not None:
            # The sequence mask keys on the sample's reward advantage; with a teacher each token has
            # its own (the teacher's signal mixed in), and the two would disagree on what to drop.
            raise ConfigError(f"{where}.off_policy.opsm_delta with rl.teacher: DeepSeek-V3.2's sequence "
                              f"mask is not defined for per-token distillation advantages; remove one of the two")
        if self.eval_prompts is not None and self.eval_prompts < 1:
            raise ConfigError(f"{where}.eval_prompts must be >= 1 or null")

    def _validate_algorithm(self, where: str) -> None:
        """The algorithm knobs, without building the recipe (that imports torch; trainer.preflight
        builds it and reports the loss config's own checks)."""
        for name, hint in (("recipe", RecipeName), ("advantage_estimator", AdvantageEstimator),
                           ("loss_agg_mode", LossAggMode), ("ratio_level", RatioLevel), ("tis_level", TisLevelSetting),
                           ("tis_mode", TisMode)):
            _check_choice(where, name, getattr(self, name), hint)
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError(f"{where}.max_staleness must be an integer >= 0 (0 = synchronous), "
                              f"got {self.max_staleness!r}")
        for name in ("overlong_max_length", "overlong_buffer_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{where}.{name} must be an integer >= 1 (or null), got {value!r}")
        if (self.overlong_max_length is not None and self.overlong_buffer_length is not None
                and self.overlong_buffer_length > self.overlong_max_length):
            raise ConfigError(f"{where}.overlong_buffer_length={self.overlong_buffer_length} must be <= "
                              f"overlong_max_length={self.overlong_max_length}")
        factor = self.overlong_penalty_factor
        if factor is not None and not (factor >= 0 and factor != float("inf")):
            raise ConfigError(f"{where}.overlong_penalty_factor must be a finite number >= 0 (0 = no shaping), "
                              f"got {factor}")
        if self.tis_upper is not None and not 1 < self.tis_upper < float("inf"):
            raise ConfigError(f"{where}.tis_upper must be > 1 (or null), got {self.tis_upper}")
        if self.tis_lower is not None and not 0 < self.tis_lower < 1:
            raise ConfigError(f"{where}.tis_lower must be in (0, 1) (or null for no lower bound), got {self.tis_lower}")
        self.off_policy.validate(where, self)
        if self.tis_level == "off":
            given = [name for name in ("tis_mode", "tis_upper", "tis_lower") if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"{where}.{given[0]} has no effect with tis_level=off; remove it or set tis_level "
                                  f"to token or sequence")
