"""Search: Bayesian optimisation agrees with exhaustive enumeration; surrogate Φ and crossover GNS."""

import dataclasses
import math

import pytest

from cona_cli.planner.calibration import Calibrator
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.search import crossovers, plan
from cona_cli.planner.space import gbs_ladder
from cona_cli.planner.surrogate import crossover_gns
from cona_cli.planner.workload import Workload
from cona_cli.run_config import load_config
from cona_core.efficiency import phi


def _setup(path, **search):
    cfg = load_config(path)
    cfg = dataclasses.replace(cfg, search=dataclasses.replace(cfg.search, **search))
    hw = load_hardware(cfg.search.hardware)
    return cfg, hw, Calibrator(Workload.from_config(cfg), hw)


@pytest.mark.parametrize(
    "path, ladder", [("configs/tiny.yaml", [16, 64]), ("configs/gpt3-1.3b-a6000.yaml", [32, 128, 512])]
)
def test_bayesian_search_finds_the_exhaustive_best(path, ladder):
    cfg, hw, cal = _setup(path, exhaustive_max=10_000)
    exhaustive = plan(cfg, hw, cal, ladder)
    bo_cfg, _, _ = _setup(path, exhaustive_max=0)
    bo = plan(bo_cfg, hw, cal, ladder)
    for e, b in zip(exhaustive, bo):
        assert e.exhaustive and not b.exhaustive
        assert len(e.ranked) == e.n_feasible
        assert b.best.strategy == e.best.strategy
        assert len(b.ranked) <= bo_cfg.search.budget


def test_ranking_and_determinism():
    cfg, hw, cal = _setup("configs/gpt3-1.3b-a6000.yaml", exhaustive_max=0)
    first = plan(cfg, hw, cal, [128], gns=500.0)[0]
    again = plan(cfg, hw, cal, [128], gns=500.0)[0]
    assert [c.strategy for c in first.ranked] == [c.strategy for c in again.ranked]
    times = [c.time_s for c in first.ranked]
    assert times == sorted(times)
    best = first.best
    assert best.phi == pytest.approx(phi(128, best.time_s, 500.0))
    assert best.samples_per_s == pytest.approx(128 / best.time_s)


def test_phi_and_crossover():
    assert phi(64, 2.0, 0.0) == pytest.approx(0.5)
    g = crossover_gns(32, 1.0, 64, 1.5)
    assert phi(32, 1.0, g) == pytest.approx(phi(64, 1.5, g))
    assert phi(64, 1.5, g * 2) > phi(32, 1.0, g * 2)
    assert crossover_gns(32, 1.0, 64, 0.9) == 0.0  # faster and larger: always better
    assert math.isinf(crossover_gns(32, 1.0, 64, 2.5))  # less throughput: never


def test_all_rungs_and_their_crossovers():
    cfg, hw, cal = _setup("configs/gpt3-1.3b-a6000.yaml")
    results = plan(cfg, hw, cal, gbs_ladder(cfg))
    pairs = crossovers(results)
    assert [(a, b) for a, b, _ in pairs] == [(32, 64), (64, 128), (128, 256), (256, 512)]
    assert all(g > 0 for _, _, g in pairs)
