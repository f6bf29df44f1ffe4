"""The GNS at which a larger global batch starts to pay off under the surrogate Φ (`cona_core.efficiency`).

Φ(s) = (gbs / T(s)) / (gbs + GNS): throughput in samples/s times the statistical efficiency of a sample at
batch gbs for gradient noise scale GNS (McCandlish et al. 2018: the steps to a target shrink as 1 + GNS / gbs).
"""

from __future__ import annotations

import math


def crossover_gns(gbs_small: float, t_small: float, gbs_large: float, t_large: float) -> float:
    """The GNS above which (gbs_large, t_large) has the larger Phi: 0.0 if it always does, inf if never.

    Solves (g2/T2)/(g2+G) = (g1/T1)/(g1+G): G = g1 g2 (T2 - T1) / (g2 T1 - g1 T2).
    """
    g1, t1, g2, t2 = gbs_small, t_small, gbs_large, t_large
    if g2 / t2 <= g1 / t1:  # no more throughput: the smaller batch wins at every GNS
        return math.inf
    if t2 <= t1:
        return 0.0
    return g1 * g2 * (t2 - t1) / (g2 * t1 - g1 * t2)
