"""Time a config's strategies for the virtual clock's `measured` table in rounds, so that no single moment
of the host sets an entry.

A `measured` table times a strategy by one calibration pass (12 steps) the first time a run reaches it. On a
shared 2-core VM two such passes minutes apart differ by up to a sixth (docs/benchmarks.md), as much as the
policies compared on the table differ. This script runs --rounds rounds; in each, one short virtual-clock
launch per strategy (the planner's pick at every rung of the ladder, or --strategies), in an order rotated
by round, each after deleting the strategy's entry from this host's cache so that the launch calibrates it
afresh. Each entry is then the median of its rounds (the launch's start and evaluation too; the load is the
largest a round saw, so a busy round stays flagged), written into the host's cache, where every later run
of the config on this host is charged it, and with --out to a file `bench_ttp.py --table-from` takes.
Run it on an idle host: each round's pass is what the host does at that moment.

    python scripts/calibrate_table.py --config configs/wikitext2-gpt-tiny.yaml [--data DIR] [--rounds 3]
        [--strategies dp4-tp1-pp1-mbs4-gbs16,dp4-tp1-pp1-mbs8-gbs32] [--out table.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_ttp import CONA, DEFAULT_DATA, bench_doc  # noqa: E402

from cona_cli.control.clock_table import measured_cache_path  # noqa: E402
from cona_cli.control.cona_policy import fastest_strategy  # noqa: E402
from cona_cli.planner.hardware import load_hardware  # noqa: E402
from cona_cli.planner.space import gbs_ladder  # noqa: E402
from cona_cli.run_config import load_config  # noqa: E402
from cona_core.clock import TIMING, read_cache, write_cache  # noqa: E402
from cona_core.config import Config, ConfigError  # noqa: E402
from cona_core.strategy import Strategy, StrategyError  # noqa: E402


def median_entry(rounds: list[dict[str, float]]) -> dict[str, float]:
    """One strategy's entry from its rounds' entries: the median of each timing, the largest load."""
    entry = {key: statistics.median(r[key] for r in rounds) for key in TIMING}
    entry["load"] = max(r.get("load", 0.0) for r in rounds)
    return entry


def rotated(items: list[Strategy], k: int) -> list[Strategy]:
    """`items` starting at position k (mod its length): round k's order."""
    k %= len(items)
    return items[k:] + items[:k]


def planner_picks(cfg: Config) -> list[Strategy]:
    """The planner's fastest strategy at every rung of the config's ladder (what bench_ttp's statics run)."""
    hw = load_hardware(cfg.search.hardware)
    return [
        fastest_strategy(dataclasses.replace(cfg, search=dataclasses.replace(cfg.search, gbs_static=g)), hw)
        for g in gbs_ladder(cfg)
    ]


def calibrate_once(doc: dict, strategy: Strategy, cache: Path, run_dir: Path) -> dict[str, float]:
    """Delete `strategy`'s entry from the cache file `cache`, run one virtual-clock step of it in a new run
    folder `run_dir` (its launch calibrates it), and return the entry the launch wrote."""
    write_cache(cache, {k: v for k, v in read_cache(cache).items() if k != str(strategy)})
    cfg_path = run_dir.with_suffix(".yaml")
    run = {**doc, "policy": "static", "strategy": str(strategy)}
    run["train"] = {**doc["train"], "clock_table": "measured", "max_steps": 1, "max_time": None, "max_tokens": None}
    cfg_path.write_text(yaml.safe_dump(run, sort_keys=False))
    done = subprocess.run(
        [*CONA, "train", str(cfg_path), "--run-dir", str(run_dir), "--log-format", "plain"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    entry = read_cache(cache).get(str(strategy))
    if done.returncode != 0 or entry is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"calibrate_table: {strategy}: the launch failed (exit {done.returncode}): {tail[0]}")
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "wikitext2-gpt-tiny.yaml")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="replaces data.path (as in bench_ttp.py)")
    ap.add_argument("--rounds", type=int, default=3, help="calibration passes per strategy (default 3)")
    ap.add_argument("--strategies", default="", help="comma-separated strategies (default: the planner's per rung)")
    ap.add_argument("--out", type=Path, help="also write the table here (a file bench_ttp.py --table-from takes)")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds: must be >= 1")
    try:
        doc = bench_doc(args.config, args.data, 1.0, "virtual")  # bench_ttp's runs' config: their table's cache
        with tempfile.TemporaryDirectory(prefix="cona-calibrate-") as tmp:
            loaded = Path(tmp) / "config.yaml"
            loaded.write_text(yaml.safe_dump(doc))
            cfg = load_config(loaded)
        names = [s for s in args.strategies.split(",") if s]
        strategies = [Strategy.parse(s) for s in names] if names else planner_picks(cfg)
    except (ConfigError, StrategyError, ValueError) as e:
        raise SystemExit(f"calibrate_table: {e}") from None
    cache = measured_cache_path(cfg)
    print(f"calibrate_table: {len(strategies)} strategies, {args.rounds} rounds, into {cache}", flush=True)
    rounds: dict[Strategy, list[dict[str, float]]] = {s: [] for s in strategies}
    with tempfile.TemporaryDirectory(prefix="cona-calibrate-") as tmp:
        for k in range(args.rounds):
            for s in rotated(strategies, k):
                rounds[s].append(calibrate_once(doc, s, cache, Path(tmp) / f"round{k + 1}-{s}"))
                print(f"  round {k + 1}: {s} {rounds[s][-1]['seconds']:.4g} s/step", flush=True)
    table = {str(s): median_entry(r) for s, r in rounds.items()}
    write_cache(cache, read_cache(cache) | table)
    if args.out:
        args.out.write_text(json.dumps(table, indent=1, sort_keys=True))
    print("| strategy | s/step per round | median | max / min |\n|---|---|---|---|")
    for s, r in rounds.items():
        times = [e["seconds"] for e in r]
        per = " / ".join(f"{t:.4g}" for t in times)
        print(f"| {s} | {per} | {table[str(s)]['seconds']:.4g} | {max(times) / min(times):.3f} |")


if __name__ == "__main__":
    main()
