"""Training dynamics measured in real runs (`cona simulate --from-run`): the world is what static runs
of the config did, not a law.

- **Loss**: each static run gives validation loss against samples at its evaluations (linear in
  samples to the first, linear in log samples after it, and along its last segment's log-samples slope
  beyond its last). A rung's curve is the mean over its runs of the samples each needs to each loss; a
  rung between two measured ones is interpolated in log batch and log samples. The world's state is
  the loss reached: a step at rung g from loss L moves to where rung g's curve is g samples further on
  (the chaining assumption: after a switch a rung continues from its own point at the same loss). A
  larger batch that needs fewer samples, which no law of the critical batch gives, is then what it was.
- **GNS**: each step's (|G|², tr Σ) is drawn from the runs' own step rows near the same loss (at the
  same rung when it was run, else the nearest one), so the policy sees the estimator's real noise.
- **Step time**: a strategy the runs used is timed by a draw from its own measured steps, and a launch of
  it pays what its runs' first (untimed) steps took beyond steady ones.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cona_cli.control.cona_policy import WARMUP_STEPS  # a launch's first steps are not timed
from cona_cli.control.resume import first_difference
from cona_cli.report.runlog import as_strategy
from cona_core.config import Config
from cona_core.rundir import RunDir, read_jsonl
from cona_core.strategy import Strategy

EXTRAPOLATE_NATS = 0.5  # how far below the lowest measured loss the curves are extended
GRID_POINTS = 4000  # losses on which every rung's samples-to-loss curve is tabulated
NEAREST = 8  # GNS rows drawn from among the nearest this many by loss on each side


class RunDataError(ValueError):
    """A --from-run folder that cannot give a curve."""


@dataclass(frozen=True)
class StaticRun:
    """What one static run measured."""

    path: Path
    strategy: Strategy
    samples: tuple[float, ...]  # at each evaluation
    losses: tuple[float, ...]  # validation loss there (each lower than the one before)
    noise: tuple[tuple[float, float, float], ...]  # (consumed samples, |G|², tr Σ) of its step rows
    iter_s: tuple[float, ...]  # its step times, a launch's first steps left out
    start_s: float  # run time before its first step began (process start, data, the first evaluation)
    eval_s: tuple[float, ...]  # the pause of each evaluation between two steps
    warmup_s: float  # what its first untimed steps took beyond as many of its median steps

    def _slope(self) -> float:
        """Loss per e-fold of samples along the last segment (it has samples > 0 at both ends)."""
        n, ls = self.samples, self.losses
        return (ls[-2] - ls[-1]) / math.log(n[-1] / n[-2])

    def samples_to(self, loss: float) -> float:
        """Samples this run needed to reach `loss` (0 at or above its first evaluation's)."""
        n, ls = self.samples, self.losses
        if loss >= ls[0]:
            return 0.0
        k = next((i for i in range(1, len(ls)) if ls[i] <= loss), None)
        if k is None:  # beyond the last evaluation: along the last segment's slope in log samples
            return n[-1] * math.exp((ls[-1] - loss) / self._slope())
        share = (ls[k - 1] - loss) / (ls[k - 1] - ls[k])
        return share * n[k] if k == 1 else n[k - 1] * (n[k] / n[k - 1]) ** share

    def loss_at(self, samples: float) -> float:
        """The validation loss after `samples` (the inverse of samples_to)."""
        n, ls = self.samples, self.losses
        if samples <= 0:
            return ls[0]
        k = bisect.bisect_left(n, samples)
        if k >= len(n):
            return ls[-1] - self._slope() * math.log(samples / n[-1])
        share = samples / n[k] if k == 1 else math.log(samples / n[k - 1]) / math.log(n[k] / n[k - 1])
        return ls[k - 1] + share * (ls[k] - ls[k - 1])


def read_static_run(path: Path, cfg: Config) -> StaticRun:
    """One static run of `cfg`'s model; RunDataError naming the folder if it cannot give a curve."""
    run = RunDir(path)
    if not run.metrics.is_file():
        raise RunDataError(f"--from-run: {path}: not a run directory (no metrics.jsonl)")
    if run.resolved_config.is_file():
        stored = json.loads(run.resolved_config.read_text())
        raw = cfg.to_raw()
        ours = {"model": raw["model"], "data": {k: raw["data"][k] for k in ("vocab_size", "tokenizer")}}
        theirs = {"model": stored.get("model"), "data": {k: stored.get("data", {}).get(k) for k in ours["data"]}}
        diff = first_difference(json.loads(json.dumps(ours)), theirs)
        if diff:
            raise RunDataError(f"--from-run: {path}: trained another model ({diff} differs from the config's)")
    rows = read_jsonl(run.metrics, [])
    steps = [r for r in rows if r.get("kind") == "step"]
    strategies = {str(s) for s in (as_strategy(r) for r in steps) if s is not None}
    if len(strategies) != 1:
        ran = ", ".join(sorted(strategies)) or "no step"
        raise RunDataError(f"--from-run: {path}: not a static run (it ran {ran})")
    evals = sorted(
        (float(r["consumed_samples"]), float(r["val_loss"]))
        for r in rows
        if r.get("kind") == "eval" and r.get("val_loss") is not None and r.get("consumed_samples") is not None
    )
    kept = [p for i, p in enumerate(evals) if all(p[1] < q[1] for q in evals[:i])]  # each lower than all before
    if not kept or kept[0][0] != 0 or len(kept) < 3:
        raise RunDataError(
            f"--from-run: {path}: needs an evaluation at step 0 and two lower ones after it (it has {len(kept)})"
        )
    noise = tuple(
        (float(r["consumed_samples"]), float(r["grad_sq_raw"]), float(r["trace_raw"]))
        for r in steps
        if r.get("grad_sq_raw") is not None and r.get("trace_raw") is not None
    )
    pauses, last_step, evaluated = [], None, False
    for r in rows:  # an evaluation's pause: from the step before it to the start of the step after it
        if r.get("kind") == "eval" and r.get("step"):
            evaluated = last_step is not None
        elif r.get("kind") == "step" and r.get("iter_s") is not None:
            if evaluated:
                pauses.append(max(0.0, float(r["time"]) - float(r["iter_s"]) - last_step))
            last_step, evaluated = float(r["time"]), False
    first = steps[0]
    start_s = max(0.0, float(first["time"]) - float(first.get("iter_s") or 0.0))
    seen: dict[Any, int] = {}
    times, warmup = [], []
    for r in steps:
        seen[r.get("launch")] = seen.get(r.get("launch"), 0) + 1
        if r.get("iter_s"):
            (times if seen[r.get("launch")] > WARMUP_STEPS else warmup).append(float(r["iter_s"]))
    warmup = warmup[:WARMUP_STEPS]  # the first launch's
    warmup_s = max(0.0, sum(warmup) - len(warmup) * statistics.median(times)) if times else 0.0
    return StaticRun(
        path,
        Strategy.parse(strategies.pop()),
        *map(tuple, zip(*kept)),  # type: ignore[arg-type]
        noise,
        tuple(times),
        start_s,
        tuple(pauses),
        warmup_s,
    )


class RunDynamics:
    """The world's training as static runs of the same config measured it (see the module's doc)."""

    def __init__(self, runs: list[StaticRun], ladder: list[int]) -> None:
        self.by_gbs: dict[int, list[StaticRun]] = {}
        for r in runs:
            self.by_gbs.setdefault(r.strategy.gbs, []).append(r)
        if not runs:
            raise RunDataError("--from-run: no runs given")
        self.start = min(r.losses[0] for r in runs)
        self.end = min(r.losses[-1] for r in runs) - EXTRAPOLATE_NATS
        self.grid_losses = np.linspace(self.start, self.end, GRID_POINTS)
        self._curves: dict[int, np.ndarray] = {
            g: np.mean([[r.samples_to(float(v)) for v in self.grid_losses] for r in rs], axis=0)
            for g, rs in self.by_gbs.items()
        }
        self._noise: dict[int, tuple[list[float], list[tuple[float, float]]]] = {}
        for g, rs in self.by_gbs.items():
            pairs = sorted((r.loss_at(n), (sq, tr)) for r in rs for n, sq, tr in r.noise)
            if pairs:
                self._noise[g] = ([p[0] for p in pairs], [p[1] for p in pairs])
        if not self._noise:
            raise RunDataError("--from-run: the runs carry no GNS estimates (train.gns off, or FSDP)")

    def curve(self, gbs: int) -> np.ndarray:
        """Samples rung `gbs` needs to each grid loss: measured, interpolated in log batch and log samples
        between the measured rungs around it, or beyond them those of the nearest (no batch outside the
        runs' is taken to be better or worse per sample)."""
        if gbs not in self._curves:
            below = [g for g in self.by_gbs if g < gbs]
            above = [g for g in self.by_gbs if g > gbs]
            if not below or not above:
                return self._curves.setdefault(gbs, self._curves[max(below) if below else min(above)])
            lo, hi = max(below), min(above)
            w = math.log(gbs / lo) / math.log(hi / lo)
            a, b = self._curves[lo], self._curves[hi]
            with np.errstate(divide="ignore"):
                geo = np.exp((1 - w) * np.log(a) + w * np.log(b))
            self._curves[gbs] = np.where((a > 0) & (b > 0), geo, (1 - w) * a + w * b)
        return self._curves[gbs]

    def start_loss(self) -> float:
        return self.start

    def floor(self) -> float:
        """How far the curves are extended: EXTRAPOLATE_NATS below the lowest loss a run reached."""
        return self.end

    def _samples(self, gbs: int, loss: float) -> float:
        return float(np.interp(-loss, -self.grid_losses, self.curve(gbs)))

    def after(self, gbs: int, loss: float) -> float:
        n = self.curve(gbs)
        return float(np.interp(self._samples(gbs, loss) + gbs, n, self.grid_losses))

    def grid(self, stop_loss: float, points: int) -> list[float]:
        return [float(v) for v in np.linspace(self.start, stop_loss - 1e-9, points + 1)]

    def samples(self, gbs: int, high: float, low: float) -> float:
        return self._samples(gbs, low) - self._samples(gbs, high)

    def report(self, gbs: int, loss: float, rng: random.Random) -> tuple[float, float]:
        """A measured step's (|G|², tr Σ) from near `loss`, at this rung if it was run, else the nearest."""
        g = min(self._noise, key=lambda m: (abs(math.log(m / gbs)), m))
        losses, values = self._noise[g]
        i = bisect.bisect_left(losses, loss)
        return values[rng.randrange(max(0, i - NEAREST), min(len(values), i + NEAREST))]

    def overheads(self) -> tuple[float, float]:
        """Median seconds before the first step and per evaluation, over the runs."""
        runs = [r for rs in self.by_gbs.values() for r in rs]
        pauses = [p for r in runs for p in r.eval_s]
        return statistics.median(r.start_s for r in runs), statistics.median(pauses) if pauses else 0.0

    def warmups(self) -> dict[Strategy, float]:
        """Per strategy run, the mean of what a launch's first untimed steps took beyond steady ones."""
        out: dict[Strategy, list[float]] = {}
        for rs in self.by_gbs.values():
            for r in rs:
                out.setdefault(r.strategy, []).append(r.warmup_s)
        return {s: statistics.fmean(v) for s, v in out.items()}

    def measured_times(self) -> dict[Strategy, list[float]]:
        out: dict[Strategy, list[float]] = {}
        for rs in self.by_gbs.values():
            for r in rs:
                out.setdefault(r.strategy, []).extend(r.iter_s)
        return out

    def describe(self) -> str:
        """One line per measured rung: its runs and the samples it needed to the lowest loss all reached."""
        common = max(r.losses[-1] for rs in self.by_gbs.values() for r in rs)
        parts = []
        for g in sorted(self.by_gbs):
            rs = self.by_gbs[g]
            t = statistics.median(v for r in rs for v in r.iter_s) if any(r.iter_s for r in rs) else math.nan
            parts.append(
                f"gbs {g}: {len(rs)} run(s), {self._samples(g, common):.0f} samples to ppl "
                f"{math.exp(common):.4g}, {t:.3g} s/step"
            )
        return "runs: " + "; ".join(parts)

    def unmeasured(self, ladder: list[int]) -> str | None:
        """A line naming the rungs outside the measured batches, or None."""
        lo, hi = min(self.by_gbs), max(self.by_gbs)
        out = [g for g in ladder if g < lo or g > hi]
        if not out:
            return None
        return (
            f"no run at gbs {', '.join(map(str, out))}: taken to need the samples of gbs "
            f"{', '.join(str(lo if g < lo else hi) for g in out)} per loss"
        )
