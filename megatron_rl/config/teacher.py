"""rl.teacher: on-policy distillation's teacher (train/teacher.py uses it).

    rl:
      distill_coef: 1.0            # 1: distillation alone; 0.5: half reward advantage, half teacher
      teacher:
        source: runs/teacher/hf_model   # a Hugging Face directory, or (mode: trainer) a megatron-rl checkpoint
        mode: server               # server: a vLLM server scores the tokens; trainer: a frozen model in the ranks

The student samples, the teacher scores every sampled token, and the token's advantage becomes
(1 - distill_coef) x the reward's advantage + distill_coef x (log pi_teacher - log pi_student)
(algorithms/distill.py). The checks that need the teacher's files (the same vocabulary as the
student, a context that holds the student's sequences) run at start-up (train/teacher.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_rl.errors import ConfigError

TeacherMode = Literal["server", "trainer"]


@dataclass
class TeacherConfig:
    # A Hugging Face model directory (config.json, weights, tokenizer files), or, with mode:
    # trainer, a megatron-rl checkpoint in any form checkpoint.init_from takes (any layout).
    source: str | None = None
    # server: a vLLM server returns the teacher's log-probabilities of the student's tokens
    # (prompt_logprobs over prompt + response; started on the driver from `source` unless
    # server_url names a running one). trainer: the teacher is a frozen Megatron model in the
    # training ranks, at the run's parallel layout, its weights on the device for the whole run.
    mode: TeacherMode = "server"
    # mode: server: a running vLLM server that serves `source` (its tokenizer files are still read
    # from `source` for the vocabulary check); null: start one on the driver.
    server_url: str | None = None
    # mode: server, a server started here: its context length; null: rollout.max_model_len + 1
    # (the longest student sequence plus the one token a completion request must leave room for).
    max_model_len: int | None = None
    # mode: server, a server started here: its dtype ("auto": the rollout engines' dtype).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    # Measure the teacher's held-out accuracy once at start (mode: server, single-turn runs: the
    # teacher's own server samples; a trainer-held teacher has no engine to sample from).
    eval: bool = True

    def validate(self, where: str) -> None:
        if not self.source:
            raise ConfigError(f"{where}.source is required: the teacher's Hugging Face directory (or, with "
                              f"mode: trainer, a megatron-rl checkpoint)")
        if self.mode not in ("server", "trainer"):
            raise ConfigError(f"{where}.mode: {self.mode!r} is not one of 'server', 'trainer'")
        if self.mode == "trainer":
            given = [name for name in ("server_url", "max_model_len") if getattr(self, name) is not None]
            if given:
                section = where.rsplit(": ", 1)[-1]
                raise ConfigError(f"{where}.{given[0]} has no effect with {section}.mode=trainer (the teacher is held "
                                  f"in the training ranks); remove it or set mode: server")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool) or self.max_model_len < 2):
            raise ConfigError(f"{where}.max_model_len must be an integer >= 2 (or null), got {self.max_model_len!r}")
        for name in ("startup_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{where}.{name} must be a number > 0, got {value!r}")


def validate_distillation(teacher: TeacherConfig | None, distill_coef: float | None, where: str) -> None:
    """rl.teacher and rl.distill_coef together: the coefficient only with a teacher, in (0, 1].
    `where`: "SOURCE: rl" (the message starts with it; the section's bare name is used inside)."""
    section = where.rsplit(": ", 1)[-1]
    if teacher is None:
        if distill_coef is not None:
            raise ConfigError(f"{where}.distill_coef={distill_coef} has no effect without {section}.teacher; set "
                              f"{section}.teacher.source (and mode) or remove distill_coef")
        return
    teacher.validate(f"{where}.teacher")
    if distill_coef is not None and not 0 < distill_coef <= 1:
        raise ConfigError(f"{where}.distill_coef must be in (0, 1] (1: distillation alone; the reward's advantage "
                          f"gets 1 - distill_coef), got {distill_coef}")
