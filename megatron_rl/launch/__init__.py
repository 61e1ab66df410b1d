"""Starting jobs: on this machine with torchrun (`local.py`), on a SLURM cluster from an sbatch
template (`slurm.py`), and what runs inside the allocation (`node.py`: one torchrun per node;
`rollout_node.py`: the vLLM servers of a rollout node). The sbatch templates are package data
(`templates/`, linked from the repository's `slurm/`, where users read and edit them)."""
