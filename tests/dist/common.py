"""What every torchrun test script starts with."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cona_core.config import Config, config_from_json
from launch.data.corpus import CorpusInfo


def join() -> None:
    """Join the gloo group, one thread per rank."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)


def load_run(run_dir: Path) -> tuple[Config, CorpusInfo]:
    """The resolved config and corpus the pytest side wrote into `run_dir`."""
    cfg = config_from_json((run_dir / "config.resolved.json").read_text(), "test")
    return cfg, CorpusInfo.from_json((run_dir / "corpus.json").read_text())


def start() -> tuple[Path, Path, Config, CorpusInfo]:
    """Join the gloo group; the run folder and output path from sys.argv[1:3], with the run's resolved
    config and corpus."""
    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    join()
    return run_dir, out, *load_run(run_dir)
