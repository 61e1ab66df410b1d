"""`megatron-rl plan`: the parallel layouts of a model on a cluster, and what each holds per GPU.

    meta_model.py   per-rank parameter lists of the real Megatron model, built on the meta device
    state_bytes.py  parameters, gradients and optimizer state per rank, by Megatron's buffer layout
    activations.py  activation memory of a micro-batch (an estimate, term by term)
    planner.py      candidate layouts (preflight's check), per-GPU memory, engines, push, ranking
    measured.py     the measured step-time table (plan --measured): its key, its lines, their checks
    step_time.py    a layout's training time per RL step from the table's line of its per-GPU shape
    report.py       the table, JSON, and `megatron-rl launch slurm` overrides
    command.py      the command line
"""
