"""The base LR's online calibration (launch.lr_calibration): the hypergradient's terms against a hand
computation and a real AdamW step, and the raise-or-settle rule, read at each look, on scripted windows."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from cona_core.config import ConfigError, config_from_dict
from launch.lr_calibration import LOOKS, RAISE, WINDOW, LrCalibration, hypergradient_terms, look_z
from tests.test_config import TINY


def _one_adamw_step(weight_decay: float) -> tuple[torch.nn.Parameter, torch.optim.AdamW, torch.Tensor, torch.Tensor]:
    """A parameter after one AdamW step on a known gradient g1: (parameter, optimizer, g1, θ before)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=weight_decay, foreach=True)
    g1 = torch.randn(5, 3)
    before = p.detach().clone()
    p.grad = g1.clone()
    opt.step()
    return p, opt, g1, before


def test_the_terms_are_the_next_gradient_against_the_last_update_direction() -> None:
    """After one step m̂ = g1 and v̂ = g1², so u = g1/(|g1| + ε) + λθ: g2·u and |u|² by hand."""
    p, opt, g1, _ = _one_adamw_step(weight_decay=0.1)
    g2 = torch.randn(5, 3)
    p.grad = g2.clone()
    u = g1.double() / (g1.double().abs() + 1e-8) + 0.1 * p.detach().double()
    gu, uu = hypergradient_terms([(p, p.grad)], opt)
    assert float(gu) == pytest.approx(float((g2.double() * u).sum()), rel=1e-6)  # the moments are float32
    assert float(uu) == pytest.approx(float(u.pow(2).sum()), rel=1e-6)  # the moments are float32


def test_the_direction_is_the_step_adamw_took() -> None:
    """u is parallel to θ_{t−1} − θ_t, the step AdamW took (up to λθ read after the step): cosine ≈ 1."""
    p, opt, _, before = _one_adamw_step(weight_decay=0.1)
    taken = (before - p.detach()).double()
    p.grad = taken.float().clone()  # a "gradient" along the step itself: g·u / (|g| |u|) is the cosine
    gu, uu = hypergradient_terms([(p, p.grad)], opt)
    cosine = float(gu) / math.sqrt(float(taken.pow(2).sum()) * float(uu))
    assert cosine == pytest.approx(1.0, abs=1e-6)


def test_a_parameter_without_optimizer_state_adds_nothing() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(3)
    assert hypergradient_terms([(p, p.grad)], opt) == (0.0, 0.0)


def _window(cal: LrCalibration, cosines: list[float]) -> list[bool]:
    """Feed `cosines` as steps (|g| = |u| = 1, so g·u is the cosine); whether each ended a window."""
    return [cal.add(c, 1.0, 1.0, z=2.33) for c in cosines]


def test_each_look_splits_the_confidence() -> None:
    """Φ(−2.33) = 0.0099 over 5 looks: 0.00198 a look, z 2.88."""
    assert LOOKS == 5 and look_z(2.33) == pytest.approx(2.88, abs=0.005)


def test_a_clear_signal_raises_the_lr_by_root_two_at_the_first_look() -> None:
    cal = LrCalibration()
    cosines = [0.05 + 0.01 * ((-1) ** i) for i in range(WINDOW // LOOKS)]  # t ≈ 15 after 10 steps
    assert _window(cal, cosines) == [False] * (WINDOW // LOOKS - 1) + [True]
    t = statistics.fmean(cosines) / (statistics.stdev(cosines) / math.sqrt(len(cosines)))
    assert cal.reads == [pytest.approx(t)] and t > 10
    assert cal.gain == pytest.approx(RAISE) and not cal.settled and cal.cosines == []


def test_a_weaker_signal_raises_at_the_first_look_that_clears_the_split_confidence() -> None:
    # 0.15, −0.05, ...: mean 0.05, std 0.1·√(n/(n−1)), so t = 0.5·√(n − 1): 1.5, 2.18, 2.69 after 10, 20 and 30
    # steps (below 2.88, though 2.69 is above the single read's 2.33), 3.12 after 40
    cal = LrCalibration()
    ended = _window(cal, [0.05 + 0.1 * ((-1) ** i) for i in range(40)])
    assert ended == [False] * 39 + [True]
    assert cal.reads == [pytest.approx(0.5 * math.sqrt(39))] and cal.gain == pytest.approx(RAISE)


def test_a_window_without_confidence_settles_the_lr_for_good() -> None:
    cal = LrCalibration()
    _window(cal, [0.05 + 0.01 * ((-1) ** i) for i in range(WINDOW // LOOKS)])  # raised once
    ended = _window(cal, [0.01 + 0.1 * ((-1) ** i) for i in range(WINDOW)])  # t = 0.1·√(n − 1) ≤ 0.7
    assert ended == [False] * (WINDOW - 1) + [True]  # read at every look, settled at the window's end
    assert cal.settled and cal.gain == pytest.approx(RAISE) and len(cal.reads) == 2
    assert _window(cal, [0.5] * WINDOW) == [False] * WINDOW  # a settled LR reads nothing more
    assert cal.gain == pytest.approx(RAISE)


def test_a_window_of_negative_cosines_never_lowers_the_lr() -> None:
    cal = LrCalibration()
    _window(cal, [-0.05 + 0.01 * ((-1) ** i) for i in range(WINDOW)])
    assert cal.settled and cal.gain == 1.0


def test_steps_without_a_gradient_or_a_last_update_are_skipped_and_the_state_round_trips() -> None:
    cal = LrCalibration()
    assert not cal.add(0.3, 0.0, 1.0, z=2.33) and not cal.add(0.3, 1.0, 0.0, z=2.33) and cal.cosines == []
    _window(cal, [0.02, 0.04, 0.03])
    again = LrCalibration.from_state(cal.state_dict())
    assert again == cal and again is not cal
    assert LrCalibration.from_state(None) == LrCalibration()


@pytest.mark.parametrize("value", ["auto", True, False])
def test_lr_calibration_takes_auto_true_or_false(value: object) -> None:
    cfg = config_from_dict({"model": TINY["model"], "train": {"lr_calibration": value}})
    assert cfg.train.lr_calibration == value


def test_lr_calibration_refuses_anything_else() -> None:
    with pytest.raises(ConfigError, match="train.lr_calibration: must be auto, true or false"):
        config_from_dict({"model": TINY["model"], "train": {"lr_calibration": "yes"}})
