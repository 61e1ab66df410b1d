"""``PolicyLossConfig``: every knob of ``policy_loss``, validated at construction.

Field names follow what users know from verl / TRL / slime; ``from_dict`` also accepts their
spellings (``clip_ratio_low``, ``clip_ratio_c``, ``kl_loss_coef``, ``beta``, ``entropy_coeff``,
``low_var_kl``, ...). The object is frozen: a config shared by every micro-batch of a step must
not change between them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from megatron_rl.algorithms._checks import finite_number
from megatron_rl.algorithms.kl import canonical_kl_type
from megatron_rl.algorithms.names import LOSS_AGG_MODES, RATIO_LEVELS, TIS_LEVELS, TIS_MODES

__all__ = ["PolicyLossConfig", "resolve_aliases", "POLICY_LOSS_TYPES", "RATIO_LEVELS", "TIS_LEVELS", "TIS_MODES"]

POLICY_LOSS_TYPES = ("ppo", "cispo")
NONFINITE_MODES = ("raise", "mask")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Configuration of ``policy_loss`` (defaults: token-level PPO clip 0.2, token-mean, no KL).

    Surrogate:
        policy_loss_type: ``"ppo"`` (clipped surrogate; PPO arXiv:1707.06347) or ``"cispo"``
            (MiniMax-M1 arXiv:2506.13585 §3.1: ``-sg(clip(r, 1-eps_low, 1+eps_high)) A logp``;
            every token keeps a gradient, only the IS weight is truncated).
        ratio_level: ``"token"`` (r_t = pi/pi_old per token), ``"sequence"`` (GSPO,
            arXiv:2507.18071 Eq. 7: s_i = exp(mean_t log r_t) over the sample's valid tokens,
            broadcast to its tokens; the gradient reaches each token through the mean), or
            ``"sequence_token"`` (GSPO-token, Eq. 13: value s_i, d/d logp_t = s_i, which differs
            from "sequence" only with per-token advantages).
        eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high] (DAPO clip-higher: 0.2/0.28).
            For CISPO they bound the IS weight (eps_low >= 1 = no lower bound, as in the paper).
        dual_clip_c: dual-clip constant c > 1 (Ye et al. 2020, arXiv:1912.09729): where A < 0
            the per-token loss is capped at -c*A. None = off. PPO only.
        log_ratio_clamp: |log ratio| bound before exp (None = off); bounds exp overflow.

    Aggregation:
        loss_agg_mode: see ``aggregation.LOSS_AGG_MODES``.
        l_norm: Dr. GRPO L_norm, only for ``seq-mean-token-sum-norm`` (None = the longest sample
            of the step, or what the ``StepNormalizer`` was given).

    Regularizers:
        kl_coef: weight of KL(pi || pi_ref) in the loss (needs ``ref_logprobs`` if > 0).
        kl_loss_type: k1, k2, k3, k3+ (aliases kl, mse, low_var_kl, low_var_kl+).
        kl_input_clamp, kl_output_clamp: clamps of the KL estimator (None = off).
        entropy_coef: weight of the entropy bonus (loss -= coef * entropy; needs ``entropy``).

    Off-policy corrections against the rollout engine's logprobs mu (``offpolicy.py``):
        tis_level: None (off), ``"token"`` (w_t = pi_old_train/mu per token) or
            ``"sequence"`` (w_i = product over the sample's tokens).
        tis_mode: ``"truncate"`` (w <- min(w, tis_upper), TIS, Yao et al. 2025) or ``"mask"``
            (w <- 0 outside [tis_lower, tis_upper]: IcePop at token level with both bounds, MIS
            at token or sequence level with tis_lower None). A masked token leaves the loss and
            its normaliser (``offpolicy.off_policy_keep``).
        tis_upper, tis_lower: thresholds (tis_lower None = no lower bound).
        opsm_delta: DeepSeek-V3.2's off-policy sequence mask (None = off): samples with a
            negative advantage whose KL(mu || pi_theta) estimate exceeds delta leave the loss.

    Robustness:
        on_nonfinite: NaN/inf in a valid token's logprob/advantage/entropy: ``"raise"`` a
            ValueError (default; costs one host sync per call) or ``"mask"`` the token out of the
            loss (its weight becomes 0; denominators are unchanged) and report the count.
    """

    policy_loss_type: str = "ppo"
    ratio_level: str = "token"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = None
    log_ratio_clamp: float | None = 20.0
    loss_agg_mode: str = "token-mean"
    l_norm: float | None = None
    kl_coef: float = 0.0
    kl_loss_type: str = "k3"
    kl_input_clamp: float | None = 20.0
    kl_output_clamp: float | None = 10.0
    entropy_coef: float = 0.0
    tis_level: str | None = None
    tis_mode: str = "truncate"
    tis_upper: float = 2.0
    tis_lower: float | None = None
    opsm_delta: float | None = None
    on_nonfinite: str = "raise"

    def __post_init__(self):
        def choice(name, options, allow_none=False):
            value = getattr(self, name)
            if not (allow_none and value is None) and value not in options:
                raise ValueError(f"{name} must be one of {options}{' or None' if allow_none else ''}, got {value!r}")

        choice("policy_loss_type", POLICY_LOSS_TYPES)
        choice("ratio_level", RATIO_LEVELS)
        choice("loss_agg_mode", LOSS_AGG_MODES)
        choice("tis_level", TIS_LEVELS, allow_none=True)
        choice("tis_mode", TIS_MODES)
        choice("on_nonfinite", NONFINITE_MODES)
        object.__setattr__(self, "kl_loss_type", canonical_kl_type(self.kl_loss_type))
        finite_number(self.eps_low, "eps_low", low=0.0)
        finite_number(self.eps_high, "eps_high", low=0.0)
        finite_number(self.dual_clip_c, "dual_clip_c", low=1.0, low_open=True, allow_none=True)
        finite_number(self.log_ratio_clamp, "log_ratio_clamp", low=0.0, low_open=True, allow_none=True)
        finite_number(self.l_norm, "l_norm", low=0.0, low_open=True, allow_none=True)
        finite_number(self.kl_coef, "kl_coef", low=0.0)
        finite_number(self.kl_input_clamp, "kl_input_clamp", low=0.0, low_open=True, allow_none=True)
        finite_number(self.kl_output_clamp, "kl_output_clamp", low=0.0, low_open=True, allow_none=True)
        finite_number(self.entropy_coef, "entropy_coef")
        finite_number(self.tis_upper, "tis_upper", low=0.0, low_open=True)
        finite_number(self.tis_lower, "tis_lower", low=0.0, low_open=True, allow_none=True)
        if self.tis_lower is not None and self.tis_lower >= self.tis_upper:
            raise ValueError(f"tis_lower={self.tis_lower} must be < tis_upper={self.tis_upper}")
        finite_number(self.opsm_delta, "opsm_delta", low=0.0, allow_none=True)
        if self.policy_loss_type == "cispo":
            if self.ratio_level != "token":
                raise ValueError(f"ratio_level={self.ratio_level!r} is not defined for CISPO (a token-level IS weight)")
            if self.dual_clip_c is not None:
                raise ValueError("dual_clip_c applies to policy_loss_type='ppo' only (CISPO has no min/max clip)")
        if self.l_norm is not None and self.loss_agg_mode != "seq-mean-token-sum-norm":
            raise ValueError(
                f"l_norm={self.l_norm} is only used by loss_agg_mode='seq-mean-token-sum-norm', "
                f"got loss_agg_mode={self.loss_agg_mode!r}"
            )

    @property
    def masks_tokens(self) -> bool:
        """Whether an off-policy correction can take tokens out of the loss (and its normaliser)."""
        return (self.tis_level is not None and self.tis_mode == "mask") or self.opsm_delta is not None

    # ------------------------------------------------------------------ dict / alias input
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "PolicyLossConfig":
        """Build from a dict using our names or the usual aliases; unknown keys are errors.

        Aliases: ``clip_ratio_low``/``clip_ratio_high``/``clip_ratio`` (verl), ``epsilon``/
        ``epsilon_high`` (TRL), ``clip_ratio_c`` (verl dual clip), ``kl_loss_coef`` +
        ``use_kl_loss`` (verl), ``beta`` (TRL), ``entropy_coeff`` (verl), ``loss_mode`` (verl
        policy_loss.loss_mode: vanilla, gspo, cispo), kl names (low_var_kl, mse, kl). Giving the
        same field twice under different names is an error, not a silent override.
        """
        resolved = resolve_aliases(values)
        if values.get("use_kl_loss") and "kl_coef" not in resolved:
            raise ValueError("use_kl_loss=True needs kl_loss_coef (or kl_coef / beta)")
        return cls(**resolved)

    def replace(self, **changes) -> "PolicyLossConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


