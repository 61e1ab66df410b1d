"""Repairs that let the CPU run what was written for GPUs: megatron-core patched while the device is
the CPU (megatron_patches.py), and vLLM CPU-build fixes (vllm_repairs.py)."""
