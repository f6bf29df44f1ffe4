"""The virtual clock: its charges, its seeded noise, the tables the controller resolves, and bad input."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cona_cli.control.clock_table import clock_spec, describe
from cona_cli.planner.costmodel import as_array, iteration_time
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.workload import Workload
from cona_core.clock import (
    BUSY_LOAD,
    CHECKPOINT_BYTES_PER_PARAM,
    FORWARD_SHARE,
    STORAGE_GBS,
    ClockSpec,
    VirtualClock,
    busy_warning,
    others_load,
    step_factor,
    step_seconds,
)
from cona_core.config import ConfigError, config_from_dict
from cona_core.rundir import RunDir
from cona_core.strategy import Strategy
from tests.support import REPO, TINY, write_config

S8 = Strategy.parse("dp4-tp1-pp1-mbs2-gbs8")
S16 = Strategy.parse("dp4-tp1-pp1-mbs4-gbs16")


def _cfg(**train: object) -> object:
    return config_from_dict({**TINY, "train": {**TINY["train"], "clock": "virtual", **train}})


def _spec(**kw: object) -> ClockSpec:
    base = {"source": "mapping", "seed": 3, "noise": 0.0, "relaunch_s": 5.0, "checkpoint_s": 0.5}
    return ClockSpec(**{**base, **kw})


def test_each_charge_is_the_tables() -> None:
    clock = VirtualClock(_spec(table={str(S8): 0.2}, by_gbs={16: 0.3}), start=0.0)
    clock.started(S8)  # a table that does not measure starts: relaunch_s
    assert clock.now() == 5.0
    assert clock.step(S8, 1, measured_s=9.9) == pytest.approx(0.2)  # the host's time is not used
    clock.evaluated(S8, tokens=4096, seq_len=64)  # 4096 tokens = 8 steps' worth at gbs 8, forward only
    assert clock.now() == pytest.approx(5.2 + FORWARD_SHARE * 0.2 * 8)
    before = clock.now()
    assert clock.saved(measured_s=7.0) == 0.5 and clock.now() == pytest.approx(before + 0.5)
    clock.resized(S16)  # one step of the new batch
    assert clock.now() == pytest.approx(before + 0.5 + 0.3)
    assert clock.step(S16, 2, measured_s=0.0) == pytest.approx(0.3)
    assert clock.now() == pytest.approx(before + 0.5 + 0.3 + 0.3)
    with pytest.raises(KeyError, match="no step time"):
        clock.step(Strategy.parse("dp2-tp2-pp1-mbs4-gbs32"), 3, 0.0)


def test_the_noise_is_the_seeds_and_has_the_asked_spread() -> None:
    logs = [math.log(step_factor(11, k, 0.1)) for k in range(1, 4001)]
    assert logs == [math.log(step_factor(11, k, 0.1)) for k in range(1, 4001)]  # replayable
    assert logs != [math.log(step_factor(12, k, 0.1)) for k in range(1, 4001)]
    assert statistics.stdev(logs) == pytest.approx(0.1, rel=0.1)
    neighbours = np.corrcoef(logs[:-1], logs[1:])[0, 1]  # the drift: neighbouring steps alike
    assert 0.2 < neighbours < 0.5
    assert step_factor(11, 5, 0.0) == 1.0


def test_a_calibration_reads_the_typical_step_and_a_slow_spell_moves_neither_its_time_nor_its_spread() -> None:
    steady = [math.log(0.45) + 0.03 * z for z in (-1.5, -1, -0.5, -0.3, -0.1, 0, 0.1, 0.3, 0.5, 1, 1.5, 0.2)]
    seconds, spread = step_seconds(steady)
    assert seconds == pytest.approx(0.45 * math.exp(0.03 * 0.05))  # the median of the logs: between 0 and 0.1
    assert spread == pytest.approx(1.4826 * 0.03 * 0.4)  # the z's deviations from 0.05 have the median 0.4
    spell = [*steady[:10], math.log(0.9), math.log(1.0)]  # two steps of twelve at twice the time
    seconds_in_spell, spread_in_spell = step_seconds(spell)
    assert seconds_in_spell == pytest.approx(seconds, rel=0.03) and spread_in_spell < 2 * spread


def test_the_spec_round_trips_through_the_run_folder() -> None:
    spec = _spec(table={str(S8): 0.2}, by_gbs={16: 0.3}, spreads={str(S8): 0.05}, noise=None)
    back = ClockSpec.from_json(spec.to_json())
    assert back == spec and back.seconds(S16) == 0.3 and back.sigma(S8) == 0.05 and back.sigma(S16) == 0.0


def test_a_profile_table_is_the_planners_step_times_on_that_cluster(tmp_path: Path) -> None:
    cfg = _cfg(clock_table="a6000-2x8")
    spec = clock_spec(cfg, RunDir(tmp_path), [S8, S16])
    expected = iteration_time(as_array([S8, S16]), Workload.from_config(cfg), load_hardware("a6000-2x8"))
    assert [spec.table[str(s)] for s in (S8, S16)] == pytest.approx(list(expected))
    assert spec.noise is None and spec.sigma(S8) == 0.0  # a model has no host noise unless asked
    params = Workload.from_config(cfg).shape.total_params
    assert spec.checkpoint_s == pytest.approx(CHECKPOINT_BYTES_PER_PARAM * params / (STORAGE_GBS * 1e9))
    assert describe(spec) == [f"{s}: {t:.4f} s/step, {s.gbs / t:.1f} samples/s" for s, t in zip((S8, S16), expected)]


def test_a_mapping_by_strategy_or_batch(tmp_path: Path) -> None:
    spec = clock_spec(_cfg(clock_table={str(S8): 0.2, 16: 0.3}), RunDir(tmp_path), [S8, S16])
    assert spec.seconds(S8) == 0.2 and spec.seconds(S16) == 0.3


def test_a_measured_table_reads_the_hosts_cache(tmp_path: Path) -> None:
    spec = clock_spec(_cfg(), RunDir(tmp_path), [S8])
    assert spec.source == "measured" and spec.table == {}
    spec.record(S8, {"seconds": 0.25, "spread": 0.04, "start_s": 9.0, "eval_s": 1.5})
    again = clock_spec(_cfg(), RunDir(tmp_path), [S8])
    assert again.cache == spec.cache and again.seconds(S8) == 0.25 and again.sigma(S8) == 0.04
    clock = VirtualClock(again, start=0.0)
    clock.started(S8)
    clock.evaluated(S8, tokens=4096, seq_len=64)  # as measured, not modelled
    assert clock.now() == pytest.approx(9.0 + 1.5)
    other = clock_spec(
        config_from_dict({**TINY, "train": {**TINY["train"], "clock": "virtual", "seed": 8}}), RunDir(tmp_path), [S8]
    )
    assert other.cache == spec.cache  # the seed does not change a step's time
    wider = {**TINY, "model": {**TINY["model"], "d_model": 64}, "train": {**TINY["train"], "clock": "virtual"}}
    assert clock_spec(config_from_dict(wider), RunDir(tmp_path), [S8]).cache != spec.cache


def test_an_entry_calibrated_on_a_busy_host_is_flagged_until_recalibrated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (9.0, 0.0, 0.0))
    assert others_load(4) == pytest.approx(2.5)  # 9 runnable, 4 of them the job's own ranks, on 2 CPUs
    monkeypatch.setattr("os.getloadavg", lambda: (3.0, 0.0, 0.0))
    assert others_load(4) == 0.0
    timing = {"seconds": 0.25, "spread": 0.04, "start_s": 9.0, "eval_s": 1.5}
    spec = clock_spec(_cfg(), RunDir(tmp_path), [S8])
    spec.record(S8, timing | {"load": BUSY_LOAD + 2})
    spec.take(S8, timing)  # the ranks' shared copy, without a load: still flagged
    assert spec.busy == {str(S8): BUSY_LOAD + 2}
    assert ClockSpec.from_json(spec.to_json()).busy == spec.busy
    again = clock_spec(_cfg(), RunDir(tmp_path), [S8])  # a later run reads the flag from the cache
    assert again.busy == spec.busy
    warning = busy_warning(again.busy, again.cache)
    assert warning is not None and str(S8) in warning and f"delete them from {again.cache}" in warning
    again.record(S8, timing | {"load": 0.1})  # recalibrated on an idle host
    assert clock_spec(_cfg(), RunDir(tmp_path), [S8]).busy == {} and busy_warning({}, None) is None


@pytest.mark.parametrize(
    ("train", "error"),
    [
        ({"clock_table": "h100-does-not-exist"}, "train.clock_table: hardware 'h100-does-not-exist': unknown profile"),
        ({"clock_table": {8: 0.1}}, f"train.clock_table: no step time for {S16}"),
        ({"clock_table": {"dp9": 0.1}}, "train.clock_table: 'dp9': not a strategy or a global batch"),
    ],
)
def test_a_table_that_cannot_time_the_run_is_refused(tmp_path: Path, train: dict, error: str) -> None:
    with pytest.raises(ConfigError, match=error.replace("(", r"\(")):
        clock_spec(_cfg(**train), RunDir(tmp_path), [S8, S16])


@pytest.mark.parametrize(
    ("train", "error"),
    [
        ({"clock": "virtual", "clock_noise": -0.1}, "train.clock_noise: must be >= 0"),
        (
            {"clock": "virtual", "clock_table": {8: 0}},
            "train.clock_table: must map strategies or global batches to seconds > 0",
        ),
        ({"clock_table": "a6000-2x8"}, "train.clock_table: only with train.clock: virtual"),
        ({"clock": "sundial"}, "train.clock: must be one of wall, virtual"),
    ],
)
def test_bad_clock_settings_are_refused(train: dict, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        config_from_dict({**TINY, "train": {**TINY["train"], **train}})


@pytest.mark.parametrize(
    ("sets", "error"),
    [
        (["train.clock_table=nope"], "train.clock_table: hardware 'nope': unknown profile"),
        (["train.clock_noise=-1"], "train.clock_noise: must be >= 0"),
        (["train.clock_table={32: 0.1}"], "train.clock_table: no step time for dp4-tp1-pp1-mbs2-gbs16"),
    ],
)
def test_cona_train_refuses_bad_clock_input_in_one_line_with_exit_2(tmp_path: Path, sets: list, error: str) -> None:
    cfg = write_config(tmp_path / "tiny.yaml", TINY)
    args = [a for s in ["train.clock=virtual", *sets] for a in ("--set", s)]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from cona_cli.app import main; main()",
            "train",
            str(cfg),
            "--run-dir",
            str(tmp_path / "run"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
