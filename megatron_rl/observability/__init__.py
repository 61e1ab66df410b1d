"""What a user reads: the console line and metrics.jsonl (and wandb), the learning curve, and a
console quiet about our dependencies' chatter."""
