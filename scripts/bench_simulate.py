"""Wall time of the simulator: one 10,000-step run of policy cona in Kaplan's world, and the whole
`cona simulate` table (cona, static-auto, every rung, both optima) of a config.

Usage: .venv/bin/python scripts/bench_simulate.py [--config configs/gpt3-1.3b-a6000.yaml] [--steps 10000]
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "gpt3-1.3b-a6000.yaml")
    parser.add_argument("--steps", type=int, default=10_000, help="steps of the one timed run")
    parser.add_argument("--seeds", type=int, default=5, help="noise seeds of the timed table")
    args = parser.parse_args()

    from cona_cli.control.cona_policy import ConaPolicy
    from cona_cli.planner.hardware import load_hardware
    from cona_cli.planner.space import gbs_ladder
    from cona_cli.planner.workload import Workload
    from cona_cli.run_config import load_config
    from cona_cli.simulate.law import KaplanDynamics, KaplanLaw
    from cona_cli.simulate.world import Simulation, WorldSpec

    cfg = load_config(args.config)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=args.steps, max_time=None))
    hw = load_hardware(cfg.search.hardware)
    shape = Workload.from_config(cfg).shape
    law = KaplanLaw(shape.n_layers * shape.layer_params, cfg.model.seq_len)
    sim = Simulation(cfg, WorldSpec(KaplanDynamics(law, gbs_ladder(cfg)[0]), hw))
    t0 = time.perf_counter()
    curve = sim.run(ConaPolicy(cfg, hw), law.loss_floor() + 1e-6, seed=0)
    run_s = time.perf_counter() - t0
    print(
        f"one run of policy cona: {len(curve.losses) - 1 - len(curve.switches)} steps, {len(curve.switches)} "
        f"switches in {run_s:.2f} s ({run_s / args.steps * 1e3:.2f} ms per step; target <= 10 s per 10,000)"
    )
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "cona_cli", "simulate", str(args.config), "--seeds", str(args.seeds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    table_s = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench_simulate: cona simulate failed: {proc.stderr.strip().splitlines()[-1]}")
    print(f"the whole table ({args.config.name}, {args.seeds} seeds): {table_s:.1f} s (target <= 60 s)")


if __name__ == "__main__":
    main()
