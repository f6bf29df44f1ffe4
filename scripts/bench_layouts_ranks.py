"""The torchrun side of bench_layouts.py: time every layout in one process group, and DCP save/load.

Layouts are timed in ROUNDS rounds, each visiting every layout in a new seeded random order and timing
at least STEPS steps and at least MIN_S seconds of it, so that drift of the host over the run (and
whatever one layout leaves behind for the next) spreads over all layouts instead of biasing the ones
measured last (an earlier version timed every gbs-16 layout before every gbs-64 one, which made larger
batches look slower per sample). The time floor gives fast layouts many steps: a 50 ms step on 4
processes sharing 2 cores jitters by +-30% with the scheduler, a 2 s step averages that out itself.

Usage: torchrun --standalone --nproc-per-node W scripts/bench_layouts_ranks.py \
    RUN_DIR OUT_JSON GBS[,GBS] STEPS ROUNDS MIN_S [--mbs 1,2,4,8]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import launch.layout as layout_module
from cona_core.config import config_from_json
from cona_core.strategy import Strategy
from launch.worker import Worker

MAX_MICROBATCHES = 16  # beyond this, tiny micro-batches only measure per-micro-batch overheads


def layouts(world: int, cfg, gbs_values: list[int], mbs_values: tuple[int, ...] = (1, 2, 4, 8)) -> list[Strategy]:
    out = []
    for gbs in gbs_values:
        for pp in (p for p in range(1, world + 1) if world % p == 0):
            for tp in (t for t in range(1, world // pp + 1) if (world // pp) % t == 0):
                dp = world // (pp * tp)
                for mbs in mbs_values:
                    s = Strategy(dp, tp, pp, mbs, gbs)
                    if not cfg.problems(s) and s.n_microbatches <= MAX_MICROBATCHES:
                        out.append(s)
    return out


def time_steps(w: Worker, steps: int, warmup: int, min_s: float) -> list[float]:
    """Times of at least `steps` steps lasting at least `min_s` in all, after `warmup` untimed ones.

    Rank 0 decides when to stop (ranks must agree on the number of collective-bearing steps)."""
    for _ in range(warmup):
        w.train_step(False)
    times: list[float] = []
    go = torch.ones(1)
    while go.item():
        t0 = time.perf_counter()
        w.train_step(False)
        times.append(time.perf_counter() - t0)
        go.fill_(float(len(times) < steps or sum(times) < min_s))
        dist.broadcast(go, 0)
    return times


def share_meshes() -> None:
    """Build each mesh shape once. A launch only ever has one layout's process groups; with the
    groups of 34 other layouts left open (gloo, 283 threads per rank), steps ran 11-39% slower here.
    Destroying them instead breaks later meshes, which resolve cached group names."""
    build, meshes = layout_module.build_mesh, {}

    def shared(strategy: Strategy, device: str):
        key = (strategy.pp, strategy.dp, strategy.tp, device)
        if key not in meshes:
            meshes[key] = build(strategy, device)
        return meshes[key]

    layout_module.build_mesh = shared  # what build_layout (each Worker's model and mesh) calls


def time_layouts(cfg, run_dir: Path, strategies: list[Strategy], steps: int, rounds: int, min_s: float) -> list[dict]:
    """Every layout's step times over `rounds` shuffled rounds (the same order on every rank), each
    measured in a fresh worker with nothing else alive, as in a launch."""
    times: dict[Strategy, list[list[float]]] = {s: [] for s in strategies}
    for r in range(rounds):
        order = list(strategies)
        random.Random(r).shuffle(order)
        for s in order:
            w = Worker(cfg, run_dir, s, launch=1)
            # two warm-up steps: pipeline shape inference, allocator
            times[s].append(time_steps(w, steps, 2, min_s))
            del w
            gc.collect()
    rows = []
    for s, per_round in times.items():
        flat = [t for r in per_round for t in r]
        rows.append(
            {
                **s.to_dict(),
                "iter_s": statistics.median(flat),
                "min_s": min(flat),
                "max_s": max(flat),
                "n": len(flat),
                "round_s": [statistics.median(r) for r in per_round],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a prepared run folder (config.resolved.json, corpus.json)")
    ap.add_argument("out", type=Path, help="where rank 0 writes the rows and DCP figures (JSON)")
    ap.add_argument("gbs", help="comma-separated global batch sizes")
    ap.add_argument("steps", type=int, help="least timed steps per layout and round")
    ap.add_argument("rounds", type=int, help="rounds over all layouts")
    ap.add_argument("min_s", type=float, help="least timed seconds per layout and round")
    ap.add_argument("--mbs", default="1,2,4,8", help="comma-separated micro-batch sizes to time")
    args = ap.parse_args()
    run_dir, out = args.run_dir, args.out
    gbs_values = [int(g) for g in args.gbs.split(",")]
    steps, rounds, min_s = args.steps, args.rounds, args.min_s
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = config_from_json((run_dir / "config.resolved.json").read_text(), "bench")
    share_meshes()
    mbs_values = tuple(int(m) for m in args.mbs.split(","))
    strategies = layouts(dist.get_world_size(), cfg, gbs_values, mbs_values)
    rows = time_layouts(cfg, run_dir, strategies, steps, rounds, min_s)
    # DCP save under one layout, load under another (resharding), timed.
    w = Worker(cfg, run_dir, Strategy.parse(f"dp{dist.get_world_size()}-tp1-pp1-mbs2-gbs{gbs_values[0]}"), launch=1)
    w.train_step(False)
    t0 = time.perf_counter()
    path = w.checkpointer.save("periodic")
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
