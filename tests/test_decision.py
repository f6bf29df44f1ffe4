"""The decision rule: the Φ ratio judged at its kind of move's end of the evidence, paid back within the
time left; the choice among options, and the noise scale's bounds."""

from __future__ import annotations

import math
import random

import pytest

from cona_cli.control.decision import Estimate, Evidence, Move, Option, Running, decide, judge
from cona_core.efficiency import phi, phi_ratio
from cona_core.gns import NoiseInterval, pooled_noise_scale

Z95 = 1.6448536269514715
LADDER = (8, 16, 32, 64)


def exact(g: float) -> NoiseInterval:
    return NoiseInterval(g, g, g)


def at(gbs: int, t: Estimate) -> Running:
    return Running(gbs, t, LADDER)


def option(gbs: int, t: Estimate, cost: float = 0.0, untried: bool = False) -> Option:
    return Option(f"gbs{gbs}-{t.value}", gbs, t, cost, untried)


def test_exact_measurements_switch_exactly_when_the_ratio_pays_back() -> None:
    t, t2 = Estimate(0.1), Estimate(0.15)
    ratio = phi(16, t2.value, 40.0) / phi(8, t.value, 40.0)
    assert 1.0 < ratio < 1.2 and phi_ratio(8, 0.1, 16, 0.15, 40.0) == pytest.approx(ratio)
    left = 100.0
    pays = left * (1 - 1 / ratio)  # the switch cost that the gain pays back exactly
    assert judge(at(8, t), option(16, t2, 0.99 * pays), Evidence(exact(40.0), left, Z95)).switch
    stay = judge(at(8, t), option(16, t2, 1.01 * pays), Evidence(exact(40.0), left, Z95))
    assert not stay.switch and stay.ratio == pytest.approx(ratio) and stay.judged == pytest.approx(ratio)
    assert not judge(at(8, t), option(16, t2), Evidence(exact(40.0), 0.0, Z95)).switch  # no time left


def test_each_kind_of_move_is_judged_at_its_end_of_the_evidence() -> None:
    """Up: the point estimates; a jump: G's lower bound and the step times less their error; a layout at the
    same batch: the step times' bound (G cancels); down: samples per second alone, less their error."""
    t, t2, gns = Estimate(0.1, 0.02), Estimate(0.15, 0.03), NoiseInterval(40.0, 20.0, 90.0)
    evidence = Evidence(gns, 100.0, Z95)
    time_error = math.exp(-Z95 * math.hypot(0.02, 0.03))
    up = judge(at(8, t), option(16, t2), evidence)
    assert up.move is Move.UP and up.judged == pytest.approx(up.ratio)
    assert up.ratio == pytest.approx(phi_ratio(8, 0.1, 16, 0.15, 40.0))
    jump = judge(at(8, t), option(32, t2), evidence)
    assert jump.move is Move.JUMP and jump.judged == pytest.approx(phi_ratio(8, 0.1, 32, 0.15, 20.0) * time_error)
    layout = judge(at(8, t), option(8, Estimate(0.09, 0.03)), evidence)
    assert layout.move is Move.LAYOUT and layout.judged == pytest.approx(0.1 / 0.09 * time_error)
    down = judge(at(16, t2), option(8, t), evidence)
    assert down.move is Move.DOWN and down.ratio == pytest.approx(phi_ratio(16, 0.15, 8, 0.1, 40.0))
    assert down.judged == pytest.approx((8 / 0.1) / (16 / 0.15) * time_error)  # the throughput ratio
    assert down.judged < phi_ratio(16, 0.15, 8, 0.1, 90.0) * time_error  # below even the GNS's upper bound's


def test_the_choice_is_the_best_score_among_the_options_that_pass() -> None:
    """A relaunch with the larger Φ ratio that cannot pay back its cost does not hide a resize that
    passes; among those that pass, the most progress over the time left wins; none, and the verdict is a
    stay on the best-scoring one."""
    t, evidence = Estimate(0.1), Evidence(exact(200.0), 100.0, Z95)
    relaunch, resize = option(16, Estimate(0.12), cost=90.0), option(16, Estimate(0.15))
    verdict = decide(running=at(8, t), options=[relaunch, resize], evidence=evidence)
    assert verdict is not None and verdict.switch and verdict.option == resize
    assert judge(at(8, t), relaunch, evidence).ratio > verdict.ratio
    slow = option(16, Estimate(0.3))
    stay = decide(running=at(8, t), options=[slow], evidence=evidence)
    assert stay is not None and not stay.switch and stay.option == slow
    assert decide(running=at(8, t), options=[], evidence=evidence) is None


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


def test_an_untried_next_rung_is_judged_at_its_hopeful_end_so_a_wrong_model_cannot_hold_a_climb_back() -> None:
    gns, t8 = NoiseInterval(20.0, 15.0, 30.0), Estimate(0.13, 0.01)
    evidence = Evidence(gns, 100.0, 1.645)
    # gbs 16 predicted at 0.217 s: Φ ratio (16/0.217)/(8/0.13) * 28/36 = 0.93, short of paying
    stay = judge(at(8, t8), option(16, Estimate(0.217), untried=True), evidence)
    assert not stay.switch
    hopeful = judge(at(8, t8), option(16, Estimate(0.217, 0.3), untried=True), evidence)  # the model ±30 %
    assert hopeful.switch and hopeful.ratio == pytest.approx(stay.ratio) == pytest.approx(0.932, abs=1e-3)
    tried = judge(at(8, t8), option(16, Estimate(0.217, 0.3)), evidence)
    assert not tried.switch  # its rung has run (the model is calibrated there): no hope beyond the point
    assert not judge(at(8, t8), option(16, Estimate(0.5, 0.3), untried=True), evidence).switch  # hopeless
    jump = judge(at(8, t8), option(32, Estimate(0.3, 0.3), untried=True), evidence)
    assert not jump.switch  # a jump is judged at its bound, however wrong the model may be
    late = judge(at(8, t8), option(16, Estimate(0.217, 0.3), 50.0, untried=True), Evidence(gns, 60.0, 1.645))
    assert not late.switch  # too little time left to pay back even the hopeful case


def test_without_a_noise_scale_reading_only_the_moves_that_read_none_are_judged() -> None:
    """After a change of batch the estimator is held: a retreat to a rung with more samples per second and
    a faster layout are judged meanwhile, a climb is not."""
    t64, t32 = Estimate(0.5, 0.01), Estimate(0.15, 0.01)  # 128 samples/s at 64 against 213 at 32
    evidence = Evidence(None, 100.0, Z95)
    back = decide(running=at(64, t64), options=[option(32, t32)], evidence=evidence)
    assert back is not None and back.switch and back.move is Move.DOWN
    assert back.judged == pytest.approx((32 / 0.15) / (64 / 0.5) * math.exp(-Z95 * math.hypot(0.01, 0.01)))
    layout = decide(running=at(32, t32), options=[option(32, Estimate(0.1, 0.01))], evidence=evidence)
    assert layout is not None and layout.switch and layout.move is Move.LAYOUT
    assert decide(running=at(8, t32), options=[option(16, Estimate(0.01))], evidence=evidence) is None
    with pytest.raises(ValueError, match="reads the noise scale"):
        judge(at(8, t32), option(16, Estimate(0.01)), evidence)
