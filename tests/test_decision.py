"""The switch rule on scripted GNS / iteration times."""

from __future__ import annotations

import math

import pytest

from cona_cli.control.switch_rule import decide, needed_ratio
from cona_cli.planner.surrogate import phi


def test_switches_exactly_when_the_ratio_passes_the_threshold() -> None:
    # Current: gbs 8 at 0.1 s; candidate: gbs 16 at 0.15 s. Φ'/Φ = (16/0.15)/(16+G) / ((8/0.1)/(8+G)).
    gbs, t, gbs2, t2 = 8, 0.1, 16, 0.15
    needed = needed_ratio(switch_cost_s=10, horizon_s=100, margin=0.05)
    assert needed == pytest.approx(100 / 90)
    # Solve for the GNS at which the ratio equals `needed`; just below: stay, just above: switch.
    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        ratio = phi(gbs2, t2, mid) / phi(gbs, t, mid)
        lo, hi = (mid, hi) if ratio < needed else (lo, mid)
    g_star = (lo + hi) / 2
    below = decide(gbs, t, gbs2, t2, g_star * 0.99, 10, 100, 0.05)
    above = decide(gbs, t, gbs2, t2, g_star * 1.01, 10, 100, 0.05)
    assert not below.switch and above.switch
    assert below.ratio < needed < above.ratio
    assert above.phi_current == pytest.approx(phi(gbs, t, g_star * 1.01))


def test_switch_cost_must_be_paid_back() -> None:
    gbs, t, gbs2, t2, gns = 8, 0.1, 16, 0.12, 40.0
    cheap = decide(gbs, t, gbs2, t2, gns, switch_cost_s=1, horizon_s=120, margin=0.05)
    dear = decide(gbs, t, gbs2, t2, gns, switch_cost_s=60, horizon_s=120, margin=0.05)
    assert cheap.ratio == dear.ratio and 1.05 < cheap.ratio < 2.0
    assert cheap.switch and not dear.switch
    assert "pay back" in dear.why
    never = decide(gbs, t, gbs2, t2 / 100, gns, switch_cost_s=200, horizon_s=120, margin=0.05)
    assert not never.switch and math.isinf(never.needed)


def test_margin_blocks_small_gains() -> None:
    d = decide(8, 0.1, 8, 0.098, 10.0, switch_cost_s=0, horizon_s=120, margin=0.05)
    assert d.ratio == pytest.approx(0.1 / 0.098) and not d.switch
