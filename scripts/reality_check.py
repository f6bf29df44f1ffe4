"""The simulator against real runs: a world made of some seeds' static runs predicts another seed's.

Takes a `bench_ttp.py` output folder. The world is `cona simulate --from-run` over the static runs of
the `--world` seeds (the config's own recipe: static-auto and every static-<gbs>; the other recipe's and
the `--again` reruns are left out; with several seeds a rung's curve is the mean of its runs). Its
predicted speed-ups over static-auto (t_static-auto / t_run, median over the simulator's noise seeds)
are printed beside the median of the `--measured` seeds (the target's measure), each of them, and the
world's own seeds (median) for scale; a cell is within the target when predicted / measured is within 15 %.

    python scripts/reality_check.py --runs runs/ttp --world 1253 [--world 1255] --measured 1254
        [--config configs/wikitext2-gpt-tiny.yaml] [--targets 600,450,350,300] [--seeds 5] [--max-time 240]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_ttp import CONA, times  # noqa: E402

TOLERANCE = 0.15  # the reality check's target: predicted within 15 % of measured


def world_runs(seed_dir: Path) -> list[Path]:
    """The seed's static runs of the config's own recipe."""
    runs = [
        d
        for d in sorted(seed_dir.glob("static-*"))
        if d.is_dir() and not d.name.endswith(("-sqrt", "-adascale", "-again"))
    ]
    if not any(d.name == "static-auto" for d in runs) or len(runs) < 2:
        raise SystemExit(f"reality_check: {seed_dir} needs static-auto and at least one other static run")
    return runs


def predicted(config: Path, runs: list[Path], targets: list[float], seeds: int, max_time: float) -> dict:
    """Run name (cona, static-auto, static-<gbs>) -> median simulated time to each target."""
    cmd = [*CONA, "simulate", str(config), "--json", "--seeds", str(seeds), "--max-time", str(max_time)]
    cmd += ["--targets", ",".join(f"{t:g}" for t in targets)]
    for run in runs:
        cmd += ["--from-run", str(run)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"reality_check: cona simulate failed: {proc.stderr.strip().splitlines()[-1]}")
    out = {}
    for name, per_seed in json.loads(proc.stdout)["evaluated_times_s"].items():
        short = name.split(" (")[0]
        if short == "cona" or short.startswith("static-"):
            out[short] = [_median([seed[i] for seed in per_seed]) for i in range(len(targets))]
    return out


def measured(seed_dir: Path, names: list[str], targets: list[float]) -> dict:
    return {n: times(seed_dir / n, targets) for n in names if (seed_dir / n / "metrics.jsonl").is_file()}


def speedups(table: dict) -> dict:
    """t_static-auto / t_run per target (None where either did not reach it)."""
    auto = table["static-auto"]
    return {n: [a / t if a and t else None for a, t in zip(auto, ts)] for n, ts in table.items() if n != "static-auto"}


def median_speedups(tables: list[dict]) -> dict:
    """Per run and target, the median over seeds' speed-ups (None unless most seeds reached it)."""
    names = {n for table in tables for n in table}
    width = max(len(ts) for table in tables for ts in table.values())
    return {n: [_median([t.get(n, [None] * width)[i] for t in tables]) for i in range(width)] for n in names}


def _median(values: list[float | None]) -> float | None:
    reached = [v for v in values if v is not None]
    return statistics.median(reached) if len(reached) > len(values) / 2 else None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, required=True, help="a bench_ttp.py --out folder")
    p.add_argument("--world", type=int, action="append", required=True, help="a seed whose static runs make the world")
    p.add_argument("--measured", type=int, action="append", required=True, help="a seed to predict (repeatable)")
    p.add_argument("--config", type=Path, default=REPO / "configs" / "wikitext2-gpt-tiny.yaml")
    p.add_argument("--targets", default="600,450,350,300")
    p.add_argument("--seeds", type=int, default=5, help="the simulator's noise seeds")
    p.add_argument("--max-time", type=float, default=240.0)
    args = p.parse_args()
    targets = [float(t) for t in args.targets.split(",")]
    if set(args.world) & set(args.measured):
        p.error("--measured: a seed of the world predicts itself; name other seeds")

    world = [run for seed in args.world for run in world_runs(args.runs / f"s{seed}")]
    seeds = ", ".join(map(str, args.world))
    print(f"world: seeds {seeds}: {', '.join(sorted({d.name for d in world}))}; {args.seeds} noise seeds", flush=True)
    pred = speedups(predicted(args.config, world, targets, args.seeds, args.max_time))
    names = sorted(pred, key=lambda n: (n != "cona", n))
    own = median_speedups(
        [speedups(measured(args.runs / f"s{seed}", ["static-auto", *names], targets)) for seed in args.world]
    )
    tables: dict[int | str, dict] = {
        seed: speedups(measured(args.runs / f"s{seed}", ["static-auto", *names], targets)) for seed in args.measured
    }
    if len(tables) > 1:  # the target's measure: the median of the other seeds
        tables = {"median": median_speedups(list(tables.values())), **tables}
    for key, real in tables.items():
        which = f"seed {key}" if key != "median" else "the median of seeds " + ", ".join(map(str, args.measured))
        print(f"\nspeed-up over static-auto: predicted / measured in {which} / measured in the world's seeds {seeds}")
        print(f"(predicted over measured in {which}; within {TOLERANCE:.0%} is the target)\n")
        within, cells = _table(names, targets, pred, real, own)
        print(f"\nwithin {TOLERANCE:.0%}: {within} of {cells} cells where both reached the target ({which})")


def _table(names: list[str], targets: list[float], pred: dict, real: dict, own: dict) -> tuple[int, int]:
    """Print predicted / measured / the world's own speed-ups; (cells within the tolerance, cells)."""
    print("| run | " + " | ".join(f"ppl {t:g}" for t in targets) + " |")
    print("|" + "---|" * (len(targets) + 1))
    within, cells, none = 0, 0, [None] * len(targets)
    for n in names:
        row = []
        for i in range(len(targets)):
            a, b, c = pred[n][i], real.get(n, none)[i], own.get(n, none)[i]
            ratio = f" (**{a / b:.2f}**)" if a and b else ""
            if a and b:
                cells += 1
                within += abs(a / b - 1) <= TOLERANCE
            row.append(f"{_fmt(a)} / {_fmt(b)} / {_fmt(c)}{ratio}")
        print(f"| {n} | " + " | ".join(row) + " |")
    return within, cells


if __name__ == "__main__":
    main()
