"""Supervised warm start: next-token loss on reference responses before RL.

RL from a random tiny model never sees a reward (no sample is ever right), so the built-in
default first teaches the task's output format and some arithmetic on the training prompts'
targets (`record.metadata["target"]`, else the answer), then RL improves from partial accuracy.
Uses the policy's own optimizer at a fixed learning rate (`warm_start.lr`), outside the RL
learning-rate schedule; the schedule starts at the first RL update.
"""

from __future__ import annotations

from megatron_rl.algorithms import compute_step_normalizer
from megatron_rl.data import PromptSampler, encode_prompt
from megatron_rl.experience import pack_minibatch
from megatron_rl.model.packing import pack_by_token_budget


def warm_start(policy, tokenizer, dataset, config, runtime, log) -> list[float]:
    settings = config.warm_start
    sampler = PromptSampler(len(dataset), settings.batch_size, seed=config.seed + 7919)  # not the RL stream
    eos = tokenizer.eos_token_id
    losses = []
    for step in range(1, settings.steps + 1):
        records = dataset.select(sampler.next_batch())
        mine = records[runtime.dp_rank::runtime.dp_size]
        sequences, prompt_lengths = [], []
        for record in mine:
            prompt = encode_prompt(tokenizer, record.prompt, prompt_format=config.data.prompt_format,
                                   system_prompt=config.data.system_prompt)
            target = record.metadata.get("target", record.answer)
            response = tokenizer(str(target), add_special_tokens=False)["input_ids"] + [eos]
            sequences.append(prompt + response)
            prompt_lengths.append(len(prompt))
        batches = _pack(sequences, prompt_lengths, config.micro_batch_tokens, policy.pad_to_multiple)
        normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group,
                                             device=runtime.device).num_tokens

        def loss_fn(logprobs, entropy, batch):
            return -(logprobs * batch.loss_mask[0]).sum() / normalizer, {}

        result = policy.train_step(batches, loss_fn, lr=settings.lr)
        losses.append(result.loss)
        if step == 1 or step % max(1, settings.steps // 10) == 0 or step == settings.steps:
            log.message(f"warm start {step}/{settings.steps}  loss {result.loss:.4f}")
    return losses


def _pack(sequences, prompt_lengths, token_budget, pad):
    if not sequences:  # more DP ranks than samples: a zero-loss filler keeps the ranks in step
        return pack_minibatch([], token_budget, pad)
    return pack_by_token_budget(sequences, prompt_lengths, token_budget, pad)
