"""`megatron-rl train` with a divergence injected at a chosen step (a test stand-in for the real
causes: a reward scale gone wrong, a learning rate that blows up). Everything else is the real
trainer, policy, optimizer and checkpoints.

    python injected_divergence.py nan_from=2 | explode_at=3   -- megatron-rl train arguments

nan_from=K: from RL step K on, NaN times the logprobs' sum is added to the loss, so every
gradient is NaN (through the real backward). explode_at=K: step K's updates use learning rate 1
(the most the config allows), so Adam moves every weight by up to about 1: finite weights, their
norm many times what it was (the tiny model's weights are about 0.02 each).
"""

import sys

import megatron_rl.train.trainer as trainer
import megatron_rl.train.update as update
from megatron_rl.cli import main

current = {"step": 0}


def inject(fault: str) -> None:
    kind, step = fault.split("=")
    step = int(step)
    make_loss_fn, optimizer_step = update.make_loss_fn, trainer.Policy.optimizer_step

    def loss_fn_for_step(*args, policy_version, **kwargs):
        current["step"] = policy_version + 1
        loss_fn = make_loss_fn(*args, policy_version=policy_version, **kwargs)
        if current["step"] < step or (kind == "explode_at" and current["step"] > step):
            return loss_fn
        # Through the logprobs, not the loss: without a warm start every reward is 0, and a batch
        # whose advantages are all 0 has a zero gradient whatever multiplies its loss. explode_at
        # adds a small likelihood term so that Adam has a direction to move along.
        extra = float("nan") if kind == "nan_from" else -1e-3

        def injected_loss(logprobs, entropy, batch):
            loss, metrics = loss_fn(logprobs, entropy, batch)
            return loss + logprobs.sum() * extra, metrics

        return injected_loss

    def exploding_step(self, loss, lr=None):
        if kind == "explode_at" and current["step"] == step and lr is None:
            lr = 1.0
        return optimizer_step(self, loss, lr=lr)

    update.make_loss_fn = loss_fn_for_step
    trainer.Policy.optimizer_step = exploding_step


if __name__ == "__main__":
    separator = sys.argv.index("--")
    for fault in sys.argv[1:separator]:
        inject(fault)
    sys.exit(main(sys.argv[separator + 1:]))
