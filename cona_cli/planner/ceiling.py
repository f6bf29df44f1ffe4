"""How much chaining can gain at most over the offline planner's pick, from predicted step times alone.

Φ(s) = x_s / (gbs_s + G), x the samples/s. Against the static pick a (gbs_a, x_a), a rung b's ratio
over every noise scale G ≥ 0 is largest at G → ∞ when gbs_b ≥ gbs_a (the samples/s ratio x_b / x_a) and
at G = 0 when gbs_b < gbs_a (the steps/s ratio). The best of these over the rungs bounds what any chain
of them gains under the surrogate, whatever the GNS turns out to be.
"""

from __future__ import annotations

from dataclasses import dataclass

from cona_cli.planner.calibration import Calibrator
from cona_cli.planner.hardware import HardwareProfile
from cona_cli.planner.search import plan
from cona_cli.planner.space import gbs_ladder
from cona_cli.planner.workload import Workload
from cona_core.config import Config

PAYS = 1.05  # below this the rungs differ by less than one host's step-time noise (±5 %): no chain pays


@dataclass(frozen=True)
class Ceiling:
    ratio: float  # the most progress per second a rung makes relative to the static pick, over every GNS
    rung: int  # the rung that makes it
    static_gbs: int

    @property
    def pays(self) -> bool:
        return self.ratio >= PAYS

    def verdict(self) -> str:
        if not self.pays:
            return (
                f"chaining can gain at most {self.ratio:.3g}× over the offline planner's pick (gbs "
                f"{self.static_gbs}) here, whatever the noise scale: stay static"
            )
        when = "a large" if self.rung > self.static_gbs else "a small"
        return (
            f"chaining can gain up to {self.ratio:.3g}× over the offline planner's pick (gbs {self.static_gbs}) "
            f"here, by gbs {self.rung} at {when} noise scale"
        )


def ceiling(rates: dict[int, float], static_gbs: int) -> Ceiling:
    """From each rung's samples/s (`rates`, the static pick's rung among them)."""
    x_a = rates[static_gbs]

    def gain(g: int) -> float:
        return rates[g] / x_a if g >= static_gbs else (rates[g] / g) / (x_a / static_gbs)

    best = max(rates, key=gain)
    return Ceiling(gain(best), best, static_gbs)


def planned_ceiling(cfg: Config, hw: HardwareProfile) -> Ceiling | None:
    """The ceiling at the planner's predicted step times (None if a rung has no feasible strategy)."""
    static = cfg.search.gbs_static or gbs_ladder(cfg)[0]
    rungs = sorted({*gbs_ladder(cfg), static})
    results = plan(cfg, hw, Calibrator(Workload.from_config(cfg), hw, seed=cfg.search.seed), rungs)
    rates = {r.gbs: r.gbs / r.best.time_s for r in results if r.best is not None}
    return ceiling(rates, static) if static in rates else None
