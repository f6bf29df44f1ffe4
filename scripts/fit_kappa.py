"""Fit κ (Φ_κ's multiplier on GNS) from fixed-batch runs, and check it: predicted vs measured tokens.

Each run folder is one fixed global batch (e.g. bench_ttp.py's static-<gbs> runs, same seed). The
probe loss is the run's validation loss on its fixed slice; the GNS in force before each evaluation
is the last smoothed GNS of the step rows. Prints κ with its 95% interval (cona_cli.planner.kappa),
then, per target perplexity, the tokens each run needed relative to the smallest batch, against what
Φ_κ predicts from the smallest batch's run (equal loss at equal efficiency clock), at κ = 1 and at
the fitted κ: the check that Φ (κ = 1) predicts the token ratios of the recipe that ran. Then, pair by
pair of neighbouring batches, the larger one's samples over the smaller one's against Φ's
(b' + G)/(b + G) at the smaller run's GNS where it reached the target. Last, the rate a chain decision
turns on: from each loss level on, how fast each of two neighbouring batches lowers the training loss
(a running mean of 41 steps) by `--band` nats, the smaller's time over the larger's, against Φ's ratio
of the two there, (b'/T')/(b/T) · (b + G)/(b' + G) at the smaller run's G. `search.kappa` takes a fitted
value as an explicit override.

    python scripts/fit_kappa.py RUN_DIR RUN_DIR RUN_DIR [--targets 600,400,300] [--band 0.1]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cona_cli.planner.kappa import Curve, efficiency_clock, fit_kappa, predicted_token_ratio  # noqa: E402
from cona_cli.report.runlog import RunLog, read_run  # noqa: E402
from cona_core.efficiency import phi  # noqa: E402


def curve(log: RunLog) -> Curve:
    steps = sorted(log.steps, key=lambda s: s.time)
    rows = []
    for e in log.evals:
        before = [s for s in steps if s.time <= e.time and s.gns is not None]
        if before and e.consumed_samples and e.val_loss is not None:
            rows.append((e.consumed_samples, e.val_loss, before[-1].strategy.gbs, before[-1].gns))
    samples, loss, gbs, gns = (np.array(col, dtype=float) for col in zip(*rows))
    return Curve(samples, loss, gbs, gns)


def samples_to(c: Curve, loss: float) -> float | None:
    """Samples at which the curve first reaches `loss` (linear between evaluations)."""
    for i in range(1, len(c.loss)):
        if c.loss[i] <= loss < c.loss[i - 1]:
            f = (c.loss[i - 1] - loss) / (c.loss[i - 1] - c.loss[i])
            return float(c.samples[i - 1] + f * (c.samples[i] - c.samples[i - 1]))
    return None


def predicted_samples(base: Curve, other: Curve, loss: float, kappa: float) -> float | None:
    """Samples `other` needs to reach the clock at which `base` reached `loss`."""
    n = samples_to(base, loss)
    if n is None:
        return None
    target_m = float(np.interp(n, base.samples, efficiency_clock(base, kappa)))
    m = efficiency_clock(other, kappa)
    if m[-1] < target_m:
        return None
    return float(np.interp(target_m, m, other.samples))


def neighbour_ratios(curves: list[Curve], loss: float) -> list[tuple[int, int, float, float, float]]:
    """(smaller gbs, larger gbs, measured samples ratio, Φ's ratio at κ 1, the smaller run's GNS there) for
    each pair of neighbouring batches (curves sorted by batch) that both reached `loss`."""
    out = []
    for a, b in itertools.pairwise(curves):
        na, nb = samples_to(a, loss), samples_to(b, loss)
        if na is not None and nb is not None:
            g = float(np.interp(na, a.samples, a.gns))
            out.append((int(a.gbs[0]), int(b.gbs[0]), nb / na, predicted_token_ratio(b.gbs[0], a.gbs[0], g, 1.0), g))
    return out


def crossings(log: RunLog, levels: np.ndarray, width: int = 41) -> np.ndarray:
    """Time at which the running mean of `width` steps' training loss first reaches each level (nan: never)."""
    steps = [s for s in sorted(log.steps, key=lambda s: s.time) if s.loss is not None]
    t, loss = np.array([s.time for s in steps]), np.array([s.loss for s in steps])
    mean = np.convolve(loss, np.ones(width) / width, mode="valid")
    t = t[width // 2 : width // 2 + len(mean)]
    out = np.full(len(levels), np.nan)
    for i, level in enumerate(levels):
        below = np.flatnonzero(mean <= level)
        if below.size:
            out[i] = t[below[0]]
    return out


def local_rates(a: RunLog, b: RunLog, levels: np.ndarray) -> list[tuple[float, float, float, float]]:
    """(level, measured rate of b over a, Φ's, a's G) per band between consecutive `levels`, `a` the smaller batch."""
    ga, gb = a.steps[-1].strategy.gbs, b.steps[-1].strategy.gbs
    ta_step, tb_step = (float(np.median([s.iter_s for s in log.steps if s.iter_s])) for log in (a, b))
    ta, tb = crossings(a, levels), crossings(b, levels)
    out = []
    for i in range(len(levels) - 1):
        if np.isnan([ta[i], ta[i + 1], tb[i], tb[i + 1]]).any():
            continue
        near = [s.gns for s in a.steps if ta[i] <= s.time <= ta[i + 1] and s.gns is not None]
        if near:
            g = float(np.median(near))
            rate = (ta[i + 1] - ta[i]) / (tb[i + 1] - tb[i])
            out.append((float(levels[i]), rate, phi(gb, tb_step, g) / phi(ga, ta_step, g), g))
    return out


def _ratio(n: float | None, base: float | None) -> str:
    return f"{n / base:.3f}" if n is not None and base else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--targets", default="600,400,300")
    ap.add_argument("--band", type=float, default=0.1, help="nats of training loss per band of the local rates")
    args = ap.parse_args()
    if not args.band > 0:
        ap.error(f"--band must be a positive number of nats, got {args.band}")
    logs = sorted((read_run(r) for r in args.runs), key=lambda g: g.steps[-1].strategy.gbs)
    curves = [curve(log) for log in logs]
    fit = fit_kappa(curves)
    print(
        f"kappa {fit.kappa:.3g} (best fit {fit.best:.3g}, 95% interval {fit.low:.3g}–{fit.high:.3g}, "
        f"log-likelihood gain over kappa=1: {fit.evidence:.1f})"
    )
    base = curves[0]
    print(f"\ntokens to target relative to gbs {int(base.gbs[0])}: measured | predicted at kappa=1 | at the fit")
    for t in (float(x) for x in args.targets.split(",")):
        loss = math.log(t)
        n0 = samples_to(base, loss)
        cells = []
        for c in curves[1:]:
            n = samples_to(c, loss)
            p1, pk = predicted_samples(base, c, loss, 1.0), predicted_samples(base, c, loss, fit.best)
            cells.append(f"gbs {int(c.gbs[0])}: {_ratio(n, n0)} | {_ratio(p1, n0)} | {_ratio(pk, n0)}")
        print(f"ppl {t:g}: " + "; ".join(cells))
    print("\nneighbouring batches, samples of the larger over the smaller: measured | Φ at the smaller's GNS (G)")
    for t in (float(x) for x in args.targets.split(",")):
        pairs = neighbour_ratios(curves, math.log(t))
        print(f"ppl {t:g}: " + "; ".join(f"{b}/{a}: {m:.3f} | {p:.3f} ({g:.3g})" for a, b, m, p, g in pairs))
    targets = [math.log(float(x)) for x in args.targets.split(",")]
    levels = np.arange(max(targets), min(targets) - 1e-9, -args.band)
    print(f"\nlocal rates at equal training loss, {args.band:g} nats per band: larger over smaller, measured | Φ (G)")
    for a, b in itertools.pairwise(logs):
        rates = local_rates(a, b, levels)
        if rates:
            pair = f"{b.steps[-1].strategy.gbs}/{a.steps[-1].strategy.gbs}"
            cells = "; ".join(f"{lv:.2f}: {m:.2f} | {p:.2f} ({g:.3g})" for lv, m, p, g in rates)
            over = np.median([m / p for _, m, p, _ in rates])
            print(f"{pair}: {cells}; median measured/Φ {over:.2f}")


if __name__ == "__main__":
    main()
