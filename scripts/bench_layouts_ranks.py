"""The torchrun side of bench_layouts.py: time every layout in one process group, and DCP save/load.

Layouts are timed in ROUNDS rounds, each visiting every layout in a new seeded random order and timing
STEPS steps of it, so that drift of the host over the run (and whatever one layout leaves behind for
the next) spreads over all layouts instead of biasing the ones measured last (an earlier version
timed every gbs-16 layout before every gbs-64 one, which made larger batches look slower per sample).

Usage: torchrun --standalone --nproc-per-node W scripts/bench_layouts_ranks.py RUN_DIR OUT_JSON GBS[,GBS] STEPS ROUNDS
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cona_cli.config import config_from_json
from cona_cli.strategy import Strategy
from launch.worker import Worker

MAX_MICROBATCHES = 16  # beyond this, tiny micro-batches only measure per-micro-batch overheads


def layouts(world: int, cfg, gbs_values: list[int]) -> list[Strategy]:
    out = []
    for gbs in gbs_values:
        for pp in (p for p in range(1, world + 1) if world % p == 0):
            for tp in (t for t in range(1, world // pp + 1) if (world // pp) % t == 0):
                dp = world // (pp * tp)
                for mbs in (1, 2, 4, 8):
                    s = Strategy(dp, tp, pp, mbs, gbs)
                    if not cfg.problems(s) and s.n_microbatches <= MAX_MICROBATCHES:
                        out.append(s)
    return out


def time_steps(w: Worker, steps: int, warmup: int) -> list[float]:
    times = []
    for i in range(steps + warmup):
        t0 = time.perf_counter()
        w.train_step(False)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def time_layouts(cfg, run_dir: Path, strategies: list[Strategy], steps: int, rounds: int) -> list[dict]:
    """Every layout's step times over `rounds` shuffled rounds (the same order on every rank)."""
    workers: dict[Strategy, Worker] = {}
    times: dict[Strategy, list[list[float]]] = {s: [] for s in strategies}
    for r in range(rounds):
        order = list(strategies)
        random.Random(r).shuffle(order)
        for s in order:
            first = s not in workers
            if first:
                workers[s] = Worker(cfg, run_dir, s, launch=1)
            # warm-up: two steps the first time (pipeline shape inference, allocator), one after a switch
            times[s].append(time_steps(workers[s], steps, 2 if first else 1))
    rows = []
    for s, per_round in times.items():
        flat = [t for r in per_round for t in r]
        rows.append({**s.to_dict(), "iter_s": statistics.median(flat), "min_s": min(flat), "max_s": max(flat),
                     "n": len(flat), "round_s": [statistics.median(r) for r in per_round]})
    return rows


def main() -> None:
    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    gbs_values = [int(g) for g in sys.argv[3].split(",")]
    steps, rounds = int(sys.argv[4]), int(sys.argv[5])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = config_from_json((run_dir / "config.resolved.json").read_text(), "bench")
    rows = time_layouts(cfg, run_dir, layouts(dist.get_world_size(), cfg, gbs_values), steps, rounds)
    # DCP save under one layout, load under another (resharding), timed.
    w = Worker(cfg, run_dir, Strategy.parse(f"dp{dist.get_world_size()}-tp1-pp1-mbs2-gbs{gbs_values[0]}"), launch=1)
    w.train_step(False)
    t0 = time.perf_counter()
    path = w.save("periodic")
    save_s = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    tp = 2 if dist.get_world_size() % 2 == 0 else 1
    w2 = Worker(cfg, run_dir, Strategy(dist.get_world_size() // tp, tp, 1, 2, gbs_values[0]), launch=2)
    t0 = time.perf_counter()
    w2.restore(path)
    load_s = time.perf_counter() - t0
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"rows": rows, "dcp": {"save_s": save_s, "load_s": load_s, "bytes": nbytes}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
