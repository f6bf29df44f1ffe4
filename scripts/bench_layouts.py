"""Benchmark: seconds per iteration of every feasible layout, start-up, DCP save/load, and overhead.

Prints a table of s/iter and tokens/s for every feasible (dp, tp, pp, mbs) at two global batch
sizes, torchrun start-up time (launch to first step), DCP save/load seconds and bytes, and the ratio
of cona's (1,1,1) step time to a minimal plain-PyTorch loop of the same model and batch.
Writes the measurements to scripts/data/layout_times_cpu.json (the cost model's calibration data).

    python scripts/bench_layouts.py [--config configs/tiny.yaml] [--gbs 16,64] [--steps 3] [--rounds 4]
                                    [--min-seconds 1.0] [--mbs 1,2,4,8] [--out FILE]

Run it on a quiet machine: every layout is timed in several rounds of a shuffled order, and the
median of all its timed steps is recorded.
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

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.control.run_setup import prepare_run_dir, resolve_config  # noqa: E402
from cona_core.rundir import RunDir  # noqa: E402
from cona_core.strategy import Strategy  # noqa: E402


def measure_layouts(run_dir: Path, world: int, gbs: str, steps: int, rounds: int, min_s: float, mbs: str) -> dict:
    out = run_dir / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(REPO / "scripts" / "bench_layouts_ranks.py"),
        str(run_dir),
        str(out),
        gbs,
        str(steps),
        str(rounds),
        str(min_s),
        f"--mbs={mbs}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_layouts_ranks.py failed (exit {proc.returncode}):\n{proc.stderr[-5000:]}")
    return json.loads(out.read_text())


def measure_startup(config: Path, world: int, gbs: int) -> float:
    """Seconds from the controller's launch event to the end of the first step, minus that step."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-c",
            "from cona_cli.app import main; main()",
            "train",
            str(config),
            "--strategy",
            f"dp{world}-tp1-pp1-mbs2-gbs{gbs}",
            "--max-steps",
            "2",
            "--run-dir",
            str(run),
        ]
        subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
        launch = next(
            e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["kind"] == "launch"
        )
        first = next(
            r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"
        )
        return first["time"] - first["iter_s"] - launch["time"]


def plain_vs_cona(run_dir: Path, gbs: int, steps: int) -> tuple[float, float]:
    """Median s/iter of a minimal plain loop and of cona's worker at (1,1,1), same model and batch."""
    import torch.distributed as dist

    from cona_core.config import config_from_json
    from launch.worker import Worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    cfg = config_from_json(RunDir(run_dir).resolved_config.read_text(), "bench")
    w = Worker(cfg, run_dir, Strategy(1, 1, 1, gbs, gbs), launch=1)
    m, t = cfg.model, cfg.train
    model = w.spec.build(m, RunDir(run_dir).vocab_size())
    model.init_weights(t.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    x, y = w.train_stream.samples(0, gbs)

    def plain_step() -> None:
        opt.zero_grad(set_to_none=True)
        w.spec.loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()

    plain, ours = [], []
    for i in range(2 * steps + 4):  # interleaved, so host drift hits both alike
        for fn, sink in ((plain_step, plain), (lambda: w.train_step(False), ours)):
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                sink.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return statistics.median(plain), statistics.median(ours)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.yaml")
    ap.add_argument("--gbs", default="16,64")
    ap.add_argument("--steps", type=int, default=3, help="least timed steps per layout and round")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="least timed seconds per layout and round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds over all layouts, each in a new random order")
    ap.add_argument("--mbs", default="1,2,4,8", help="comma-separated micro-batch sizes to time")
    ap.add_argument("--out", type=Path, default=REPO / "scripts" / "data" / "layout_times_cpu.json")
    args = ap.parse_args()
    cfg = resolve_config(args.config, None, None, None)
    world = cfg.cluster.world
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        prepare_run_dir(run_dir, args.config, cfg)
        res = measure_layouts(run_dir, world, args.gbs, args.steps, args.rounds, args.min_seconds, args.mbs)
        rows = [{k: r[k] for k in ("dp", "tp", "pp", "mbs", "gbs", "iter_s", "n", "round_s")} for r in res["rows"]]
        args.out.parent.mkdir(exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
        torch.set_num_threads(os.cpu_count() or 1)
        plain_s, ours_s = plain_vs_cona(run_dir, int(args.gbs.split(",")[0]), args.steps * 2)
    startup = measure_startup(args.config, world, int(args.gbs.split(",")[0]))

    seq = cfg.model.seq_len
    print(
        f"config {args.config.name}: world {world}, {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, "
        f"seq {seq}; {args.rounds} shuffled rounds x at least {args.steps} steps and {args.min_seconds:g} s "
        "per layout (median of all), OMP_NUM_THREADS=1 per rank"
    )
    print(f"{'dp':>3} {'tp':>3} {'pp':>3} {'mbs':>4} {'gbs':>4} {'micro':>5} {'s/iter':>8} {'tokens/s':>9}")
    for r in sorted(res["rows"], key=lambda r: (r["gbs"], r["iter_s"])):
        s = Strategy(r["dp"], r["tp"], r["pp"], r["mbs"], r["gbs"])
        print(
            f"{s.dp:>3} {s.tp:>3} {s.pp:>3} {s.mbs:>4} {s.gbs:>4} {s.n_microbatches:>5} {r['iter_s']:>8.3f} "
            f"{s.gbs * seq / r['iter_s']:>9.0f}"
        )
    spread = [
        statistics.stdev(r["round_s"]) / statistics.mean(r["round_s"]) for r in res["rows"] if len(r["round_s"]) > 1
    ]
    if spread:
        print(
            f"noise: relative std of a layout's per-round median, median over layouts "
            f"{statistics.median(spread):.1%} (max {max(spread):.1%})"
        )
    d = res["dcp"]
    print(f"torchrun start-up (launch to first step): {startup:.1f} s")
    print(
        f"DCP save {d['save_s']:.2f} s, load (resharded dp{world}->tp2) {d['load_s']:.2f} s, {d['bytes'] / 1e6:.1f} MB"
    )
    print(
        f"(1,1,1) step: cona {ours_s * 1e3:.1f} ms vs plain PyTorch loop {plain_s * 1e3:.1f} ms: "
        f"ratio {ours_s / plain_s:.3f} (target <= 1.10)"
    )
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
