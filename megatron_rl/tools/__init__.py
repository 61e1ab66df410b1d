"""The multi-rank command-line tools: `megatron-rl convert` (HF <-> torch_dist at any layout) and
`megatron-rl verify-hf`, and what they share (ranks.py). The repository's tools/ scripts call these."""
