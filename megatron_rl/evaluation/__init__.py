"""Evaluation: pass@k, avg@n, maj@k and greedy accuracy over benchmark sets, for `megatron-rl eval` and `rl.eval`."""
