"""`cona train --sbatch FILE`: a batch script that runs the controller on the first node of the job.

Slurm starts a batch script on the first node of the allocation, which is the head node cona expects
(`launcher: slurm`); the controller then starts one torchrun agent per node with `srun`.

The job is requeueable. `--signal=B:USR1@S` has Slurm signal the batch shell, which `exec`s the
controller, S seconds (`cluster.requeue_signal_s`) before the time limit; the controller then
checkpoints, puts the job back in the queue (`scontrol requeue`) and exits. When the script runs
again (requeued, preempted with `--requeue`, or submitted anew) and the run folder has a controller
state, it resumes the folder instead of starting over.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from cona_core.config import Config, ConfigError
from cona_core.rundir import RunDir


def sbatch_script(cfg: Config, train_argv: list[str], run_dir: Path, workdir: Path) -> str:
    """The script's text; `train_argv` are the `cona train` arguments it runs (paths absolute)."""
    c = cfg.cluster
    if c.launcher != "slurm":
        raise ConfigError(f"--sbatch: cluster.launcher is {c.launcher}; an sbatch script needs launcher slurm")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=cona-{run_dir.name}",
        f"#SBATCH --nodes={c.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={run_dir.absolute()}/slurm-%j.out",
        "#SBATCH --open-mode=append",  # a requeued job (same id) adds to its log instead of truncating it
        f"#SBATCH --signal=B:USR1@{c.requeue_signal_s}",
        "#SBATCH --requeue",
    ]
    lines += [f"#SBATCH {opt}" for opt in c.sbatch_options]
    cona = [shlex.quote(c.python or sys.executable), "-m", "cona_cli", "train"]
    folder = shlex.quote(str(run_dir.absolute()))
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(workdir))}",
        f"if [ -f {shlex.quote(str(RunDir(run_dir.absolute()).controller_state))} ]; then",
        "  " + " ".join(["exec", *cona, "--resume", folder]),
        "else",
        "  " + " ".join(["exec", *cona, *map(shlex.quote, train_argv)]),
        "fi",
    ]
    return "\n".join(lines) + "\n"