_SIMPLE_ALIASES = {
    "clip_ratio_low": "eps_low", "epsilon_low": "eps_low",
    "clip_ratio_high": "eps_high", "epsilon_high": "eps_high",
    "clip_ratio_c": "dual_clip_c", "kl_loss_coef": "kl_coef", "beta": "kl_coef",
    "entropy_coeff": "entropy_coef", "kl_penalty": "kl_loss_type",
}
_LOSS_MODES = {"vanilla": ("ppo", "token"), "gspo": ("ppo", "sequence_token"), "cispo": ("cispo", "token")}


def resolve_aliases(values: Mapping[str, Any]) -> dict[str, Any]:
    """Translate a dict with our field names and/or aliases into ``PolicyLossConfig`` field names.

    Only the fields mentioned (directly or through an alias) appear in the result, so it can
    also update an existing config (``recipe(name, **overrides)``). Unknown keys and the same
    field given twice with different values are ValueErrors.
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"expected a mapping of config values, got {type(values).__name__}")
    fields = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    out: dict[str, Any] = {}
    source: dict[str, str] = {}

    def put(name: str, value, key: str) -> None:
        if name in out and out[name] != value:
            raise ValueError(f"{key}={value!r} conflicts with {source[name]}={out[name]!r} (both set {name})")
        out[name] = value
        source[name] = key

    for key, value in values.items():
        if key in fields:
            put(key, value, key)
        elif key in _SIMPLE_ALIASES:
            put(_SIMPLE_ALIASES[key], value, key)
        elif key == "loss_mode":
            if value not in _LOSS_MODES:
                raise ValueError(f"loss_mode must be one of {sorted(_LOSS_MODES)}, got {value!r}")
            put("policy_loss_type", _LOSS_MODES[value][0], key)
            put("ratio_level", _LOSS_MODES[value][1], key)
        elif key not in ("clip_ratio", "epsilon", "use_kl_loss"):
            raise ValueError(f"unknown PolicyLossConfig key {key!r}")
    for key in ("clip_ratio", "epsilon"):  # a symmetric range fills only the sides not given explicitly
        if key in values:
            out.setdefault("eps_low", values[key])
            out.setdefault("eps_high", values[key])
    if "use_kl_loss" in values and not values["use_kl_loss"]:
        out["kl_coef"] = 0.0  # verl: the coefficient only counts when use_kl_loss is true
    if "dual_clip_c" in out and isinstance(out["dual_clip_c"], float) and math.isinf(out["dual_clip_c"]):
        out["dual_clip_c"] = None  # some configs write inf for "off"
    return out
