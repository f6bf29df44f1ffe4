"""How far the calibrated step-time model is off about the next rung of a ladder, and how far it says it is.

A climbing run has measured its rungs so far and knows the next one from the model alone: the decision
rule's hopeful end reads the model's error there. For each rung of the config's ladder above the first,
the model is calibrated on the rungs below it (the fastest strategy of each in a measured table, its
time with `--noise` lognormal spread over `--samples` steps, as a dwell measures it) and predicts the
fastest table strategy of the rung. Prints the prediction, the error the model states (its fitted parameters' and
the GP's, or the uncalibrated model's where the measured strategies say nothing), the table's time and
their ratio.

    python scripts/next_rung_error.py --config configs/wikitext2-gpt-tiny.yaml \
        --table ~/.cache/cona/clock/HOST-DIGEST.json    # a virtual clock's measured table
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.planner.calibration import Calibrator  # noqa: E402
from cona_cli.planner.costmodel import as_array  # noqa: E402
from cona_cli.planner.hardware import load_hardware  # noqa: E402
from cona_cli.planner.space import gbs_ladder  # noqa: E402
from cona_cli.planner.workload import Workload  # noqa: E402
from cona_cli.run_config import load_config  # noqa: E402
from cona_core.clock import read_cache  # noqa: E402
from cona_core.strategy import Strategy  # noqa: E402


def fastest_per_rung(table: dict[str, dict[str, float]], ladder: list[int]) -> dict[int, tuple[Strategy, float]]:
    """The fastest strategy of each rung the table times, with its seconds per step."""
    best: dict[int, tuple[Strategy, float]] = {}
    for name, entry in table.items():
        s, t = Strategy.parse(name), float(entry["seconds"])
        if s.gbs in ladder and (s.gbs not in best or t < best[s.gbs][1]):
            best[s.gbs] = (s, t)
    return best


def next_rung_rows(
    cfg, table: dict[str, dict[str, float]], samples: int, noise: float, seed: int
) -> list[tuple[int, float, float, float]]:
    """(rung, predicted s/step, stated relative error, table s/step) for each rung with a timed rung below."""
    hw = load_hardware(cfg.search.hardware)
    rungs = fastest_per_rung(table, gbs_ladder(cfg))
    order = sorted(rungs)
    rng = random.Random(seed)
    rows = []
    for k in range(1, len(order)):
        cal = Calibrator(Workload.from_config(cfg), hw, seed=cfg.search.seed)
        for gbs in order[:k]:
            s, t = rungs[gbs]
            for _ in range(samples):
                cal.add(s, t * math.exp(rng.gauss(0.0, noise)))
        cal.fit()
        s, t = rungs[order[k]]
        mean, std = cal.predict(as_array([s]))
        rows.append((order[k], float(mean[0]), float(std[0] / mean[0]), t))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--table", type=Path, required=True, help="a measured table: {strategy: {seconds, ...}}")
    ap.add_argument("--samples", type=int, default=20, help="timed steps per measured rung")
    ap.add_argument("--noise", type=float, default=0.03, help="lognormal spread of one step's time")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = next_rung_rows(load_config(args.config), read_cache(args.table), args.samples, args.noise, args.seed)
    if not rows:
        raise SystemExit(f"--table {args.table}: no readable table that times two rungs of the config's ladder")
    print("| rung | predicted s/step | stated error | table s/step | predicted / table |")
    print("|---|---|---|---|---|")
    for gbs, predicted, error, true in rows:
        print(f"| {gbs} | {predicted:.3f} | ±{error:.0%} | {true:.3f} | {predicted / true:.2f} |")


if __name__ == "__main__":
    main()
