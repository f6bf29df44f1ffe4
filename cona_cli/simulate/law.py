"""Training dynamics for the simulator: Kaplan et al. 2020's fits ("Scaling Laws for Neural Language
Models", §5: L(N, S_min) and the critical batch), in sequences of the config's length.

Loss against the minimal number of steps: L(N, S_min) = (N_c/N)^α_N + (S_c/S_min)^α_S, N the
non-embedding parameters. A step at batch B (sequences) is worth 1/(1 + B_crit(L)/B) minimal steps, with
B_crit(L) = B*/L^(1/α_B) tokens: the gradient noise scale a perfect estimator would read.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KaplanLaw:
    n_params: float  # non-embedding parameters
    seq_len: int
    alpha_n: float = 0.076
    n_c: float = 8.8e13
    alpha_s: float = 0.76
    s_c: float = 2.1e3
    b_star: float = 2.0e8  # tokens
    alpha_b: float = 0.21

    def loss(self, s_min: float) -> float:
        """Nats per token after `s_min` minimal steps (infinite before the first)."""
        if s_min <= 0:
            return math.inf
        return (self.n_c / self.n_params) ** self.alpha_n + (self.s_c / s_min) ** self.alpha_s

    def s_min(self, loss: float) -> float:
        """The minimal steps that reach `loss` (the inverse of `loss`; 0 for an infinite loss)."""
        if not math.isfinite(loss):
            return 0.0
        return self.s_c / (loss - self.loss_floor()) ** (1 / self.alpha_s)

    def critical_batch(self, loss: float) -> float:
        """B_crit(L) in sequences (0 while the loss is infinite)."""
        if not math.isfinite(loss):
            return 0.0
        return self.b_star / loss ** (1 / self.alpha_b) / self.seq_len

    def progress(self, gbs: int, loss: float) -> float:
        """Minimal steps one step at `gbs` sequences is worth at this loss."""
        return 1.0 / (1.0 + self.critical_batch(loss) / gbs)

    def loss_floor(self) -> float:
        """The loss with unlimited steps (the model-size term)."""
        return (self.n_c / self.n_params) ** self.alpha_n


@dataclass(frozen=True)
class KaplanDynamics:
    """The world's training under Kaplan's law, as a function of the loss reached: a step at `gbs` from
    loss L adds the law's progress times (gbs / base_gbs)^`lr_sensitivity` minimal steps (0: the law;
    above 0 a larger batch needs fewer samples, as when the base LR is below the best one and the recipe
    raises it with the batch). The workers report a GNS of B_crit / `true_kappa` with a relative error
    of `gns_noise` per step."""

    law: KaplanLaw
    base_gbs: int
    true_kappa: float = 1.0
    gns_noise: float = 0.5
    lr_sensitivity: float = 0.0

    def start_loss(self) -> float:
        return math.inf

    def floor(self) -> float:
        return self.law.loss_floor()

    def progress(self, gbs: int, loss: float) -> float:
        """Minimal steps one step at `gbs` is worth at `loss`."""
        return self.law.progress(gbs, loss) * (gbs / self.base_gbs) ** self.lr_sensitivity

    def after(self, gbs: int, loss: float) -> float:
        """The loss one step at `gbs` leads to from `loss`."""
        return self.law.loss(self.law.s_min(loss) + self.progress(gbs, loss))

    def grid(self, stop_loss: float, points: int) -> list[float]:
        """Losses from the start to just past `stop_loss`, geometric in minimal steps."""
        s_stop = self.law.s_min(stop_loss)
        return [math.inf, *(self.law.loss(s) for s in np.geomspace(1.0, max(s_stop * (1 + 1e-9), 1.0), points))]

    def samples(self, gbs: int, high: float, low: float) -> float:
        """Samples `gbs` needs to bring the loss from `high` to `low` (at the stretch's middle progress)."""
        lo, hi = self.law.s_min(high), self.law.s_min(low)
        return gbs * (hi - lo) / self.progress(gbs, self.law.loss((lo + hi) / 2))

    def report(self, gbs: int, loss: float, rng: random.Random) -> tuple[float, float]:
        """One step's (|G|², tr Σ) as the workers' two-batch estimator would send it."""
        measured = self.law.critical_batch(loss) / self.true_kappa
        return 1.0 + 0.3 * rng.gauss(0.0, 1.0), measured * (1.0 + self.gns_noise * rng.gauss(0.0, 1.0))
