"""Gradient noise scale: the unbiased two-batch estimator (McCandlish et al. 2018) with smoothing.

With gradient squared norms |G_small|^2 (mean over batches of B_small samples) and |G_big|^2 (one
batch of B_big samples), E|G_B|^2 = |G|^2 + tr(Sigma)/B gives the unbiased estimates

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

and GNS = tr(Sigma) / |G|^2, in samples. Numerator and denominator are smoothed separately with a
bias-corrected EMA whose per-step decay exp(-gbs / window) forgets a fixed number of *samples*, so
runs with large batches (few steps) do not hold on to their early values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from cona_cli.strategy import Strategy


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


@dataclass
class NoiseScale:
    """Smoothed |G|^2 and tr(Sigma); the state is plain numbers, saved in every checkpoint."""

    window: float = 1024.0  # samples over which the EMA forgets (1/e)
    grad_sq: float = 0.0  # biased EMAs and their weight (for bias correction)
    trace: float = 0.0
    weight: float = 0.0
    steps: int = 0

    def update(self, gbs: int, grad_sq_raw: float, trace_raw: float) -> None:
        decay = math.exp(-gbs / self.window)
        self.grad_sq = decay * self.grad_sq + (1 - decay) * grad_sq_raw
        self.trace = decay * self.trace + (1 - decay) * trace_raw
        self.weight = decay * self.weight + (1 - decay)
        self.steps += 1

    @property
    def smoothed(self) -> tuple[float, float] | None:
        if self.weight <= 0:
            return None
        return self.grad_sq / self.weight, self.trace / self.weight

    @property
    def gns(self) -> float | None:
        """tr(Sigma) / |G|^2 in samples; None until both smoothed values are positive."""
        s = self.smoothed
        if s is None or s[0] <= 0 or s[1] <= 0:
            return None
        return s[1] / s[0]

    def state_dict(self) -> dict[str, float]:
        return asdict(self)


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
