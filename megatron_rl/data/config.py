"""``DataConfig``: where prompts come from and how they are shown to the model.

Fields use only the types the run configuration loader understands (str, int, float, bool,
Literal, None, dict[str, str], nested dataclasses), so the section can sit in ``RunConfig`` as it is.

    data:
      train: data/gsm8k            # a save_to_disk directory (DatasetDict: the split below)
      train_split: train
      heldout: data/gsm8k          # the same directory, another split
      heldout_split: test
      prompt_key: question
      answer_key: answer
      columns: {level: difficulty} # dataset column -> keyword the reward functions get
      other_columns: drop          # only the columns above become metadata
      sampler: curriculum          # uniform (default) | curriculum (the Olmo 3 prompt curriculum)
      curriculum: {window: 16, pause_steps: 50}
      overlong_prompts: drop       # leave out prompts the engine could not take (default: error)
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.synthetic import TaskConfig

__all__ = ["CURRICULUM_BANDS", "CurriculumConfig", "DataConfig", "PROMPT_FORMATS", "LOADERS", "OVERLONG_PROMPTS",
           "SAMPLERS"]

PROMPT_FORMATS = ("raw", "chat")
LOADERS = ("auto", "builtin", "datasets")
SAMPLERS = ("uniform", "curriculum")
OVERLONG_PROMPTS = ("error", "drop")
# The curriculum's success-rate bands (Olmo 3; fixed): "unseen" holds the prompts with fewer than
# min_samples outcomes in their window, the others are [lower, upper) in percent (90-100 includes
# 100). These are also the metric keys data/band_share/<band>.
CURRICULUM_BANDS = ("unseen", "0-10", "10-30", "30-70", "70-90", "90-100")
# Per-prompt sampling weights (a prompt is drawn with probability proportional to its band's
# weight), so the 30-70 band, where a group most often holds both successes and failures, gets 4x
# the draws per prompt of its neighbours. 0-10 only counts with pause_steps: 0 (else those prompts
# are paused) and 90-100 only with retire: false (else they are retired). Unseen prompts get the
# neighbours' neutral 1.0: at the start every prompt is unseen, so the first epoch is uniform.
DEFAULT_BAND_WEIGHTS = {"unseen": 1.0, "0-10": 0.1, "10-30": 1.0, "30-70": 4.0, "70-90": 1.0, "90-100": 0.1}


@dataclass
class CurriculumConfig:
    """``data.sampler: curriculum``: per-prompt success rates over a rolling window of samples,
    success-rate bands, sampling weighted toward 30-70%, 0-10% paused, 90-100% retired
    (megatron_rl/data/curriculum.py)."""

    # Outcomes kept per prompt (samples, not groups): the last `window` samples' successes give
    # its success rate. 16 is two groups at group_size 8, fine enough (6.25%) to tell the 10% and
    # 90% edges apart, and short enough to follow a policy that improves.
    window: int = 16
    # Outcomes needed before the estimate counts (fewer: the "unseen" band). 8 is one group at
    # group_size 8: 0/8 and 1/8 are on either side of the 10% edge, 7/8 and 8/8 of the 90% edge.
    min_samples: int = 8
    # A sample is a success when its reward is >= this (the trainer's accuracy threshold).
    success_threshold: float = 0.5
    # Per-prompt weight of each band (CURRICULUM_BANDS); keys left out keep DEFAULT_BAND_WEIGHTS.
    band_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BAND_WEIGHTS))
    # Trainer steps a prompt that falls into 0-10% sits out before it comes back with a fresh
    # window (retried as unseen: its old outcomes are of an older policy). None: one epoch,
    # ceil(num_prompts / prompts_per_step) steps, as the Olmo 3 recipe pauses for epochs; 0: never
    # pause (0-10% prompts stay drawable at their band weight).
    pause_steps: int | None = None
    # Prompts that reach 90-100% are retired for good (true), or stay drawable at their band
    # weight (false).
    retire: bool = True
    # When the drawable prompts run out within a draw (all paused, retired or already drawn this
    # step): "unpause" brings paused prompts back early, earliest scheduled return first (fresh
    # windows), and only then draws retired prompts uniformly (every prompt retired: a uniform
    # sampler over the whole dataset, flagged by data/curriculum/all_retired); "uniform" draws the
    # shortfall uniformly from the paused and retired prompts alike without ending any pause.
    # Once every prompt was drawn in the same step, prompts repeat.
    when_exhausted: Literal["unpause", "uniform"] = "unpause"

    def validate(self, where: str = "data.curriculum") -> CurriculumConfig:
        for name in ("window", "min_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}.{name} must be an integer >= 1, got {value!r}")
        if self.min_samples > self.window:
            raise ConfigError(f"{where}.min_samples={self.min_samples} must be <= window={self.window} "
                              "(a window never holds more outcomes than that)")
        if not isinstance(self.success_threshold, (int, float)) or not math.isfinite(self.success_threshold):
            raise ConfigError(f"{where}.success_threshold must be a finite number, got {self.success_threshold!r}")
        if not isinstance(self.band_weights, dict):
            raise ConfigError(f"{where}.band_weights must be a mapping {{band: weight}}, got {self.band_weights!r}")
        for band, weight in self.band_weights.items():
            if band not in CURRICULUM_BANDS:
                close = difflib.get_close_matches(str(band), CURRICULUM_BANDS, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(f"{where}.band_weights: unknown band {band!r} (bands: "
                                  f"{', '.join(CURRICULUM_BANDS)}){hint}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                    math.isfinite(weight) and weight > 0):
                raise ConfigError(f"{where}.band_weights.{band} must be a number > 0, got {weight!r} "
                                  "(pause_steps / retire take bands out of the draw)")
        # Every band, in band order: what the run used is in its saved config.
        self.band_weights = {band: float(self.band_weights.get(band, DEFAULT_BAND_WEIGHTS[band]))
                             for band in CURRICULUM_BANDS}
        if self.pause_steps is not None and (isinstance(self.pause_steps, bool) or not isinstance(
                self.pause_steps, int) or self.pause_steps < 0):
            raise ConfigError(f"{where}.pause_steps must be an integer >= 0 or null (one epoch), "
                              f"got {self.pause_steps!r}")
        if not isinstance(self.retire, bool):
            raise ConfigError(f"{where}.retire must be true or false, got {self.retire!r}")
        if self.when_exhausted not in ("unpause", "uniform"):
            raise ConfigError(f"{where}.when_exhausted must be 'unpause' or 'uniform', got {self.when_exhausted!r}")
        return self
# Names the reward functions take as their own arguments (never metadata; see prompts.py).
RESERVED_NAMES = frozenset({"prompt", "response", "answer"})


@dataclass
class DataConfig:
    # "synthetic" (the task below, generated in memory from the seed), a local file (.jsonl,
    # .parquet, .json, .csv, .arrow) or a directory written by `datasets` save_to_disk. Nothing is
    # downloaded at run time: save a hub dataset to disk first.
    train: str = "synthetic"
    # Held-out prompts for evaluation: as train, or None. With train="synthetic" and no file, the
    # task's held-out split is used (disjoint from the train split).
    heldout: str | None = None
    # How files are read. "auto": .jsonl / .parquet by the built-in reader (fast, no extra import,
    # line-numbered errors), .json / .csv / .arrow files and save_to_disk directories through
    # `datasets`; "builtin": the built-in reader only; "datasets": everything through `datasets`
    # (`load_dataset(<builder>, data_files=...)` for files).
    loader: Literal["auto", "builtin", "datasets"] = "auto"
    # The split of a save_to_disk DatasetDict (a directory holding one Dataset has no splits).
    train_split: str = "train"
    heldout_split: str = "test"
    # Field names in the files; dotted names reach into nested fields ("reward_model.ground_truth").
    prompt_key: str = "prompt"
    # None: the dataset has no reference answers (rewards get answer=None).
    answer_key: str | None = "answer"
    # Metadata columns under another name: {dataset field (dotted allowed): keyword the reward
    # functions receive}. The renamed fields are no longer passed under their own names.
    columns: dict[str, str] = field(default_factory=dict)
    # "keep": every other top-level field is metadata too, under its own name; "drop": only the
    # fields listed in `columns` are (list a field as {name: name} to keep it as it is).
    other_columns: Literal["keep", "drop"] = "keep"
    # "raw": the prompt text as is (tokenizer's own BOS handling); "chat": the tokenizer's chat
    # template with the generation prompt appended (refused when the tokenizer has none).
    prompt_format: Literal["raw", "chat"] = "raw"
    # Chat format only: a system message put before every prompt.
    system_prompt: str | None = None
    # Prompts longer than rollout.max_model_len - rl.max_response_tokens tokens (as the engine gets
    # them: this prompt_format, the run's tokenizer), which the engine would refuse mid-run or
    # leave no room to answer. Counted in preflight, before any model is built. "error": refuse the
    # run naming the first few (file and line, tokens, limit); "drop": leave them out of the
    # dataset and print how many went from which file. Held-out prompts included.
    overlong_prompts: Literal["error", "drop"] = "error"
    # JSON Lines files: the longest line read, in bytes (a longer one is refused by file and line
    # after reading this much of it); Parquet files: the largest row (its fields' text). 16 MiB holds a million-token prompt at 16 bytes a token with
    # room for metadata; raise it for rows with larger metadata (test cases, documents).
    max_line_bytes: int = 16 * 1024 * 1024
    # Prompt order: reshuffled every epoch from this seed (None: the run's seed).
    shuffle: bool = True
    seed: int | None = None
    # "uniform": every prompt once per epoch, in the shuffled order above. "curriculum": the Olmo 3
    # prompt curriculum (the section below), drawn from the same seed.
    sampler: Literal["uniform", "curriculum"] = "uniform"
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    # Synthetic datasets: the task, its difficulty and the number of records per split. The
    # records depend on synthetic_seed only (not on the run's seed), so held-out accuracy of runs
    # with different seeds is measured on the same problems.
    # The default is the built-in tiny run's task: sums of two numbers in [0, 30] (961 problems,
    # 20% of them reserved for held-out evaluation), small enough for a 2-layer model to learn
    # in minutes on a CPU and hard enough that RL has room above the warm start.
    synthetic: TaskConfig = field(default_factory=lambda: TaskConfig(task="add", max_operand=30, heldout_fraction=0.2))
    num_train: int = 8192
    num_heldout: int = 150
    synthetic_seed: int = 0

    def validate(self, where: str = "data") -> DataConfig:
        if not self.train:
            raise ConfigError(
                f"{where}.train must be 'synthetic', a local prompt file or a `datasets` save_to_disk directory"
            )
        if self.loader not in LOADERS:
            raise ConfigError(f"{where}.loader must be one of {', '.join(LOADERS)}, got {self.loader!r}")
        for name in ("train_split", "heldout_split"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{where}.{name} must be a non-empty split name, got {getattr(self, name)!r}")
        if not self.prompt_key:
            raise ConfigError(f"{where}.prompt_key must be a non-empty field name")
        if self.answer_key == "":
            raise ConfigError(f"{where}.answer_key must be a field name or null")
        self._validate_columns(where)
        if self.prompt_format not in PROMPT_FORMATS:
            raise ConfigError(
                f"{where}.prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {self.prompt_format!r}"
            )
        if self.system_prompt is not None and self.prompt_format != "chat":
            raise ConfigError(f"{where}.system_prompt needs prompt_format='chat' (raw prompts have no system role)")
        if self.overlong_prompts not in OVERLONG_PROMPTS:
            raise ConfigError(f"{where}.overlong_prompts must be one of {', '.join(OVERLONG_PROMPTS)}, "
                              f"got {self.overlong_prompts!r}")
        if self.max_line_bytes < 1:
            raise ConfigError(f"{where}.max_line_bytes must be >= 1, got {self.max_line_bytes}")
        if self.num_train < 1:
            raise ConfigError(f"{where}.num_train must be >= 1, got {self.num_train}")
        if self.num_heldout < 0:
            raise ConfigError(f"{where}.num_heldout must be >= 0, got {self.num_heldout}")
        self.synthetic.validate(f"{where}.synthetic")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"{where}.sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.sampler == "curriculum" and not self.shuffle:
            raise ConfigError(f"{where}.shuffle=false asks for the dataset order, which data.sampler=curriculum "
                              "does not follow (it draws by success rate); use data.sampler=uniform")
        self.curriculum.validate(f"{where}.curriculum")
        return self

    def _validate_columns(self, where: str) -> None:
        if self.other_columns not in ("keep", "drop"):
            raise ConfigError(f"{where}.other_columns must be 'keep' or 'drop', got {self.other_columns!r}")
        if not isinstance(self.columns, dict):
            raise ConfigError(f"{where}.columns must be a mapping {{dataset field: keyword}}, got {self.columns!r}")
        seen: dict[str, str] = {}
        for source, target in self.columns.items():
            if not isinstance(source, str) or not source:
                raise ConfigError(f"{where}.columns: dataset field names must be non-empty strings, got {source!r}")
            # The target is a keyword argument of the reward functions, so it must be one.
            if not isinstance(target, str) or not target.isidentifier():
                raise ConfigError(f"{where}.columns.{source} must be a Python identifier, got {target!r}")
            if target in RESERVED_NAMES:
                raise ConfigError(
                    f"{where}.columns.{source}: {target!r} is a reward function's own argument "
                    f"({', '.join(sorted(RESERVED_NAMES))}); use data.prompt_key / data.answer_key, or another name"
                )
            if target in seen:
                raise ConfigError(f"{where}.columns: {seen[target]!r} and {source!r} are both renamed to {target!r}")
            seen[target] = source
