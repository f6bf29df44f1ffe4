"""Training dynamics for the simulator: Kaplan et al. 2020's fits ("Scaling Laws for Neural Language
Models", §5: L(N, S_min) and the critical batch), in sequences of the config's length.

Loss against the minimal number of steps: L(N, S_min) = (N_c/N)^α_N + (S_c/S_min)^α_S, N the
non-embedding parameters. A step at batch B (sequences) is worth 1/(1 + B_crit(L)/B) minimal steps, with
B_crit(L) = B*/L^(1/α_B) tokens: the gradient noise scale a perfect estimator would read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
