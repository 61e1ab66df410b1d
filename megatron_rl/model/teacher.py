"""On-policy distillation's teacher held in the trainer (rl.teacher.mode: trainer): a frozen
Megatron-Core GPTModel of the teacher's own architecture, at the run's parallel layout.

    teacher = TeacherModel(teacher_config, runtime)    # teacher_config: the run's, model.hf_config = the teacher's
    load_teacher_weights(teacher, source)              # a HF directory or a megatron-rl checkpoint
    outputs = teacher.logprobs(batches)                # the same packed micro-batches as the student's

The KL reference swaps its copy into the live policy because it IS the policy's architecture; a
teacher of another size or depth cannot be swapped in, so it is a model of its own, built by the
same builder and loaded by the same bridge (the HF importer reads only this rank's slices; a
megatron-rl checkpoint reshards from whatever layout it was saved at). It has no DDP wrapper, no
gradient buffers and no optimizer: only its weights, on the device for the whole run. Its forward
is the policy's own (Policy.logprobs: the Megatron schedule over TP/PP/EP, vocabulary-parallel
logprobs), so every layout the policy runs, the teacher runs.
"""

from __future__ import annotations

from megatron_rl.config import RunConfig
from megatron_rl.model.builder import build_model
from megatron_rl.model.fp8 import micro_batch_multiple
from megatron_rl.model.policy import Policy
from megatron_rl.runtime.session import Runtime


class TeacherModel(Policy):
    """A Policy's forward (`logprobs`) without its training half: train_step, the optimizer and
    checkpoints are not there."""

    def __init__(self, config: RunConfig, runtime: Runtime):  # noqa: super().__init__ builds what training needs
        from megatron.core import parallel_state

        self.config, self.runtime = config, runtime
        built = build_model(config, runtime.device)
        self.raw_hf_config, self.arch, self.use_te, self.tconfig = (built.raw_hf_config, built.arch, built.use_te,
                                                                    built.tconfig)
        self.model = built.module
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.model.eval()
        self.optimizer = None
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.pad_to_multiple = micro_batch_multiple(
            config.model, config.parallel.tp if config.parallel.uses_sequence_parallel else 1)

    @property
    def module(self):
        return self.model

    def load_model(self, directory: str) -> None:
        """A megatron-rl checkpoint's torch_dist weights, at this or any other layout."""
        import torch
        from megatron.core import dist_checkpointing

        with torch.no_grad():
            state = dist_checkpointing.load(self.module.sharded_state_dict(), directory)
            self.module.load_state_dict(state)

    def train_step(self, *args, **kwargs):
        raise TypeError("the teacher is frozen: it has no optimizer")
