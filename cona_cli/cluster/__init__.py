"""Where the workers run: nodes, the local/ssh/slurm launchers that start one torchrun agent per node,
Slurm allocations and batch scripts, and the shared-storage probe."""
