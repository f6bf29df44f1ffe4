"""Benchmark: time to target perplexity of cona against static strategies, over several seeds.

Runs one config (default: WikiText-2, tiny GPT, 4 gloo ranks), each for the same wall-time budget:
  cona          policy cona (online chaining)
  static-auto   the shortest predicted iteration time at search.gbs_static (what offline planners pick)
  static-<gbs>  the shortest predicted iteration time at every other rung of the ladder
Seeds run one after another; inside a seed the runs go in a rotated order, so host drift spreads
evenly over the conditions. After the first seed, `--drop-worst K` drops the K static rungs that
were slowest to the last target (said so in the output). Prints, per target, the median and range
over seeds of each run's time to the target, and of cona's speed-up against static-auto and against
the best static run of the same seed (the best fixed strategy in hindsight).

    python scripts/bench_ttp.py [--config configs/wikitext2-gpt-tiny.yaml] [--data DIR] [--seeds 3]
        [--max-time 240] [--targets 600,400,300] [--drop-worst 0] [--out runs/ttp] [--only cona,static-auto]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.config import load_config  # noqa: E402
from cona_cli.planner.space import gbs_ladder  # noqa: E402
from cona_cli.report.build import time_to_target  # noqa: E402
from cona_cli.report.runlog import read_run  # noqa: E402

CONA = [sys.executable, "-c", "from cona_cli.app import main; main()"]


def variants(doc: dict, ladder: list[int], gbs_static: int) -> dict[str, dict]:
    """cona, static-auto, and the planner's static pick at every other rung."""

    def static(gbs: int) -> dict:
        return {**doc, "policy": "static", "strategy": "auto", "search": {**doc.get("search", {}), "gbs_static": gbs}}

    runs = {"cona": {**doc, "policy": "cona"}, "static-auto": static(gbs_static)}
    runs.update({f"static-{g}": static(g) for g in ladder if g != gbs_static})
    return runs


def run_once(name: str, variant: dict, seed: int, out: Path, max_time: float) -> Path:
    doc = {**variant, "train": {**variant["train"], "seed": seed}}
    cfg_path = out / f"{name}-s{seed}.yaml"
    cfg_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = out / f"s{seed}" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"== seed {seed}: {name} ({max_time:.0f} s)", flush=True)
    subprocess.run(
        [*CONA, "train", str(cfg_path), "--run-dir", str(run_dir)], check=True, cwd=REPO, stdout=subprocess.DEVNULL
    )
    return run_dir


def times(run_dir: Path, targets: list[float]) -> list[float | None]:
    log = read_run(run_dir)
    return [r.time_s if r.reached else None for r in (time_to_target(log, t) for t in targets)]


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3g} [{min(values):.3g}–{max(values):.3g}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "wikitext2-gpt-tiny.yaml")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "wikitext-2-raw")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--max-time", type=float, default=240.0)
    ap.add_argument("--targets", default="600,400,300")
    ap.add_argument("--drop-worst", type=int, default=0, help="static rungs dropped after the first seed")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "ttp")
    ap.add_argument("--only", default="", help="comma-separated subset of the runs")
    args = ap.parse_args()

    doc = yaml.safe_load(args.config.read_text())
    if doc.get("data", {}).get("path"):
        doc["data"] = {**doc["data"], "path": str(args.data.resolve())}
    doc["train"] = {**doc["train"], "max_time": args.max_time}
    doc["train"].pop("target_ppl", None)  # run the whole budget: every target gets a time
    for key in ("strategy", "chain", "policy"):
        doc.pop(key, None)
    cfg = load_config(args.config)
    ladder = gbs_ladder(cfg)
    runs = variants(doc, ladder, cfg.search.gbs_static or ladder[len(ladder) // 2])
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only.split(",")}
    targets = [float(t) for t in args.targets.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    base_seed = int(doc["train"].get("seed", 1234))
    results: dict[str, list[list[float | None]]] = {name: [] for name in runs}  # per run: per seed: per target
    for i in range(args.seeds):
        names = list(runs)
        names = names[i % len(names) :] + names[: i % len(names)]  # rotate: drift spreads over conditions
        for name in names:
            results[name].append(times(run_once(name, runs[name], base_seed + i, args.out, args.max_time), targets))
        if i == 0 and args.drop_worst:
            statics = [n for n in runs if n.startswith("static-") and n != "static-auto"]
            slowest = sorted(statics, key=lambda n: results[n][0][-1] or float("inf"))[-args.drop_worst :]
            print(f"dropped after seed {base_seed}: {', '.join(slowest)} (slowest to ppl {targets[-1]:g})")
            runs = {k: v for k, v in runs.items() if k not in slowest}

    print(f"\n{args.seeds} seed(s), {args.max_time:.0f} s each; time to target in s: median [min–max] over seeds")
    print("| run | " + " | ".join(f"ppl ≤ {t:g}" for t in targets) + " |")
    print("|---" * (len(targets) + 1) + "|")
    for name, per_seed in results.items():
        cells = []
        for j in range(len(targets)):
            reached = [s[j] for s in per_seed if s[j] is not None]
            cells.append(f"{spread(reached)} ({len(reached)}/{len(per_seed)})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if "cona" not in results:
        return
    for label, against in (("static-auto", lambda s, j: results["static-auto"][s][j]), ("best static", None)):
        cells = []
        for j in range(len(targets)):
            ups = []
            for s, cona_times in enumerate(results["cona"]):
                if against is not None:
                    base = against(s, j) if "static-auto" in results else None
                else:
                    statics = [results[n][s][j] for n in results if n != "cona" and len(results[n]) > s]
                    base = min((t for t in statics if t is not None), default=None)
                if base is not None and cona_times[j] is not None:
                    ups.append(base / cona_times[j])
            cells.append(spread(ups) + "×")
        print(f"| cona vs {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
