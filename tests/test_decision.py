"""The switch rule: a confident lower bound of the Φ ratio, paid back within the time left."""

from __future__ import annotations

import math
import random

import pytest

from cona_cli.control.switch_rule import Estimate, decide
from cona_core.efficiency import phi, phi_ratio
from cona_core.gns import NoiseInterval, pooled_noise_scale

Z95 = 1.6448536269514715


def exact(g: float) -> NoiseInterval:
    return NoiseInterval(g, g, g)


def test_exact_measurements_switch_exactly_when_the_ratio_pays_back() -> None:
    gbs, t, gbs2, t2 = 8, Estimate(0.1), 16, Estimate(0.15)
    ratio = phi(gbs2, t2.value, 40.0) / phi(gbs, t.value, 40.0)
    assert 1.0 < ratio < 1.2 and phi_ratio(gbs, 0.1, gbs2, 0.15, 40.0) == pytest.approx(ratio)
    left = 100.0
    pays = left * (1 - 1 / ratio)  # the switch cost that the gain pays back exactly
    assert decide(gbs, t, gbs2, t2, exact(40.0), 0.99 * pays, left, Z95).switch
    stay = decide(gbs, t, gbs2, t2, exact(40.0), 1.01 * pays, left, Z95)
    assert not stay.switch and stay.ratio == pytest.approx(ratio) and stay.ratio_low == pytest.approx(ratio)
    assert not decide(gbs, t, gbs2, t2, exact(40.0), 0.0, 0.0, Z95).switch  # no time left


def test_the_bound_takes_the_gns_least_favourable_to_the_candidate() -> None:
    t, t2, gns = Estimate(0.1, 0.02), Estimate(0.15, 0.03), NoiseInterval(40.0, 20.0, 90.0)
    up = decide(8, t, 16, t2, gns, 0.0, 100.0, Z95)  # a larger batch: at the GNS's lower bound
    time_error = math.exp(-Z95 * math.hypot(0.02, 0.03))
    assert up.ratio == pytest.approx(phi_ratio(8, 0.1, 16, 0.15, 40.0))
    assert up.ratio_low == pytest.approx(phi_ratio(8, 0.1, 16, 0.15, 20.0) * time_error)
    down = decide(16, t2, 8, t, gns, 0.0, 100.0, Z95)  # a smaller batch: at any GNS, its samples per second
    assert down.ratio == pytest.approx(phi_ratio(16, 0.15, 8, 0.1, 40.0))
    assert down.ratio_low == pytest.approx((8 / 0.1) / (16 / 0.15) * time_error)  # the throughput ratio
    assert down.ratio_low < phi_ratio(16, 0.15, 8, 0.1, 90.0) * time_error  # below even the GNS's upper bound's


def test_kappa_scales_the_gns() -> None:
    a = decide(8, Estimate(0.1), 16, Estimate(0.15), exact(10.0), 0.0, 100.0, Z95, kappa=4.0)
    b = decide(8, Estimate(0.1), 16, Estimate(0.15), exact(40.0), 0.0, 100.0, Z95)
    assert a.ratio == pytest.approx(b.ratio) and a.ratio_low == pytest.approx(b.ratio_low)


def test_fieller_bounds_cover_the_true_noise_scale_and_open_up_when_the_signal_is_weak() -> None:
    rng = random.Random(0)
    true_g, covered, trials = 50.0, 0, 400
    for _ in range(trials):
        grad = [1.0 + 0.5 * rng.gauss(0, 1) for _ in range(30)]
        trace = [true_g * (1.0 + 0.5 * rng.gauss(0, 1)) for _ in range(30)]
        est = pooled_noise_scale(grad, trace, 0.95)
        assert est is not None and est.low <= est.value <= est.high
        covered += est.low <= true_g
    assert 0.92 <= covered / trials <= 0.98  # a one-sided 95 % lower bound
    weak = pooled_noise_scale([0.05, -0.2, 0.3, 0.1], [5.0, 6.0, 4.0, 5.0], 0.95)
    assert weak is not None and weak.high == math.inf  # mean |G|² barely above 0: no upper bound
    assert pooled_noise_scale([1.0, -2.0, 0.5], [5.0, 5.0, 5.0], 0.95) is None  # |G|² not positive yet
    assert pooled_noise_scale([1.0, 1.0], [5.0, 5.0], 0.95) is None


def test_a_cheap_move_is_probed_when_the_model_may_be_wrong_and_a_confident_one_is_not_a_probe() -> None:
    gns = NoiseInterval(20.0, 15.0, 30.0)
    t8 = Estimate(0.13, 0.01)
    # gbs 16 predicted at 0.217 s: Φ ratio (16/0.217)/(8/0.13) * 28/36 = 0.93, short of paying
    stay = decide(8, t8, 16, Estimate(0.217), gns, 0.0, 100.0, z=1.645)
    assert not stay.switch and not stay.probe
    probe = decide(8, t8, 16, Estimate(0.217, 0.3), gns, 0.0, 100.0, z=1.645, probe=True)  # the model ±30 %
    assert probe.switch and probe.probe and probe.ratio == pytest.approx(stay.ratio)
    assert probe.why.startswith("probe: Φ ratio 0.932")
    hopeless = decide(8, t8, 16, Estimate(0.5, 0.3), gns, 0.0, 100.0, z=1.645, probe=True)
    assert not hopeless.switch  # not even a 1.64x faster step would pay
    confident = decide(8, t8, 16, Estimate(0.15, 0.01), gns, 0.0, 100.0, z=1.645, probe=True)  # a sure model
    assert confident.switch and not confident.probe
    late = decide(8, t8, 16, Estimate(0.217, 0.3), gns, 50.0, 60.0, z=1.645, probe=True)
    assert not late.switch  # too little time left to pay back even the optimistic case
