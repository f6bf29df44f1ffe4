"""Benchmark: what periodic checkpoints cost training (target: at most 2 % of wall time by default).

torchrun ranks train one strategy of a config and, in rounds, take a synchronous checkpoint (training
waits for the whole write) and a background one (`train.checkpoint_async`: training waits for the copy
to host memory, then trains on while the shards are written, and commits once they are), interleaved so
host drift hits both alike. Prints the median step time, each kind's blocking time and the slowdown of
the steps that ran while a background write was in flight, the overhead at the shipped interval
(`train.checkpoint_interval_s`, capped at `train.checkpoint_max_share`) and at a checkpoint every
`--every` seconds, and what the same would be for a config's model on a GPU profile (`--scale-to`), from
the bytes a checkpoint holds and stated storage and copy rates.

    python scripts/bench_checkpoint.py [--config configs/wikitext2-commheavy.yaml] \
        [--strategy dp4-tp1-pp1-mbs8-gbs32] [--rounds 5] [--every 60] \
        [--scale-to configs/gpt3-1.3b-a6000.yaml] [--storage-gbs 2] [--copy-gbs 10]
"""

from __future__ import annotations

import argparse
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

CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and Adam's two moments (mixed precision keeps fp32 masters)
WARM_STEPS = 3


def ranks_main(run_dir: Path, strategy: str, rounds: int) -> None:
    import torch.distributed as dist

    from cona_core.config import config_from_json
    from cona_core.strategy import Strategy
    from launch.worker import Worker

    dist.init_process_group("gloo")
    cfg = config_from_json((run_dir / "config.resolved.json").read_text(), "bench")
    w = Worker(cfg, run_dir, Strategy.parse(strategy), launch=1)
    background = dist.new_group(backend="gloo")  # as a worker with checkpoint_async on makes it

    def step() -> float:
        t0 = time.perf_counter()
        out = w.train_step(False)
        seconds = time.perf_counter() - t0
        if not out.control.writing:
            w.checkpointer.finish()
        return seconds

    for _ in range(WARM_STEPS):
        step()
    plain, sync, blocked, during, nbytes = [], [], [], [], 0
    for _ in range(rounds):
        plain += [step() for _ in range(5)]
        step()
        w.checkpointer.async_group = None
        t0 = time.perf_counter()
        path = w.checkpointer.save("periodic")
        sync.append(time.perf_counter() - t0)
        nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        step()
        w.checkpointer.async_group = background
        w.checkpointer.save_periodic()
        steps = []
        while w.checkpointer.pending is not None:
            steps.append(step())
        blocked.append(w.checkpointer.last_save_s)
        during += steps
    if dist.get_rank() == 0:
        doc = {"plain": plain, "sync": sync, "blocked": blocked, "during": during, "bytes": nbytes}
        (run_dir / "checkpoint_bench.json").write_text(json.dumps(doc))
    w.batches.close()  # the prefetch thread, as a worker's run ends
    dist.destroy_process_group()


def scaled(config: Path, storage_gbs: float, copy_gbs: float, interval: float, share: float) -> str:
    """The same overheads for `config`'s model on its hardware profile, from the checkpoint's bytes."""
    from cona_cli.planner.workload import Workload
    from cona_cli.run_config import load_config

    cfg = load_config(config)
    params = Workload.from_config(cfg).shape.total_params
    total = CHECKPOINT_BYTES_PER_PARAM * params
    nodes, gpus = cfg.cluster.nodes, cfg.cluster.world
    sync_s = total / nodes / (storage_gbs * 1e9)  # each node writes its ranks' shards at the same time
    copy_s = total / gpus / (copy_gbs * 1e9)  # each GPU copies its own shards to host memory
    lines = [
        f"{config.name} ({params / 1e9:.2f} B parameters, {total / 1e9:.1f} GB per checkpoint, "
        f"{nodes} nodes x {gpus // nodes} GPUs, storage {storage_gbs:g} GB/s per node, copy {copy_gbs:g} GB/s per GPU):"
    ]
    for name, s in (("synchronous", sync_s), ("background", copy_s)):
        gap = max(interval, s / share)
        lines.append(
            f"  {name:<12} waits {s:6.2f} s per checkpoint: {100 * s / (gap + s):.2f} % at one every {gap:g} s"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "wikitext2-commheavy.yaml")
    ap.add_argument("--strategy", default="dp4-tp1-pp1-mbs8-gbs32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--every", type=float, default=60.0, help="also report the overhead at one checkpoint per this")
    ap.add_argument("--data", type=Path, help="the corpus folder, when the config's data.path is elsewhere")
    ap.add_argument("--scale-to", type=Path, default=REPO / "configs" / "gpt3-1.3b-a6000.yaml")
    ap.add_argument("--storage-gbs", type=float, default=2.0, help="checkpoint write rate per node (assumption)")
    ap.add_argument("--copy-gbs", type=float, default=10.0, help="device-to-host copy rate per GPU (assumption)")
    args = ap.parse_args()
    if args.rounds < 1 or args.every <= 0 or args.storage_gbs <= 0 or args.copy_gbs <= 0:
        ap.error("--rounds must be >= 1 and --every, --storage-gbs, --copy-gbs > 0")
    from cona_cli.control.jobs import threads_per_proc
    from cona_cli.control.run_setup import make_policy, prepare_run_dir, resolve_config
    from cona_core.config import TrainConfig

    cfg, _ = make_policy(resolve_config(args.config, args.strategy, None, None, args.data))
    defaults = TrainConfig()
    interval, share = cfg.train.checkpoint_interval_s or defaults.checkpoint_interval_s, cfg.train.checkpoint_max_share
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        prepare_run_dir(run_dir, args.config, cfg)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_proc(cfg)), "PYTHONPATH": str(REPO)}
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
                args.strategy,
                str(args.rounds),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            sys.exit(f"the ranks failed (exit {proc.returncode}):\n{proc.stderr[-5000:]}")
        r = json.loads((run_dir / "checkpoint_bench.json").read_text())
    step, sync, blocked = statistics.median(r["plain"]), statistics.median(r["sync"]), statistics.median(r["blocked"])
    during = statistics.median(r["during"])
    per_write = len(r["during"]) / args.rounds
    extra = per_write * (during - step)  # what the steps beside a background write lost to it
    print(f"Periodic checkpoints, {args.config.name}, {args.strategy}, {args.rounds} rounds (medians)")
    print(f"  step time                     {step:.4f} s")
    print(f"  checkpoint                    {r['bytes'] / 1e6:.1f} MB")
    print(f"  synchronous save              {sync:.4f} s  [{min(r['sync']):.4f}–{max(r['sync']):.4f}]")
    print(f"  background: training waits   {blocked:.4f} s  [{min(r['blocked']):.4f}–{max(r['blocked']):.4f}]")
    print(f"  background: steps beside it   {per_write:.1f} per write at {during:.4f} s ({extra:+.4f} s in all)")
    for name, cost in (("synchronous", sync), ("background", blocked + max(0.0, extra))):
        at_default = cost / (max(interval, cost / share) + cost)
        at_every = cost / (args.every + cost)
        print(
            f"  {name:<12} overhead        {100 * at_default:.3f} % at the shipped interval ({interval:g} s), "
            f"{100 * at_every:.2f} % at one every {args.every:g} s"
        )
    print(scaled(args.scale_to, args.storage_gbs, args.copy_gbs, interval, share))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ranks":
        ranks_main(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        main()
