"""The switch rule: a confident lower bound of the Φ ratio, paid back within the time left."""

from __future__ import annotations

import math

import pytest

from cona_cli.control.switch_rule import Estimate, decide
from cona_cli.gns import pooled_noise_scale
from cona_cli.planner.surrogate import phi

Z95 = 1.6448536269514715


def test_exact_measurements_switch_exactly_when_the_ratio_pays_back() -> None:
    gbs, t, gbs2, t2, gns = 8, Estimate(0.1), 16, Estimate(0.15), Estimate(40.0)
    ratio = phi(gbs2, t2.value, 40.0) / phi(gbs, t.value, 40.0)
    assert 1.0 < ratio < 1.2
    left = 100.0
    pays = left * (1 - 1 / ratio)  # the switch cost that the gain pays back exactly
    assert decide(gbs, t, gbs2, t2, gns, 0.99 * pays, left, Z95).switch
    stay = decide(gbs, t, gbs2, t2, gns, 1.01 * pays, left, Z95)
    assert not stay.switch and stay.ratio == pytest.approx(ratio) and stay.ratio_low == pytest.approx(ratio)
    assert not decide(gbs, t, gbs2, t2, gns, 0.0, 0.0, Z95).switch  # no time left


def test_the_lower_bound_combines_step_time_and_gns_errors_in_log_space() -> None:
    t, t2, gns = Estimate(0.1, 0.02), Estimate(0.15, 0.03), Estimate(40.0, 0.2)
    d = decide(8, t, 16, t2, gns, 0.0, 100.0, Z95)
    d_gns = 40 / 48 - 40 / 56  # ∂ log ratio / ∂ log G
    log_std = math.sqrt(0.02**2 + 0.03**2 + (d_gns * 0.2) ** 2)
    assert d.ratio_low == pytest.approx(d.ratio * math.exp(-Z95 * log_std))
    assert d.switch == (d.ratio_low > 1.0)
    wide = decide(8, Estimate(0.1, 0.2), 16, t2, gns, 0.0, 100.0, Z95)
    assert wide.ratio == pytest.approx(d.ratio) and not wide.switch  # a noisy measurement: no switch


def test_kappa_scales_the_gns() -> None:
    a = decide(8, Estimate(0.1), 16, Estimate(0.15), Estimate(10.0), 0.0, 100.0, Z95, kappa=4.0)
    b = decide(8, Estimate(0.1), 16, Estimate(0.15), Estimate(40.0), 0.0, 100.0, Z95)
    assert a.ratio == pytest.approx(b.ratio)


def test_pooled_noise_scale_and_its_standard_error() -> None:
    grad = [1.0, 1.2, 0.8, 1.1, 0.9]
    trace = [50.0, 70.0, 30.0, 55.0, 45.0]
    g, log_std = pooled_noise_scale(grad, trace)
    assert g == pytest.approx(50.0)
    # Perfectly correlated noise cancels in the ratio; more steps shrink the error as 1/sqrt(n).
    assert pooled_noise_scale([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == pytest.approx((10.0, 0.0))
    _, more = pooled_noise_scale(grad * 4, trace * 4)
    assert more < log_std
    assert pooled_noise_scale([1.0, -2.0, 0.5], [5.0, 5.0, 5.0]) is None  # |G|² not positive yet
    assert pooled_noise_scale([1.0, 1.0], [5.0, 5.0]) is None
