"""A run's checkpoints: the manager (resume choice, cadence, the KL reference, the final export), one
checkpoint on disk (store.py: asynchronous writes, CRC-32 manifest), the Megatron checkpoint format
every tool reads (format.py), and atomic output directories (atomic_dir.py)."""
