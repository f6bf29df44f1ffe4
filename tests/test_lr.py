"""The LR recipes and the progress clock (launch.lr)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cona_core.config import TrainConfig
from cona_core.efficiency import gain
from launch.lr import learning_rate, progress_tokens, schedule_factor


def test_the_gain_is_adascales_and_one_without_a_noise_scale() -> None:
    assert gain(32, 8, None) == 1.0 and gain(8, 8, 50.0) == pytest.approx(1.0)
    assert gain(32, 8, 40.0) == pytest.approx(4 * 48 / 72)  # (b/b0)(b0 + G)/(b + G)
    assert gain(32, 8, 1e9) == pytest.approx(4.0, rel=1e-6) and gain(32, 8, 1e-9) == pytest.approx(1.0)


def test_adascale_scales_the_lr_by_the_square_root_of_the_gain() -> None:
    t = TrainConfig(lr=1e-3, schedule="constant", lr_scaling="adascale", lr_base_gbs=8)
    assert learning_rate(t, 0.0, 0.0, 32, 40.0) == pytest.approx(1e-3 * math.sqrt(gain(32, 8, 40.0)))
    sqrt = dataclasses.replace(t, lr_scaling="sqrt")
    assert learning_rate(sqrt, 0.0, 0.0, 32, 40.0) == pytest.approx(2e-3)  # the old recipe: sqrt(32/8)


def test_a_resize_keeps_the_schedules_position_in_progress_units() -> None:
    """Steps at gbs 8 then at gbs 32 (an in-place resize): the clock advances by r·b0 sequences a step, so
    the schedule continues where it was and then runs r times faster per step, not 4x."""
    t = TrainConfig(
        lr=1e-3, warmup_tokens=0, schedule="cosine", decay_tokens=10_000, lr_scaling="adascale", lr_base_gbs=8
    )
    seq, gns, clock = 10, 40.0, 0.0
    for _ in range(50):
        clock += progress_tokens("adascale", 8, 8, gns, seq)
    assert clock == pytest.approx(50 * 8 * seq)  # at the base batch the clock is the token count
    tokens = clock
    before = schedule_factor(t, clock, tokens)
    step = progress_tokens("adascale", 32, 8, gns, seq)
    assert step == pytest.approx(gain(32, 8, gns) * 8 * seq) and step < 32 * seq
    after = schedule_factor(t, clock + step, tokens + 32 * seq)
    assert after < before  # continues from the same position
    assert after > schedule_factor(t, clock + 32 * seq, tokens + 32 * seq)  # slower than raw tokens
    assert progress_tokens("sqrt", 32, 8, gns, seq) == 32 * seq  # the old recipe: raw tokens


def test_warmup_counts_raw_tokens_and_the_decay_starts_where_progress_passes_it() -> None:
    """At gbs 32 under adascale (r < 4) warmup ends after warmup_tokens raw tokens, in a quarter of gbs 8's
    steps; the peak then holds until the progress clock reaches warmup_tokens and the decay begins."""
    t = TrainConfig(
        lr=1e-3, warmup_tokens=3_200, schedule="linear", decay_tokens=10_000, lr_scaling="adascale", lr_base_gbs=8
    )
    seq, gns, progress, tokens, steps = 10, 40.0, 0.0, 0.0, 0
    while schedule_factor(t, progress, tokens) < 1.0:
        progress += progress_tokens("adascale", 32, 8, gns, seq)
        tokens += 32 * seq
        steps += 1
    assert steps == 10 and tokens == 3_200  # 3,200 tokens / (32 × 10) a step: gbs 8 would take 40 steps
    assert progress == pytest.approx(10 * gain(32, 8, gns) * 8 * seq) and progress < t.warmup_tokens
    assert schedule_factor(t, t.warmup_tokens / 2, 10 * tokens) == 1.0  # the peak holds (not 0.5: warmup is over)
    assert schedule_factor(t, t.warmup_tokens + 1_000, 10 * tokens) == pytest.approx(1 - 0.9 * 0.1)
    assert schedule_factor(t, 1_600, 1_600) == pytest.approx(1_601 / 3_200)  # halfway through warmup
