"""policy: ramp, Megatron's --rampup-batch-size on cona's engine."""

from __future__ import annotations

import pytest

from cona_cli.control.ramp_policy import RampPolicy, ramp_gbs
from cona_core.config import ConfigError, config_from_dict
from cona_core.strategy import Strategy
from tests.support import TINY


def test_ramp_follows_megatrons_increments() -> None:
    # Megatron: (32 - 8) / 8 = 3 increments, one every 3000 / 3 = 1000 samples, then the full batch.
    got = [ramp_gbs(8, 8, 3000, 32, n) for n in (0, 999, 1000, 1999, 2000, 2999, 3000, 10**6)]
    assert got == [8, 8, 16, 16, 24, 24, 32, 32]


def _policy(**train: object) -> RampPolicy:
    doc = {**TINY, "policy": "ramp", "strategy": "dp4-tp1-pp1-mbs8-gbs32"}
    doc["train"] = {**TINY["train"], "rampup_batch_size": [8, 8, 3000], **train}
    cfg = config_from_dict(doc, "test")
    return RampPolicy(cfg, cfg.strategy)


def test_each_rung_keeps_the_layout_at_the_largest_micro_batch_that_divides_it() -> None:
    p = _policy()
    assert p.first().strategy == Strategy(4, 1, 1, 2, 8)
    assert p.at(24) == Strategy(4, 1, 1, 6, 24) and p.at(32) == Strategy(4, 1, 1, 8, 32)
    rows = [{"kind": "step", "step": i, "consumed_samples": n} for i, n in enumerate((800, 1000, 2100, 3000))]
    stages = [p.on_metric(r) for r in rows]
    assert stages[0] is None and stages[1].strategy.gbs == 16 and stages[1].reason == "ramp"
    p.resized(stages[1], 0.1)
    assert p.on_metric(rows[1]) is None and p.on_metric(rows[2]).strategy.gbs == 24
    assert p.expected_next() == Strategy(4, 1, 1, 6, 24)


def test_a_ramp_that_cannot_reach_the_batch_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="rampup_batch_size: the ramp 8 \\+ k·5 must reach"):
        _policy(rampup_batch_size=[8, 5, 3000])
    with pytest.raises(ConfigError, match="policy: ramp needs train.rampup_batch_size"):
        config_from_dict({**TINY, "policy": "ramp"}, "test")
    with pytest.raises(ConfigError, match="must be \\[START, INCREMENT, SAMPLES\\]"):
        config_from_dict({**TINY, "policy": "ramp", "train": {**TINY["train"], "rampup_batch_size": [8, 8]}}, "t")
