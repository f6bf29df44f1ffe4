"""The statistical efficiency of a batch: progress per second Φ, its ratio between two strategies, and the
LR gain of AdaScale, all from one term, gbs + G.

With G the gradient noise scale, the steps to a target shrink as 1 + G/b with the batch b (McCandlish et
al. 2018), so a step at batch b makes progress b/(b + G) and a sample 1/(b + G). Then
- Φ(s) = (b/T(s)) / (b + G): samples per second times a sample's progress (the planner's surrogate, the
  cona policy's objective);
- Φ'/Φ: a candidate strategy against the running one (the switch rule);
- r = (b/b₀)(b₀ + G)/(b + G): how many steps at b₀ one step at b is worth (AdaScale's gain; the workers'
  LR recipe, `launch.lr`). Progress per second on r's clock is r/T ∝ Φ: the training follows the quantity
  the policy ranks strategies by.

Pure functions of floats; `phi` also of numpy arrays (elementwise).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    Number = float | np.ndarray


def phi(gbs: Number, seconds: Number, gns: Number, kappa: float = 1.0) -> Number:
    """Progress per second: (gbs / T) / (gbs + κ·GNS); κ = 1 is the paper's Φ (see planner.kappa)."""
    return (gbs / seconds) / (gbs + kappa * gns)


def phi_ratio(gbs: int, t: float, gbs_candidate: int, t_candidate: float, gns: float) -> float:
    """Φ(candidate) / Φ(current) at noise scale `gns` (which may be infinite: the throughput ratio)."""
    throughput = (gbs_candidate / t_candidate) / (gbs / t)
    if math.isinf(gns):
        return throughput
    return throughput * (gbs + gns) / (gbs_candidate + gns)


def gain(gbs: int, base_gbs: int, gns: float | None) -> float:
    """r: how many steps at `base_gbs` one step at `gbs` is worth at noise scale `gns` (1 without one)."""
    if gns is None or not gns > 0:
        return 1.0
    return (gbs / base_gbs) * (base_gbs + gns) / (gbs + gns)
