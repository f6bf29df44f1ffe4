"""The base LR, calibrated online: after warmup the LR is raised by √2 while the hypergradient says that a
longer step would have lowered the loss.

After an update θ_t = θ_{t−1} − η·u (u the AdamW direction m̂/(√v̂ + ε) + λθ), the next batch's gradient
g_t gives the loss's derivative by that step's LR, dL/dη = −g_t·u (Baydin et al. 2018, "Online learning
rate adaptation with hypergradient descent"). The batch's noise is independent of u, so the mean of the
cosine c_t = g_t·u / (|g_t| |u|) over a window is positive where the steps fall short and negative where
they overshoot. The window after warmup (once Adam's second moment describes the run) is read `LOOKS`
times, every WINDOW / LOOKS steps: a mean above 0 at the policy's confidence split over the looks (its
t-statistic above z at α / LOOKS, Bonferroni) raises the LR by √2 and starts a new window, so a clear
signal acts after a fifth of the window at the false-raise rate of one read; a window that reaches its
`WINDOW` steps without raising settles the LR for the rest of the run. It only ever raises: the
one-step signal turns negative as training goes on and reads below the LR that a long run does best with
(docs/switching.md), so it can tell an LR that is too low, not find the best one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from launch.dtensor_pieces import local_tensor

WINDOW = 50  # steps per reading of the hypergradient's sign
LOOKS = 5  # reads of each window, its confidence split over them
RAISE = math.sqrt(2)  # the LR's step up (Adam's LR for twice the batch, by the square-root rule)


@torch.no_grad()
def hypergradient_terms(
    pairs: Iterable[tuple[torch.nn.Parameter, torch.Tensor]], opt: torch.optim.Optimizer
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """This rank's shares of g·u and |u|² over `pairs` (each parameter with its gradient in the parameter's
    layout, the pieces this rank counts), u the direction of the last AdamW update from the optimizer's
    moments (read before this step's update; λθ_t stands in for λθ_{t−1}). A parameter without optimizer
    state adds 0."""
    groups = {id(p): group for group in opt.param_groups for p in group["params"]}
    gu: torch.Tensor | float = 0.0
    uu: torch.Tensor | float = 0.0
    for p, g in pairs:
        state, group = opt.state.get(p), groups[id(p)]
        if not state:
            continue
        (beta1, beta2), k = group["betas"], float(state["step"])
        m = local_tensor(state["exp_avg"]).double() / (1 - beta1**k)
        v = local_tensor(state["exp_avg_sq"]).double() / (1 - beta2**k)
        u = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * local_tensor(p.detach()).double()
        gu = gu + (local_tensor(g).double() * u).sum()
        uu = uu + u.pow(2).sum()
    return gu, uu


def look_z(z: float) -> float:
    """The threshold of one look: z's one-sided tail split over the `LOOKS` (2.33 → 2.88)."""
    normal = statistics.NormalDist()
    return normal.inv_cdf(1 - normal.cdf(-z) / LOOKS)


@dataclass
class LrCalibration:
    """The base LR's multiplier (`gain`), the window's cosines and whether it is settled: a checkpoint's."""

    gain: float = 1.0
    settled: bool = False
    cosines: list[float] = field(default_factory=list)
    reads: list[float] = field(default_factory=list)  # each window's t-statistic

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> LrCalibration:
        return cls(**state) if state else cls()

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def add(self, gu: float, gg: float, uu: float, z: float) -> bool:
        """One step's g·u, |g|² and |u|² (summed over ranks); at each look, raise the gain if the mean cosine
        is above 0 at `z` split over the looks; at the window's end, settle if it did not. Returns whether
        this step ended a window."""
        if self.settled or gg <= 0 or uu <= 0:
            return False
        self.cosines.append(gu / math.sqrt(gg * uu))
        n = len(self.cosines)
        if n % (WINDOW // LOOKS):
            return False
        spread = statistics.stdev(self.cosines)
        t = statistics.fmean(self.cosines) / (spread / math.sqrt(n)) if spread > 0 else 0.0
        raise_lr = t > look_z(z)
        if not raise_lr and n < WINDOW:
            return False
        self.reads.append(t)
        self.cosines = []
        if raise_lr:
            self.gain *= RAISE
        else:
            self.settled = True
        return True
