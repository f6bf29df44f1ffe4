"""Accuracy of the calibrated iteration-time model on this machine.

Reads recorded step times of configs/tiny.yaml (scripts/data/layout_times_cpu.json, written by
scripts/bench_layouts.py: a list of {"dp","tp","pp","mbs","gbs","iter_s"}), keeps the rows with
dp*tp*pp equal to the config's world size, fits the cpu-local profile on a few layouts and prints the
MAPE of the predictions on the rest. Fit-subset rule (never looks at measured times): the layouts with
the largest dp, tp and pp first, then greedily the layout farthest (Euclidean, in log2 of dp, tp, pp,
mbs, gbs) from those already chosen - a maximin space-filling design, so that micro-batch size and
global batch vary too (they separate per-sample compute from per-micro-batch and per-step costs).
Also prints the held-out MAPE over random fit subsets of the same size (mean and worst).
Usage: .venv/bin/python scripts/bench_costmodel.py [--data PATH] [--fit N] [--cv DRAWS]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from cona_cli.planner.calibration import Calibrator, read_recording
from cona_cli.planner.costmodel import as_array, iteration_time
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.workload import Workload
from cona_cli.run_config import load_config
from cona_core.config import Config
from cona_core.strategy import Strategy

ROOT = Path(__file__).resolve().parent.parent


def choose_fit(order: list[Strategy], n: int) -> list[Strategy]:
    """The most dp-, tp- and pp-heavy layouts, then a greedy maximin design in log2 feature space."""
    fit: list[Strategy] = []
    for axis in ("dp", "tp", "pp"):
        pick = max((s for s in order if s not in fit), key=lambda s: (getattr(s, axis), -s.world), default=None)
        if pick is not None:
            fit.append(pick)
    feat = {s: np.log2([s.dp, s.tp, s.pp, s.mbs, s.gbs]) for s in order}
    while len(fit) < n:
        rest = [s for s in order if s not in fit]
        fit.append(max(rest, key=lambda s: min(float(np.linalg.norm(feat[s] - feat[t])) for t in fit)))
    return fit[:n]


def held_out_mape(cfg: Config, times: dict[Strategy, list[float]], fit: list[Strategy]) -> tuple[float, Calibrator]:
    """Fit the cpu-local profile on `fit`; MAPE of the predictions on every other layout."""
    cal = Calibrator(Workload.from_config(cfg), load_hardware("cpu-local"), seed=cfg.search.seed)
    for s in fit:
        for t in times[s]:
            cal.add(s, t)
    cal.fit()
    held = [s for s in sorted(times) if s not in fit]
    measured = np.array([np.median(times[s]) for s in held])
    return float(np.mean(np.abs(cal.predict(as_array(held))[0] - measured) / measured)), cal


def cross_validate(cfg: Config, times: dict[Strategy, list[float]], n: int, draws: int, seed: int) -> list[float]:
    """Held-out MAPE over `draws` random fit subsets of n layouts (seeded)."""
    rng = np.random.default_rng(seed)
    order = sorted(times)
    return [
        held_out_mape(cfg, times, [order[i] for i in rng.choice(len(order), n, replace=False)])[0] for _ in range(draws)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "scripts" / "data" / "layout_times_cpu.json")
    parser.add_argument("--fit", type=int, default=6, help="layouts to fit on (held-out must stay the majority)")
    parser.add_argument("--cv", type=int, default=20, help="random fit subsets for cross-validation (0: none)")
    args = parser.parse_args()
    if not args.data.is_file():
        print(f"{args.data}: no recorded measurements (run scripts/bench_layouts.py first)")
        return 2
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    recorded = read_recording(args.data)
    times = {s: t for s, t in recorded.items() if s.world == cfg.cluster.world}
    skipped = len(recorded) - len(times)
    order = sorted(times)
    if not 1 <= args.fit < len(order) / 2:
        print(f"--fit {args.fit}: need 1 <= N < {len(order) / 2:g} so that held-out layouts are the majority")
        return 2
    fit = choose_fit(order, args.fit)
    held = [s for s in order if s not in fit]
    if not held:
        print(f"{args.data}: {len(times)} layouts of world {cfg.cluster.world}, need more than --fit {args.fit}")
        return 2
    _, cal = held_out_mape(cfg, times, fit)
    measured = np.array([np.median(times[s]) for s in held])
    predicted, _ = cal.predict(as_array(held))
    errors = np.abs(predicted - measured) / measured
    print(
        f"{len(recorded)} layouts, {skipped} skipped (world != {cfg.cluster.world}); fitted on {len(fit)} of "
        f"{len(order)} layouts (largest dp, tp, pp, then maximin in log2 features): {', '.join(map(str, fit))}"
    )
    print("fitted " + ", ".join(f"{k}={v:.3g}" for k, v in cal.to_dict()["params"].items()))
    for s, m, p, e in zip(held, measured, predicted, errors):
        print(f"  {s!s:<26} measured {m:7.3f} s  predicted {p:7.3f} s  error {e:6.1%}")
    analytic = iteration_time(as_array(held), cal.workload, cal.fitted)
    prior = iteration_time(as_array(held), cal.workload, cal.prior)
    print(
        f"MAPE on {len(held)} held-out layouts: {errors.mean():.1%} (target <= 10%); analytic model alone "
        f"{np.mean(np.abs(analytic - measured) / measured):.1%}; uncalibrated profile "
        f"{np.mean(np.abs(prior - measured) / measured):.1%}"
    )
    if args.cv:
        cv = cross_validate(cfg, times, args.fit, args.cv, cfg.search.seed)
        print(
            f"cross-validation over {args.cv} random fit subsets of {args.fit}: held-out MAPE mean "
            f"{np.mean(cv):.1%}, worst {np.max(cv):.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
