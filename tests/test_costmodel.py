"""Hardware profiles and the analytic iteration-time model."""

import dataclasses

import numpy as np
import pytest

from cona_cli.planner.costmodel import as_array, iteration_time
from cona_cli.planner.hardware import HARDWARE_DIR, hardware_from_dict, load_hardware
from cona_cli.planner.workload import Workload
from cona_cli.run_config import load_config
from cona_core.config import ConfigError
from cona_core.shape import ModelShape
from cona_core.strategy import Strategy

W = Workload(
    ModelShape(n_layers=24, d_model=2048, n_heads=16, kv_heads=16, ffn=8192, seq_len=2048, vocab=50257),
    precision="bf16",
    nodes=2,
    procs_per_node=8,
)


def _t(hw, w, *strategies):
    return iteration_time(as_array([Strategy.parse(s) for s in strategies]), w, hw)


def test_shipped_profiles_load_and_bad_ones_are_refused(tmp_path):
    names = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
    assert {"cpu-local", "a6000-2x8", "a100-80gb-8", "h100-80gb-8"} <= set(names)
    for name in names:
        assert load_hardware(name).peak_tflops["fp32"] > 0
    with pytest.raises(ConfigError, match="unknown profile"):
        load_hardware("tpu-v9")
    raw = load_hardware("a6000-2x8").to_dict()
    with pytest.raises(ConfigError, match="warp_speed: unknown key"):
        hardware_from_dict({**raw, "warp_speed": 9})
    with pytest.raises(ConfigError, match="overlap"):
        hardware_from_dict({**raw, "overlap": 2})
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    with pytest.raises(ConfigError, match="bad.yaml: .*required"):
        load_hardware(str(bad))


def test_more_data_parallel_shards_means_less_time_per_step():
    hw = load_hardware("a6000-2x8")
    t = _t(
        hw, W, "dp1-tp1-pp1-mbs1-gbs64", "dp2-tp1-pp1-mbs1-gbs64", "dp4-tp1-pp1-mbs1-gbs64", "dp8-tp1-pp1-mbs1-gbs64"
    )
    assert (np.diff(t) < 0).all()


def test_larger_pipeline_at_fixed_microbatches_has_a_larger_bubble():
    hw = dataclasses.replace(
        load_hardware("a6000-2x8"),
        intra_latency_us=0,
        inter_latency_us=0,
        intra_bw_gbs=1e9,
        inter_bw_gbs=1e9,
        step_overhead_ms=0,
        layer_overhead_us=0,
    )
    w = dataclasses.replace(W, nodes=1)
    m = 8
    t = _t(hw, w, *(f"dp1-tp1-pp{pp}-mbs1-gbs{m}" for pp in (1, 2, 4, 8)))
    efficiency = t[0] / (t * np.array([1, 2, 4, 8]))  # ideal pipeline: T(1) / pp
    assert (np.diff(efficiency) < 0).all()
    assert efficiency[-1] < m / (m + 8 - 1) + 0.05


def test_placement_and_precision_matter():
    hw = load_hardware("a6000-2x8")
    slow_net = dataclasses.replace(hw, inter_bw_gbs=hw.inter_bw_gbs / 4)
    one_node = dataclasses.replace(W, nodes=1, procs_per_node=16)
    s = "dp8-tp2-pp1-mbs1-gbs64"
    assert _t(slow_net, W, s)[0] > _t(hw, W, s)[0]  # the DP all-reduce crosses the network
    assert _t(slow_net, one_node, s)[0] == _t(hw, one_node, s)[0]  # one node: network unused
    fp32 = _t(hw, dataclasses.replace(W, precision="fp32"), "dp16-tp1-pp1-mbs1-gbs64")
    assert fp32[0] > 2 * _t(hw, W, "dp16-tp1-pp1-mbs1-gbs64")[0]
    recompute = _t(hw, dataclasses.replace(W, recompute=True), "dp16-tp1-pp1-mbs1-gbs64")
    assert recompute[0] > _t(hw, W, "dp16-tp1-pp1-mbs1-gbs64")[0]


def test_gpt3_step_time_is_in_a_plausible_range():
    cfg = load_config("configs/gpt3-1.3b-a6000.yaml")
    t = _t(load_hardware("a6000-2x8"), Workload.from_config(cfg), "dp16-tp1-pp1-mbs4-gbs512")[0]
    ideal = 6 * Workload.from_config(cfg).shape.total_params * 512 * 2048 / (16 * 154.8e12)  # 100% of peak
    assert 1.5 * ideal < t < 4 * ideal
