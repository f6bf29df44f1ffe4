"""Does the virtual clock agree with the wall clock? The static rungs of one config, each run on both clocks.

For every seed and rung (the planner's pick at that global batch, the config's LR recipe), one run on the
wall clock and one on the virtual clock (`train.clock: virtual`, the `measured` table of this host:
calibrated by the first virtual run of each strategy, so run this on an idle host), the two clocks'
order alternating from seed to seed. Prints each rung's time to every target on both clocks and their
ratio (virtual / wall), median [range] over seeds, and the largest deviation of a median ratio from 1.

    python scripts/clock_agreement.py [--config configs/wikitext2-gpt-tiny.yaml] [--seeds 3] [--first-seed N]
        [--rungs 8,16,32,64] [--max-time 120] [--targets 1500,1000,700] [--out runs/clock-agreement]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_ttp import DEFAULT_DATA, bench_doc, run_once, spread, times  # noqa: E402

CLOCKS = ("wall", "virtual")


def static_doc(doc: dict, gbs: int) -> dict:
    """The planner's pick at global batch `gbs`, under the config's own recipe."""
    return {**doc, "policy": "static", "strategy": "auto", "search": {**doc.get("search", {}), "gbs_static": gbs}}


def ratios(results: dict[tuple[str, int], dict[int, list[float | None]]], gbs: int, j: int) -> list[float]:
    """Per seed, the virtual clock's time to target j over the wall clock's, for rung `gbs`."""
    wall, virtual = results[("wall", gbs)], results[("virtual", gbs)]
    out = []
    for seed, w in wall.items():
        v = virtual.get(seed, [None] * (j + 1))[j]
        if w[j] is not None and v is not None:
            out.append(v / w[j])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "wikitext2-gpt-tiny.yaml")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="replaces the config's data.path")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, help="default: the config's train.seed")
    ap.add_argument("--rungs", default="8,16,32,64", help="global batches of the static runs")
    ap.add_argument("--max-time", type=float, default=120.0, help="seconds of each run, on its clock")
    ap.add_argument("--targets", default="1500,1000,700")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "clock-agreement")
    args = ap.parse_args()

    rungs = [int(g) for g in args.rungs.split(",")]
    targets = [float(t) for t in args.targets.split(",")]
    docs = {clock: bench_doc(args.config, args.data, args.max_time, clock) for clock in CLOCKS}
    base = args.first_seed if args.first_seed is not None else int(docs["wall"]["train"].get("seed", 1234))
    results: dict[tuple[str, int], dict[int, list[float | None]]] = {(c, g): {} for c in CLOCKS for g in rungs}
    for i in range(args.seeds):
        seed = base + i
        order = CLOCKS if i % 2 == 0 else CLOCKS[::-1]
        for gbs in rungs[i % len(rungs) :] + rungs[: i % len(rungs)]:
            for clock in order:
                out = args.out / clock
                out.mkdir(parents=True, exist_ok=True)
                run = run_once(f"static-{gbs}", static_doc(docs[clock], gbs), seed, out, args.max_time)
                results[(clock, gbs)][seed] = times(run, targets)

    print(f"\n{args.seeds} seed(s) from {base}, {args.max_time:.0f} s per run; time to target in s, median [range]")
    print("| rung | target | wall | virtual | virtual / wall |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for gbs in rungs:
        for j, target in enumerate(targets):
            cells = [spread([t[j] for t in results[(c, gbs)].values() if t[j] is not None]) for c in CLOCKS]
            r = ratios(results, gbs, j)
            if r:
                worst = max(worst, abs(statistics.median(r) - 1))
            print(f"| gbs {gbs} | ppl ≤ {target:g} | {cells[0]} | {cells[1]} | {spread(r)} |")
    print(f"\nlargest deviation of a median ratio from 1: {100 * worst:.1f} %")


if __name__ == "__main__":
    main()
