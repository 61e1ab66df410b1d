"""Supervised warm start: next-token loss on reference responses before RL.

RL from a random tiny model never sees a reward (no sample is ever right), so the built-in
default first teaches the task's output format and some arithmetic on the training prompts'
targets (`record.metadata["target"]`, else the answer), then RL improves from partial accuracy.
Uses the policy's own optimizer at a fixed learning rate (`warm_start.lr`), outside the RL
learning-rate schedule; the schedule starts at the first RL update.

One function, two callers: `megatron-rl train` runs it before RL when `warm_start.steps` > 0
(inside the trainer, so the RL run continues with the warm start's optimizer state), and
`megatron-rl sft` (megatron_rl/train/sft.py) runs it alone and writes a checkpoint that `train`
starts from (`checkpoint.init_from=DIR warm_start.steps=0`).

A stop signal (SIGTERM, SIGUSR1: train/stop_signals.py) ends `train`'s warm start after the step
in flight (`stop`, asked after every step): a part of a warm start is not a state any checkpoint
resumes exactly, and a warm start may take minutes (tiny_reasoning's 1000 steps) where SLURM kills
a job some 30 s after its SIGTERM. The same command then starts the run again from the beginning.
"""

from __future__ import annotations

from megatron_rl.errors import ConfigError  # this module imports no torch at the top (sft's checks)


class WarmStartStopped(Exception):
    """A stop signal ended the warm start after its step `step` of `total`; nothing of it is saved."""

    def __init__(self, signal_name: str, step: int, total: int):
        super().__init__(f"stopped by {signal_name} in the warm start, after its step {step} of {total}")
        self.signal_name, self.step, self.total = signal_name, step, total


def target_of(record):
    """The reference response trained on: `metadata["target"]`, else the answer (None: none).
    Multi-turn runs train on `metadata["demonstration"]` where a record has one
    (agents/demonstrations.py)."""
    return record.metadata.get("target", record.answer)


def check_targets(dataset, where: str = "data") -> None:
    """Every training prompt needs a reference response; called before any model is built."""
    for index, record in enumerate(dataset):
        if target_of(record) is None and not record.metadata.get("demonstration"):
            raise ConfigError(
                f"{where}.answer_key: training record {index} of {getattr(dataset, 'source', 'data.train')} has no "
                "reference response (an answer, or a 'target' field) for the supervised warm start; set "
                "data.answer_key, or warm_start.steps=0 for train"
            )


def warm_start(policy, tokenizer, dataset, config, runtime, log, on_step=None, label: str = "warm start",
               stop=None) -> list[float]:
    """`warm_start.steps` optimizer steps; returns the step losses. `on_step(step, result)` is
    called after each step (result: the policy's StepResult); `log.message` prints progress.
    `stop()`: collective, the stop signal any rank received (None: none); asked after each step,
    a signal raises WarmStartStopped on every rank at the same step."""
    from megatron_rl.algorithms import compute_step_normalizer
    from megatron_rl.data import PromptSampler, encode_prompt

    from megatron_rl.train.update_guard import WARM_START, UpdateGuard

    settings = config.warm_start
    guard = UpdateGuard(config.rl.max_bad_steps, notify=log.message, weight_norm=policy.weight_norm(),
                        max_norm_growth=config.rl.max_weight_norm_growth, phase=WARM_START)
    sampler = PromptSampler(len(dataset), settings.batch_size, seed=config.seed + 7919)  # not the RL stream
    eos = tokenizer.eos_token_id
    conversation = _conversation_encoder(config, tokenizer, policy)
    losses = []
    for step in range(1, settings.steps + 1):
        records = dataset.select(sampler.next_batch())
        mine = records[runtime.dp_rank::runtime.dp_size]
        sequences, prompt_lengths, masks = [], [], []
        for record in mine:
            if conversation is not None and record.metadata.get("demonstration"):
                ids, mask = conversation(record)
                prompt_length = mask.index(1)
                sequences.append(ids)
                prompt_lengths.append(prompt_length)
                masks.append(mask[prompt_length:])  # observations inside the demonstration: 0
                continue
            prompt = encode_prompt(tokenizer, record.prompt, prompt_format=config.data.prompt_format,
                                   system_prompt=config.data.system_prompt)
            response = tokenizer(str(target_of(record)), add_special_tokens=False)["input_ids"] + [eos]
            sequences.append(prompt + response)
            prompt_lengths.append(len(prompt))
            masks.append(None)
        batches = _pack(sequences, prompt_lengths, config.micro_batch_tokens, policy.pad_to_multiple)
        _mask_observations(batches, masks)
        normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group,
                                             device=runtime.device).num_tokens

        def loss_fn(logprobs, entropy, batch):
            return -(logprobs * batch.loss_mask[0]).sum() / normalizer, {}

        # The demonstrations' likelihood under the model's own distribution (temperature 1): the
        # sampling temperature is RL's (rl.temperature, train/update.py).
        result = policy.train_step(batches, loss_fn, lr=settings.lr, temperature=1.0)
        guard.check(step, 0, result)  # a NaN loss or exploding weights would otherwise go on silently
        losses.append(result.loss)
        if on_step is not None:
            on_step(step, result)
        if step == 1 or step % max(1, settings.steps // 10) == 0 or step == settings.steps:
            log.message(f"{label} {step}/{settings.steps}  loss {result.loss:.4f}")
        if stop is not None and step < settings.steps and (received := stop()):
            raise WarmStartStopped(received, step, settings.steps)
    return losses


def _conversation_encoder(config, tokenizer, policy):
    """Multi-turn runs (rollout.environment / rollout.tools): a record's prompt and demonstration
    as (ids, mask) through the chat-format adapter rollouts use; None for single-turn runs."""
    if not config.rollout.multi_turn:
        return None
    from megatron_rl.agents.chat_format import ChatFormat
    from megatron_rl.agents.demonstrations import demonstration_ids
    from megatron_rl.agents.tools import ToolRegistry

    chat = ChatFormat.for_tokenizer(tokenizer, policy.raw_hf_config.get("model_type"))
    tools = ToolRegistry.from_paths(config.rollout.tools).schemas() if config.rollout.tools else None
    return lambda record: demonstration_ids(chat, record, system_prompt=config.data.system_prompt, tools=tools)


def _mask_observations(batches, masks) -> None:
    """Per-token masks of multi-turn demonstrations onto the packed loss masks: position p of a
    sample's response is predicted at the packed position before it."""
    for batch in batches:
        for (start, prompt, length), sample_id in zip(batch.spans, batch.sample_ids):
            mask = masks[sample_id]
            if mask is not None:
                batch.loss_mask[0, start + prompt - 1: start + length - 1] = batch.loss_mask.new_tensor(mask)


def _pack(sequences, prompt_lengths, token_budget, pad):
    from megatron_rl.train.experience import pack_minibatch
    from megatron_rl.model.packing import pack_by_token_budget

    if not sequences:  # more DP ranks than samples: a zero-loss filler keeps the ranks in step
        return pack_minibatch([], token_budget, pad)
    return pack_by_token_budget(sequences, prompt_lengths, token_budget, pad)
