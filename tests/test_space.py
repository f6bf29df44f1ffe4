"""Strategy space: gbs ladder, feasibility rules with reasons, memory estimate."""

import dataclasses

import numpy as np
import pytest

from cona_cli.planner.costmodel import as_array
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.memory import memory_bytes, startup_bytes
from cona_cli.planner.space import enumerate_space, gbs_ladder
from cona_cli.planner.workload import Workload
from cona_cli.run_config import load_config
from cona_core.config import config_from_dict
from cona_core.strategy import Strategy

GPT3 = "configs/gpt3-1.3b-a6000.yaml"


def _tiny(n_layers=3, **search):
    return config_from_dict(
        {
            "model": {"n_layers": n_layers, "d_model": 64, "n_heads": 4, "ffn": 256, "seq_len": 64},
            "cluster": {"nodes": 1, "procs_per_node": 4},
            "search": {"gbs_min": 8, "gbs_max": 32, "mbs": [1, 2], **search},
        }
    )


def test_ladder_defaults_to_powers_of_two_and_accepts_an_explicit_list():
    assert gbs_ladder(_tiny()) == [8, 16, 32]
    assert gbs_ladder(_tiny(gbs_ladder=[48, 12, 24])) == [12, 24, 48]


def test_divisibility_rejections_keep_their_reason():
    space = enumerate_space(_tiny(), load_hardware("cpu-local"))
    reasons = dict(space.rejected)
    assert "n_layers 3 not divisible by pp 2" in reasons[Strategy(2, 1, 2, 1, 8)]
    assert {s.pp for s in space.feasible} == {1} and {s.world for s in space.feasible} == {4}
    reasons = dict(enumerate_space(_tiny(n_layers=4, mbs=[4]), load_hardware("cpu-local")).rejected)
    assert "2 micro-batches < pp 4" in reasons[Strategy(1, 1, 4, 4, 8)]
    assert "gbs 8 not divisible by dp*mbs = 16" in reasons[Strategy(4, 1, 1, 4, 8)]


def test_tp_limits_are_enforced():
    reasons = dict(enumerate_space(_tiny(max_tp=2), load_hardware("cpu-local")).rejected)
    assert "tp > search.max_tp 2" in reasons[Strategy(1, 4, 1, 1, 8)]
    cfg = config_from_dict(
        {
            "model": {"n_layers": 4, "d_model": 64, "n_heads": 4, "ffn": 256, "seq_len": 64},
            "cluster": {"nodes": 2, "procs_per_node": 2},
            "search": {"gbs_ladder": [8], "mbs": [1]},
        }
    )
    assert "tp spans nodes" in dict(enumerate_space(cfg, load_hardware("cpu-local")).rejected)[Strategy(1, 4, 1, 1, 8)]


def test_memory_rejection_for_a_large_micro_batch():
    cfg = load_config(GPT3)
    space = enumerate_space(cfg, load_hardware("a6000-2x8"), [128])
    reason = dict(space.rejected)[Strategy(16, 1, 1, 8, 128)]
    assert reason.startswith("memory ") and "GiB available" in reason
    assert Strategy(16, 1, 1, 1, 128) in space.feasible
    assert (space.memory_gib <= 48 * 0.9).all()


def test_memory_estimate_scales_as_expected():
    w = Workload.from_config(load_config(GPT3))
    x = as_array([Strategy(4, 1, 4, 1, 64), Strategy(4, 2, 4, 1, 64), Strategy(4, 1, 4, 2, 64)])
    base, tp2, mbs2 = memory_bytes(x, w)
    assert tp2 < base < mbs2
    assert memory_bytes(x, dataclasses.replace(w, recompute=True))[0] < base
    assert memory_bytes(x, dataclasses.replace(w, pp_schedule="gpipe"))[0] > base  # 16 vs 4 in flight
    assert memory_bytes(x, dataclasses.replace(w, dp_impl="fsdp"))[0] < base
    states = w.shape.total_params * 16
    single = memory_bytes(as_array([Strategy(1, 1, 1, 1, 1)]), w)[0]
    assert states < single < states * 2
    assert np.isfinite(memory_bytes(x, w)).all()


def test_a_strategy_that_fits_only_sharded_starts_with_its_pieces_and_one_whole_parameter():
    """`launch.materialise` allocates a rank's pieces sharded and draws one whole parameter at a time: a
    1.3B model under FSDP over 16 ranks starts within its steady state, though whole it would not fit."""
    cfg = load_config(GPT3)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, dp_impl="fsdp"),
        search=dataclasses.replace(cfg.search, recompute=True),
    )
    w = Workload.from_config(cfg)
    s = Strategy(16, 1, 1, 1, 32)  # two micro-batches: FSDP reduce-scatters both
    x = as_array([s])
    hw = load_hardware("a6000-2x8")
    start, steady = startup_bytes(x, w)[0], memory_bytes(x, w, hw)[0]
    assert start == pytest.approx(w.shape.total_params * 4 / 16 + w.shape.vocab * w.shape.d_model * 4)
    assert start < steady < w.shape.total_params * 4  # the whole model in fp32 would not fit this budget
    fits = dataclasses.replace(
        hw, memory_gib=(steady / 2**30 + hw.reserved_gib) / (1 - cfg.search.memory_margin) + 0.01
    )
    assert s in enumerate_space(cfg, fits, [32]).feasible
    ddp = dataclasses.replace(w, dp_impl="ddp")  # unsharded pieces: the whole stage
    assert startup_bytes(x, ddp)[0] == pytest.approx((w.shape.total_params + w.shape.vocab * w.shape.d_model) * 4)
    tight = dataclasses.replace(
        hw, memory_gib=(start / 2**30 + hw.reserved_gib) / (1 - cfg.search.memory_margin) - 0.01
    )
    reasons = dict(enumerate_space(cfg, tight, [32]).rejected)
    assert reasons[s].startswith("memory ")
