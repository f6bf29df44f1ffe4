"""Experiment: can a short paired trial measure the statistical efficiency of a larger batch?

A paired trial starts from one training state, runs the same N samples at batch b and, from a restored
copy of that state, at batch b', and compares the validation loss each reached: the efficiency ratio
e = (L0 − L_b') / (L0 − L_b) is how much progress a sample makes at b' relative to b, whatever the LR
rule, the optimizer or the curvature (Φ models it as (b + G)/(b' + G)). Multiplied by the throughput
ratio it is the quantity the cona policy decides on, so a trial could replace the model where the model
is wrong. It pays only if e is repeatable at an N small enough for the trial's overhead.

This script trains the config's model in one process (the real worker: data, LR rule, GNS estimator,
evaluation) at batch b to each start point, then runs `--windows` paired trials of N samples from that
state, each on another window of the training stream, and one long pair over `--horizon` × N samples
evaluated every N (does the short trial's e predict the longer run's?). It prints, per start point and
N, e's median, range and standard deviation over the windows beside Φ's (b + G)/(b' + G), and what one
trial costs: the loser's samples and two evaluations.

    python scripts/paired_trials.py [--config configs/wikitext2-gpt-tiny.yaml] [--data DIR] [--arms 8,16]
        [--mbs 4] [--at 2000,6000] [--samples 128,256,512] [--windows 6] [--horizon 8]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.control.run_setup import make_policy, prepare_run_dir, resolve_config  # noqa: E402
from cona_core.strategy import Strategy  # noqa: E402
from launch.snapshot import Snapshot  # noqa: E402

if TYPE_CHECKING:
    from launch.worker import Worker


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


class Trainer:
    """The real worker in one process, with its state copied and restored around each arm."""

    def __init__(self, worker: Worker, b: int, mbs: int) -> None:
        self.w = worker
        self.mbs = mbs
        self.set_batch(b)

    def set_batch(self, gbs: int) -> None:
        s = Strategy(1, 1, 1, min(self.mbs, gbs), gbs)
        if s != self.w.strategy:
            held = self.w.state.gns_from_step
            self.w.resize(s)
            self.w.state.gns_from_step = held  # restored states keep their own hold

    def train(self, samples: int) -> float:
        """Train `samples` samples at the current batch; returns seconds."""
        t0 = time.perf_counter()
        end = self.w.state.consumed_samples + samples
        while self.w.state.consumed_samples < end:
            self.w.train_step(False)
        return time.perf_counter() - t0

    def loss(self) -> float:
        return self.w.evaluator.evaluate()[0]

    def take(self) -> Snapshot:
        return Snapshot.take(self.w.pm.model, self.w.opt, (self.w.state, self.w.noise, self.w.strategy))

    def restore(self, snap: Snapshot) -> None:
        state, noise, strategy = snap.restore(self.w.pm.model, self.w.opt)
        self.set_batch(strategy.gbs)
        self.w.state, self.w.noise = state, noise

    def arm(self, snap: Snapshot, gbs: int, start: int, samples: int, every: int) -> tuple[list[float], float]:
        """From `snap`, train at `gbs` on the stream from sample `start`: validation losses every `every`
        samples up to `samples`, and the seconds trained."""
        self.restore(snap)
        if gbs != self.w.strategy.gbs:
            self.w.resize(replace(self.w.strategy, mbs=min(self.mbs, gbs), gbs=gbs))  # as a real switch: held GNS
        self.w.state.consumed_samples = start
        losses, seconds = [], 0.0
        for _ in range(samples // every):
            seconds += self.train(every)
            losses.append(self.loss())
        return losses, seconds


def efficiency(l0: float, at_b: float, at_b2: float) -> float:
    return (l0 - at_b2) / (l0 - at_b) if l0 > at_b else float("nan")


def summary(es: list[float]) -> str:
    """Median, range and std of the finite ratios, and how many windows had no progress at b (no ratio)."""
    ok = sorted(e for e in es if math.isfinite(e))
    if len(ok) < 2:
        return f"{'-':>9} {'-':>13} {'-':>6}  ({len(es) - len(ok)} of {len(es)} without progress at b)"
    tail = f"  ({len(es) - len(ok)} of {len(es)} without progress at b)" if len(ok) < len(es) else ""
    return f"{statistics.median(ok):>9.3f} {ok[0]:>6.3f}-{ok[-1]:<6.3f} {statistics.stdev(ok):>6.3f}{tail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "wikitext2-gpt-tiny.yaml")
    ap.add_argument("--data", type=Path, help="data folder (overrides data.path)")
    ap.add_argument("--arms", default="8,16", help="b,b': the running batch and the candidate")
    ap.add_argument("--mbs", type=int, default=4, help="micro-batch (smaller than b: the GNS needs two)")
    ap.add_argument("--at", default="2000,6000", help="start points, in samples trained at b")
    ap.add_argument("--samples", default="128,256,512", help="trial lengths N, in samples per arm")
    ap.add_argument("--windows", type=int, default=6, help="paired trials per start point and N")
    ap.add_argument("--horizon", type=int, default=8, help="the long pair's length in multiples of the largest N")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    b, b2 = ints(args.arms)
    starts, lengths = ints(args.at), ints(args.samples)
    if not (0 < args.mbs < b < b2) or sorted(starts) != starts or not lengths or min(lengths) < b2:
        sys.exit("paired_trials.py: need 0 < --mbs < b < b', increasing --at and every N >= b'")
    one = {"cluster.procs_per_node": 1, "cluster.nodes": 1}
    cfg = resolve_config(args.config, f"dp1-tp1-pp1-mbs{args.mbs}-gbs{b}", None, None, args.data, one)
    cfg, _ = make_policy(cfg)

    import torch
    import torch.distributed as dist

    from launch.worker import Worker

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        prepare_run_dir(run_dir, args.config, cfg)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo")
        tr = Trainer(Worker(cfg, run_dir, cfg.strategy, launch=1), b, args.mbs)
        print(
            f"config {args.config.name}: b {b} vs b' {b2}, mbs {args.mbs}, lr {cfg.train.lr} at gbs "
            f"{cfg.train.lr_base_gbs}, recipe {cfg.train.lr_scaling}; {args.windows} windows per point and N; "
            f"eval {cfg.train.eval_tokens} tokens"
        )
        print(f"{'start':>6} {'N':>5} {'L0':>7} {'GNS':>6} {'e Φ':>6} {'e median':>9} {'e range':>13} {'e std':>6}")
        long_rows = []
        for start in starts:
            tr.train(start - tr.w.state.consumed_samples)
            snap = tr.take()
            l0 = tr.loss()
            gns = tr.w.noise.gns or float("nan")
            e_phi = (b + gns) / (b2 + gns)
            stream = tr.w.state.consumed_samples
            eval_s = time.perf_counter()
            tr.loss()
            eval_s = time.perf_counter() - eval_s
            n = max(lengths)  # the long pair first: what the short trials should predict
            lb, _ = tr.arm(snap, b, stream, args.horizon * n, n)
            lb2, _ = tr.arm(snap, b2, stream, args.horizon * n, n)
            long_rows.append((start, l0, [efficiency(l0, x, y) for x, y in zip(lb, lb2)]))
            for n in lengths:
                es, secs = [], []
                for k in range(args.windows):
                    window = stream + k * n
                    (lb,), sb = tr.arm(snap, b, window, n, n)
                    (lb2,), sb2 = tr.arm(snap, b2, window, n, n)
                    es.append(efficiency(l0, lb, lb2))
                    secs.append(min(sb, sb2) + 2 * eval_s)
                print(f"{start:>6} {n:>5} {l0:>7.4f} {gns:>6.1f} {e_phi:>6.3f} {summary(es)}", end="")
                print(f"   (trial overhead ~{statistics.median(secs):.1f} s here)")
            tr.restore(snap)
            tr.w.state.consumed_samples = stream
        print(f"\nlong pair, e after k × {max(lengths)} samples (k = 1..{args.horizon}):")
        for start, l0, es in long_rows:
            print(f"{start:>6} L0 {l0:.4f}: " + " ".join(f"{e:.3f}" for e in es))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
