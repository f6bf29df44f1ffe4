"""Benchmark: the cost of measuring the gradient noise scale every step (target: under 3%).

For layouts that exercise each collection path (DDP communication hook, our dp all-reduce under TP
and PP, the first micro-batch's gradient when dp = 1), two workers train the same layout side by side, one
with `train.gns` on and one off, alternating steps so host drift hits both alike; prints the median
step times and the overhead.

    python scripts/bench_gns_overhead.py [--config configs/tiny.yaml] [--gbs 32] [--steps 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAYOUTS = [
    "dp4-tp1-pp1-mbs2-gbs{g}",
    "dp2-tp2-pp1-mbs2-gbs{g}",
    "dp2-tp1-pp2-mbs2-gbs{g}",
    "dp1-tp1-pp4-mbs2-gbs{g}",
    "dp1-tp4-pp1-mbs4-gbs{g}",
]


def ranks_main(run_dir: Path, gbs: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from cona_core.config import config_from_json
    from cona_core.strategy import Strategy
    from launch.worker import Worker

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = config_from_json((run_dir / "config.resolved.json").read_text(), "bench")
    off = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, gns=False))
    rows = []
    for layout in LAYOUTS:
        s = Strategy.parse(layout.format(g=gbs))
        pair = {"on": Worker(cfg, run_dir, s, launch=1), "off": Worker(off, run_dir, s, launch=1)}
        times: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(steps + 2):
            for name, w in pair.items():
                t0 = time.perf_counter()
                w.train_step(False)
                if i >= 2:
                    times[name].append(time.perf_counter() - t0)
        paired = [a - b for a, b in zip(times["on"], times["off"])]  # neighbouring steps: drift cancels
        rows.append(
            {
                "layout": str(s),
                "on": statistics.median(times["on"]),
                "off": statistics.median(times["off"]),
                "diff": statistics.median(paired),
            }
        )
    if dist.get_rank() == 0:
        (run_dir / "gns_bench.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.yaml")
    ap.add_argument("--gbs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    from cona_cli.control.run_setup import make_policy, prepare_run_dir, resolve_config

    cfg, _ = make_policy(resolve_config(args.config, f"dp4-tp1-pp1-mbs2-gbs{args.gbs}", None, None))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        prepare_run_dir(run_dir, args.config, cfg)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={cfg.cluster.world}",
                __file__,
                "--ranks",
                str(run_dir),
                str(args.gbs),
                str(args.steps),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            sys.exit(f"the ranks failed (exit {proc.returncode}):\n{proc.stderr[-5000:]}")
        rows = json.loads((run_dir / "gns_bench.json").read_text())
    print(f"GNS measurement overhead, {args.config.name}, {args.steps} alternating steps per layout (median)")
    print(f"{'layout':<26} {'path':<22} {'off s/it':>9} {'on s/it':>9} {'overhead':>9}  (median paired difference)")
    for r in rows:
        dp = int(r["layout"].split("-")[0][2:])
        path = (
            ("DDP comm hook" if "tp1-pp1" in r["layout"] else "pre-all-reduce norm")
            if dp > 1
            else "first micro-batch hook"
        )
        print(f"{r['layout']:<26} {path:<22} {r['off']:>9.4f} {r['on']:>9.4f} {100 * r['diff'] / r['off']:>8.1f}%")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ranks":
        ranks_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
