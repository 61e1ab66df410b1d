"""``RewardConfig``: which reward functions score a run, with what weights and limits.

    rewards:
      timeout_s: 10          # per sample and term, for functions run in worker processes
      batch_timeout_s: 60    # per call of a batched function (one chunk of the batch); default timeout_s
      num_workers: 2
      terms:
        - {name: math}
        - {name: format, weight: 0.1}
        - {name: my_pkg.rewards:judge, weight: 0.5, params: {strict: true}}
        - {name: my_pkg.rewards:judge_many, batched: true}   # lists in, a list out (functions.py)

``terms`` is a list of mappings, which ``RewardConfig.from_dict`` reads (the run configuration
loader reads scalar fields and nested dataclasses); errors name the dotted key, e.g.
``rewards.terms[1].weight``. The default scores synthetic-task records with their own verifiers.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.scoring import ISOLATIONS, RewardScorer, RewardTerm

__all__ = ["RewardConfig", "build_scorer"]

_TERM_KEYS = ("name", "weight", "params", "isolation", "label", "batched")


@dataclass
class RewardConfig:
    terms: list[RewardTerm] = field(default_factory=lambda: [RewardTerm("synthetic")])
    timeout_s: float = 10.0
    # The timeout of one call of a batched reward function (a chunk of the batch); None: timeout_s.
    batch_timeout_s: float | None = None
    num_workers: int = 2
    # A worker must be ready (imports done, functions resolved) within this many seconds.
    startup_timeout_s: float = 120.0

    def validate(self, where: str = "rewards") -> RewardConfig:
        if not self.terms:
            raise ConfigError(f"{where}.terms must list at least one reward function")
        for name in ("timeout_s", "startup_timeout_s", "batch_timeout_s"):
            value = getattr(self, name)
            if name == "batch_timeout_s" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{where}.{name} must be a number > 0, got {value!r}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ConfigError(f"{where}.num_workers must be an integer >= 1, got {self.num_workers!r}")
        return self

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, where: str = "rewards") -> RewardConfig:
        raw = dict(raw or {})
        known = [f.name for f in fields(cls)]
        _refuse_unknown(raw, known, where)
        values: dict[str, Any] = {k: v for k, v in raw.items() if k != "terms"}
        if "terms" in raw:
            if not isinstance(raw["terms"], list):
                raise ConfigError(f"{where}.terms must be a list of mappings, got {raw['terms']!r}")
            values["terms"] = [_term(item, f"{where}.terms[{i}]") for i, item in enumerate(raw["terms"])]
        return cls(**values).validate(where)


def _refuse_unknown(raw: Mapping[str, Any], known: list[str], where: str) -> None:
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"unknown key '{where}.{key}'{hint}")


def _term(item: Any, where: str) -> RewardTerm:
    if isinstance(item, str):
        item = {"name": item}
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where} must be a reward name or a mapping with 'name', got {item!r}")
    _refuse_unknown(item, list(_TERM_KEYS), where)
    if not isinstance(item.get("name"), str) or not item["name"]:
        raise ConfigError(f"{where}.name is required (a built-in reward or 'module:function')")
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ConfigError(f"{where}.weight must be a finite number, got {weight!r}")
    params = item.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}.params must be a mapping, got {params!r}")
    isolation = item.get("isolation", "auto")
    if isolation not in ISOLATIONS:
        raise ConfigError(f"{where}.isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    label = item.get("label")
    if label is not None and (not isinstance(label, str) or not label):
        raise ConfigError(f"{where}.label must be a non-empty string, got {label!r}")
    batched = item.get("batched")
    if batched is not None and not isinstance(batched, bool):
        raise ConfigError(f"{where}.batched must be true, false or null (detect from the function), got {batched!r}")
    return RewardTerm(item["name"], float(weight), dict(params), isolation, label, batched)


def build_scorer(config: RewardConfig, start_method: str | None = None) -> RewardScorer:
    """The scorer for a validated config (resolves every term now: ConfigError on a bad one)."""
    config.validate()
    return RewardScorer(config.terms, timeout_s=config.timeout_s, num_workers=config.num_workers,
                        startup_timeout_s=config.startup_timeout_s, start_method=start_method,
                        batch_timeout_s=config.batch_timeout_s)
