"""CPU time of a full strategy search (space enumeration + search) at one global batch.

Cases: GPT-3 1.3B on the paper's 16-GPU A6000 cluster; GPT-3 6.7B and 175B on 1024 A100s (128 nodes
x 8); each with the configured exhaustive threshold and with Bayesian optimisation forced.
Usage: .venv/bin/python scripts/bench_search.py
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from cona_cli.planner.calibration import Calibrator
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.search import plan
from cona_cli.planner.workload import Workload
from cona_cli.run_config import load_config
from cona_core.config import Config, config_from_dict

REPO = Path(__file__).resolve().parent.parent

GPT3_6B7 = {
    "model": {"n_layers": 32, "d_model": 4096, "n_heads": 32, "ffn": 16384, "seq_len": 2048},
    "data": {"vocab_size": 51200},
    "cluster": {"nodes": 128, "procs_per_node": 8, "backend": "nccl"},
    "search": {"hardware": "a100-80gb-8", "gbs_ladder": [2048], "precision": "bf16"},
}
GPT3_175B = {
    "model": {"n_layers": 96, "d_model": 12288, "n_heads": 96, "ffn": 49152, "seq_len": 2048},
    "data": {"vocab_size": 51200},
    "cluster": {"nodes": 128, "procs_per_node": 8, "backend": "nccl"},
    "search": {
        "hardware": "a100-80gb-8",
        "gbs_ladder": [1536],
        "mbs": [1, 2, 4, 8],
        "precision": "bf16",
        "recompute": True,
    },
}


def bench(name: str, cfg: Config, gbs: int) -> None:
    for label, exhaustive_max in (("configured", cfg.search.exhaustive_max), ("BO forced", 0)):
        c = dataclasses.replace(cfg, search=dataclasses.replace(cfg.search, exhaustive_max=exhaustive_max))
        hw = load_hardware(c.search.hardware)
        start = time.process_time()
        (result,) = plan(c, hw, Calibrator(Workload.from_config(c), hw, seed=c.search.seed), [gbs])
        cpu = time.process_time() - start
        best = result.best
        how = "exhaustive" if result.exhaustive else "BO"
        print(
            f"{name:<34} gbs {gbs:<5} {label:<10} {cpu:6.3f} s CPU  {how:<10} "
            f"evaluated {len(result.ranked):>3}/{result.n_feasible:<4} rejected {len(result.rejected):<4} "
            f"best {best.strategy} {best.time_s:.3g} s/iter"
            if best
            else "no feasible strategy"
        )


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    bench("GPT-3 1.3B, 2x8 A6000 (16 GPUs)", load_config(REPO / "configs" / "gpt3-1.3b-a6000.yaml"), 128)
    bench("GPT-3 6.7B, 128x8 A100 (1024 GPUs)", config_from_dict(GPT3_6B7, "gpt3-6.7b"), 2048)
    bench("GPT-3 175B, 128x8 A100 (1024 GPUs)", config_from_dict(GPT3_175B, "gpt3-175b"), 1536)


if __name__ == "__main__":
    main()
