"""``DataConfig``: where prompts come from and how they are shown to the model.

Fields use only the types the run configuration loader understands (str, int, float, bool,
Literal, None, nested dataclasses), so the section can sit in ``RunConfig`` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.synthetic import TaskConfig

__all__ = ["DataConfig", "PROMPT_FORMATS"]

PROMPT_FORMATS = ("raw", "chat")


@dataclass
class DataConfig:
    # "synthetic" (the task below, generated in memory from the seed) or a .jsonl / .parquet file.
    train: str = "synthetic"
    # Held-out prompts for evaluation: a file, or None. With train="synthetic" and no file, the
    # task's held-out split is used (disjoint from the train split).
    heldout: str | None = None
    # Field names in the files; dotted names reach into nested fields ("reward_model.ground_truth").
    prompt_key: str = "prompt"
    # None: the dataset has no reference answers (rewards get answer=None).
    answer_key: str | None = "answer"
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
            raise ConfigError(f"{where}.train must be 'synthetic' or a path to a .jsonl/.parquet file")
        if not self.prompt_key:
            raise ConfigError(f"{where}.prompt_key must be a non-empty field name")
        if self.answer_key == "":
            raise ConfigError(f"{where}.answer_key must be a field name or null")
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
