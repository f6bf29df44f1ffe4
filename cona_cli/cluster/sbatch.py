"""`cona train --sbatch FILE`: a batch script that runs the controller on the first node of the job.

Slurm starts a batch script on the first node of the allocation, which is the head node cona expects
(`launcher: slurm`); the controller then starts one torchrun agent per node with `srun`.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from cona_cli.config import Config, ConfigError


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
    ]
    lines += [f"#SBATCH {opt}" for opt in c.sbatch_options]
    python = c.python or sys.executable
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(workdir))}",
        " ".join(["exec", shlex.quote(python), "-m", "cona_cli", "train", *map(shlex.quote, train_argv)]),
    ]
    return "\n".join(lines) + "\n"
