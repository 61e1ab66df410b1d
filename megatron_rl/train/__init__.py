"""The RL loop and what only it uses: the trainer (trainer.py), what a step trains on (collect.py,
async_rollout.py), scoring (scoring.py), experience and loss (experience.py), MoE routing across a
step (routing_replay.py), evaluation, stop signals, preflight; `megatron-rl sft` and `smoke`."""
