"""Gradient noise scale: the unbiased two-batch estimator (McCandlish et al. 2018), pooled over a window.

With gradient squared norms |G_small|^2 (mean over batches of B_small samples) and |G_big|^2 (one
batch of B_big samples), E|G_B|^2 = |G|^2 + tr(Sigma)/B gives the unbiased estimates

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

and GNS = tr(Sigma) / |G|^2, in samples: the ratio of the two estimates' means over the steps that
cover the last `window` samples (a window in samples, so runs with large batches, few steps, do not
hold on to their early values). One window type serves both readers, so that they pool the same raw
estimates by construction; only its reset rule differs:
- the workers' LR (`per_batch=False`) keeps the steps of an earlier batch in the window;
- the cona policy (`per_batch=True`) starts a new window when the batch changes: the estimate depends on
  the batch that trained the weights (from one state, 20–60 steps at gbs 32 read 63–100 where gbs 8
  reads 27–40, docs/switching.md), so an old batch's estimates would bias comparisons made after it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cona_core.strategy import Strategy


def measurable(s: Strategy, dp_impl: str = "ddp") -> bool:
    """Whether a step under `s` holds the estimator's two batches: the replicas' gradients (dp > 1) or
    the first micro-batch's (several of them); under FSDP the latter only, and only without pipelining
    (its schedule reduces once, after the last micro-batch). One process at gbs = mbs measures nothing."""
    if dp_impl == "fsdp":
        return s.pp == 1 and s.n_microbatches > 1
    return s.dp > 1 or s.n_microbatches > 1


def two_batch_estimate(b_small: float, small_sq: float, b_big: float, big_sq: float) -> tuple[float, float]:
    """Raw (|G|^2, tr(Sigma)) from one step's small- and big-batch squared norms."""
    if not b_big > b_small > 0:
        raise ValueError(f"need B_big > B_small > 0, got {b_big}, {b_small}")
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


class NoiseWindow:
    """The two-batch estimates of the most recent steps that cover `window` samples, pooled as a ratio of
    means. Each step counts only while it is in the window: a ratio of exponential averages instead keeps
    an outlier for many windows (one loss spike's |G|², 10⁵ times its neighbours', held a gpt-tiny run's
    estimate near that step's own 0.19 for 150 steps while the steps after it read 7–30). `per_batch`:
    a step at another batch than the last entry's empties the window first (module docstring)."""

    def __init__(
        self, window: float = 1024.0, entries: Iterable[Iterable[float]] = (), per_batch: bool = False
    ) -> None:
        self.window = window
        self.per_batch = per_batch
        self.entries: deque[tuple[int, float, float]] = deque()  # (gbs, |G|², tr Σ) per step
        for gbs, grad_sq, trace in entries:
            self.add(int(gbs), grad_sq, trace)

    def add(self, gbs: int, grad_sq: float | None, trace: float | None) -> None:
        """One step at batch `gbs` and its raw estimates; a step without them (None: held, or not measured
        under its layout) adds nothing, but under `per_batch` still ends the previous batch's window."""
        if self.per_batch and self.entries and self.entries[-1][0] != gbs:
            self.entries.clear()
        if grad_sq is None or trace is None:
            return
        self.entries.append((gbs, float(grad_sq), float(trace)))
        while sum(n for n, _, _ in self.entries) - self.entries[0][0] >= self.window:
            self.entries.popleft()

    def clear(self) -> None:
        self.entries.clear()

    @property
    def means(self) -> tuple[float, float] | None:
        """(mean |G|², mean tr Σ) over the window; None while it is empty."""
        if not self.entries:
            return None
        n = len(self.entries)
        return sum(g for _, g, _ in self.entries) / n, sum(t for _, _, t in self.entries) / n

    @property
    def gns(self) -> float | None:
        """mean tr Σ / mean |G|² in samples; None until both means are positive."""
        m = self.means
        if m is None or m[0] <= 0 or m[1] <= 0:
            return None
        return m[1] / m[0]

    def interval(self, confidence: float) -> NoiseInterval | None:
        return pooled_noise_scale([g for _, g, _ in self.entries], [t for _, _, t in self.entries], confidence)

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [list(e) for e in self.entries]}


@dataclass(frozen=True)
class NoiseInterval:
    """A pooled GNS estimate and one-sided confidence bounds on it (`high` may be infinite)."""

    value: float
    low: float
    high: float


def pooled_noise_scale(grad_sq: list[float], trace: list[float], confidence: float) -> NoiseInterval | None:
    """GNS from several steps' raw two-batch estimates, mean(tr Σ) / mean(|G|²), with Fieller's bounds
    for a ratio of correlated means at the one-sided `confidence` level (Student's t, n - 1 degrees of
    freedom). Unlike a linearised error, Fieller's bounds stay honest when mean(|G|²) is barely above 0,
    where the ratio explodes: the upper bound is then infinite. None with fewer than 3 steps or a mean
    that is not positive yet."""
    from scipy.stats import t as student_t

    n = len(grad_sq)
    if n < 3:
        return None
    g, tr = sum(grad_sq) / n, sum(trace) / n
    if g <= 0 or tr <= 0:
        return None
    var_g = sum((x - g) ** 2 for x in grad_sq) / (n - 1) / n  # variances of the means
    var_t = sum((x - tr) ** 2 for x in trace) / (n - 1) / n
    cov = sum((x - g) * (y - tr) for x, y in zip(grad_sq, trace)) / (n - 1) / n
    q2 = float(student_t.ppf(confidence, n - 1)) ** 2
    # (tr - G g)^2 <= q^2 Var(tr - G g): a G^2 - 2 b G + c <= 0
    a, b, c = g * g - q2 * var_g, tr * g - q2 * cov, tr * tr - q2 * var_t
    if a <= 0:  # mean(|G|²) is not clearly positive: the set of plausible G is unbounded above
        return NoiseInterval(tr / g, 0.0, math.inf)
    root = math.sqrt(max(b * b - a * c, 0.0))
    return NoiseInterval(tr / g, max((b - root) / a, 0.0), (b + root) / a)
