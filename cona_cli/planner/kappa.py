"""κ: how much larger the effective noise scale is than the measured GNS, fitted from loss curves.

Φ_κ = (gbs/T) / (gbs + κ·GNS). Under the default recipe (`launch.lr`, adascale, the GNS of
Adam-preconditioned gradients) Φ with κ = 1 is what the training follows; this fit is the check of
that claim (`scripts/fit_kappa.py` on fixed-batch runs), and `search.kappa` an explicit override.

The model: a sample at batch b and noise scale G is worth 1 / (1 + b / (κ G)) of a sample at b → 0,
so each curve's progress runs on an efficiency clock m(n) = Σ Δn_k / (1 + b_k / (κ G_k)), and the loss
on a fixed probe set (the run's validation slice) follows one power law of that clock for every run:
L = L∞ + A (m / 10⁵ + c)^(−α). κ is profiled over [1/4, 32] by least squares of that law; log κ is
shrunk toward 0 (prior σ = ln 2), the interval is that posterior's 95% range, and κ = 1 is kept
unless the fit is clearly better (by `MIN_EVIDENCE` log-likelihood units), so weak or flat evidence
(one batch size, noise) leaves the paper's Φ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

GRID = np.geomspace(0.25, 32.0, 57)
PRIOR_SIGMA = math.log(2.0)
MIN_EVIDENCE = 2.0  # log-likelihood units the best κ must gain over κ = 1 to be used
CHI2_95 = 1.92  # half the 95% quantile of chi-square(1): profile-likelihood interval


@dataclass(frozen=True)
class Curve:
    """One run's (or segment's) probe-loss curve: at each point the samples consumed so far, the loss,
    and the global batch and smoothed GNS in force since the previous point."""

    samples: np.ndarray
    loss: np.ndarray
    gbs: np.ndarray
    gns: np.ndarray


@dataclass(frozen=True)
class KappaFit:
    kappa: float  # what to use (1.0 when the evidence is weak)
    low: float  # 95% interval of the best fit
    high: float
    best: float  # the best-fitting κ, before the evidence rule
    evidence: float  # log-likelihood gain of the best κ over κ = 1

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in vars(self).items()}


def efficiency_clock(c: Curve, kappa: float) -> np.ndarray:
    """m at each point of the curve: samples weighted by their statistical efficiency."""
    delta = np.diff(c.samples, prepend=0.0)
    weight = 1.0 / (1.0 + c.gbs / np.maximum(kappa * c.gns, 1e-9))
    return np.cumsum(delta * weight)


def _power_law_sse(clocks: list[np.ndarray], losses: list[np.ndarray]) -> float:
    m = np.concatenate(clocks) / 1e5
    y = np.concatenate(losses)

    def residual(p: np.ndarray) -> np.ndarray:
        l_inf, log_a, log_c, alpha = p
        return l_inf + np.exp(log_a) * (m + np.exp(log_c)) ** (-alpha) - y

    start = np.array([y.min() * 0.8, math.log(max(y.max() - y.min(), 1e-3)), math.log(0.05), 0.5])
    fit = least_squares(residual, start, bounds=([0, -20, -12, 0.01], [y.min(), 20, 5, 5]), max_nfev=400)
    return float(np.sum(fit.fun**2))


def profile(curves: list[Curve], grid: np.ndarray = GRID) -> tuple[np.ndarray, np.ndarray]:
    """Log-likelihood (Gaussian residuals, variance profiled out) of each κ on the grid."""
    n = sum(len(c.loss) for c in curves)
    sse = np.array([_power_law_sse([efficiency_clock(c, k) for c in curves], [c.loss for c in curves]) for k in grid])
    return grid, -0.5 * n * np.log(np.maximum(sse, 1e-300) / n)


def fit_kappa(curves: list[Curve], grid: np.ndarray = GRID) -> KappaFit:
    """κ from probe-loss curves at several batch sizes; κ = 1 unless the evidence is clear."""
    if sum(len(c.loss) for c in curves) < 6 or len({int(b) for c in curves for b in c.gbs}) < 2:
        return KappaFit(1.0, float(grid[0]), float(grid[-1]), 1.0, 0.0)  # one batch size cannot tell κ
    ks, loglik = profile(curves, grid)
    posterior = loglik - np.log(ks) ** 2 / (2 * PRIOR_SIGMA**2)
    i = int(np.argmax(posterior))
    # The interval of the same (shrunk) posterior as the best κ, so that it contains it. The threshold
    # is crossed between grid points: report the neighbours outside the region.
    inside = np.flatnonzero(posterior >= posterior.max() - CHI2_95)
    low, high = ks[max(inside.min() - 1, 0)], ks[min(inside.max() + 1, len(ks) - 1)]
    best = _vertex(np.log(ks), posterior, i)
    at_one = float(np.interp(0.0, np.log(ks), loglik))
    evidence = float(loglik[i] - at_one)
    kappa = best if evidence >= MIN_EVIDENCE else 1.0
    return KappaFit(kappa, float(low), float(high), best, evidence)


def _vertex(x: np.ndarray, y: np.ndarray, i: int) -> float:
    """exp of the parabola's vertex through the maximum and its neighbours (the grid point at the ends)."""
    if i == 0 or i == len(x) - 1:
        return float(np.exp(x[i]))
    (a, b, _) = np.polyfit(x[i - 1 : i + 2], y[i - 1 : i + 2], 2)
    return float(np.exp(-b / (2 * a))) if a < 0 else float(np.exp(x[i]))


def predicted_token_ratio(gbs: float, base_gbs: float, gns: float, kappa: float) -> float:
    """Tokens gbs needs for the same progress as base_gbs at a constant GNS, relative to base_gbs."""
    return (1 + gbs / (kappa * gns)) / (1 + base_gbs / (kappa * gns))
