"""Code that runs inside vLLM's workers (injected as the worker extension): weight reloads,
in-place copies, the collective receive, and the engine's MoE routes for R3."""
