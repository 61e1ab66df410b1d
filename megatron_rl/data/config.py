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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.synthetic import TaskConfig

__all__ = ["DataConfig", "PROMPT_FORMATS", "LOADERS"]

PROMPT_FORMATS = ("raw", "chat")
LOADERS = ("auto", "builtin", "datasets")
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
    # Prompt order: reshuffled every epoch from this seed (None: the run's seed).
    shuffle: bool = True
    seed: int | None = None
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
        if self.num_train < 1:
            raise ConfigError(f"{where}.num_train must be >= 1, got {self.num_train}")
        if self.num_heldout < 0:
            raise ConfigError(f"{where}.num_heldout must be >= 0, got {self.num_heldout}")
        self.synthetic.validate(f"{where}.synthetic")
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
