"""megatron_rl: reinforcement-learning post-training for Mixture-of-Experts models on Megatron-Core."""

__version__ = "0.1.0"
