"""Prompt data: datasets (JSONL, Parquet, `datasets` save_to_disk directories and files, synthetic
tasks), the resumable sampler, chat templates and the tiny character tokenizer.

Public API (what the trainer calls):

* ``DataConfig`` and ``load_datasets(config) -> (train, heldout | None)`` of ``PromptRecord``
  (``prompt``, ``answer``, ``metadata``), ``load_heldout(config)`` the held-out one alone;
  ``load_prompts(path, prompt_key=, answer_key=)``;
  ``hf_datasets.load_hf_prompts(path, split=, ...)`` (imports ``datasets`` when called);
  ``synthetic_datasets(task_config, num_train=, num_heldout=, seed=)``; ``prompt_text(prompt)``.
* ``PromptSampler(num_prompts, batch_size, seed=, shuffle=)``: ``next_batch()``, ``take(n)``,
  ``state_dict()`` / ``load_state_dict()``; ``CurriculumSampler`` (``data.sampler: curriculum``, the
  Olmo 3 success-rate curriculum) with the same calls plus ``observe(index, rewards)``, ``step()``,
  ``band_metrics(indices)``, ``pop_notices()`` (no-ops on ``PromptSampler``);
  ``build_sampler(data_config, num_prompts, batch_size, seed)`` picks one.
* ``encode_prompt(tokenizer, prompt, prompt_format=, system_prompt=)`` (and ``render_prompt``).
* ``build_char_tokenizer()`` / ``write_char_tokenizer(directory)``: the synthetic tasks' tokenizer.

Importing this package does not import torch, transformers or datasets (the tokenizer module
imports transformers, and ``hf_datasets`` imports datasets, when called).
"""

from megatron_rl.data.chat import encode_prompt, render_prompt
from megatron_rl.data.config import CurriculumConfig, DataConfig
from megatron_rl.data.curriculum import CurriculumSampler
from megatron_rl.data.prompts import (PromptDataset, PromptRecord, get_field, load_datasets, load_heldout,
                                      load_prompts, prompt_text, synthetic_datasets)
from megatron_rl.data.sampler import PromptSampler, build_sampler
from megatron_rl.data.tokenizer import ALPHABET, build_char_tokenizer, save_tokenizer, write_char_tokenizer

__all__ = [
    "ALPHABET",
    "CurriculumConfig",
    "CurriculumSampler",
    "DataConfig",
    "PromptDataset",
    "PromptRecord",
    "PromptSampler",
    "build_char_tokenizer",
    "build_sampler",
    "encode_prompt",
    "get_field",
    "load_datasets",
    "load_heldout",
    "load_prompts",
    "prompt_text",
    "render_prompt",
    "save_tokenizer",
    "synthetic_datasets",
    "write_char_tokenizer",
]
