"""The virtual clock's table, resolved by the controller before the first launch (`cona_core.clock`).

`train.clock_table` names where a step's time comes from: `measured` (this host's cache, filled by the
workers' calibration passes as strategies first run, or started from a table saved on another host:
`seed_measured_cache`, `scripts/bench_ttp.py --table-from`), a hardware profile (the planner's cost model,
`planner.costmodel.iteration_time`, on that cluster) or a mapping by strategy or global batch. A profile
or a mapping must time every strategy the policy may run; a missing one is refused before launch.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cona_cli.planner.workload import Workload
from cona_core.clock import TIMING, ClockSpec, checkpoint_seconds, measured_cache, read_cache, write_cache
from cona_core.config import Config, ConfigError
from cona_core.rundir import RunDir, cache_root
from cona_core.strategy import Strategy, StrategyError


def _mapping(raw: dict[Any, float]) -> tuple[dict[str, float], dict[int, float]]:
    """A table given by strategy (`dp2-tp1-pp1-mbs4-gbs16`) or by global batch (`16`)."""
    table: dict[str, float] = {}
    by_gbs: dict[int, float] = {}
    for key, seconds in raw.items():
        text = str(key).strip()
        if text.isdigit():
            by_gbs[int(text)] = float(seconds)
            continue
        try:
            table[str(Strategy.parse(text))] = float(seconds)
        except StrategyError as e:
            raise ConfigError(f"train.clock_table: {key!r}: not a strategy or a global batch ({e})") from None
    return table, by_gbs


def _modelled(profile: str, workload: Workload, strategies: list[Strategy]) -> dict[str, float]:
    """The planner's step times of `strategies` on the cluster of hardware profile `profile`."""
    from cona_cli.planner.costmodel import as_array, iteration_time
    from cona_cli.planner.hardware import load_hardware

    try:
        hw = load_hardware(profile)
    except ConfigError as e:
        raise ConfigError(f"train.clock_table: {e}") from None
    times = iteration_time(as_array(strategies), workload, hw) if strategies else []
    return {str(s): float(t) for s, t in zip(strategies, times)}


def measured_cache_path(cfg: Config) -> Path:
    """Where this host keeps the measured table of `cfg`'s runs: one file per what decides a step's time."""
    t = cfg.train
    key = {name: asdict(getattr(cfg, name)) for name in ("model", "data")}
    key["cluster"] = cfg.cluster.to_raw()
    key["engine"] = {k: getattr(t, k) for k in ("dp_impl", "pp_schedule", "grad_clip", "gns")}
    key["search"] = {"precision": cfg.search.precision, "recompute": cfg.search.recompute}
    return measured_cache(key, cache_root())


def seed_measured_cache(cfg: Config, saved: Path) -> tuple[Path, int]:
    """Start this host's measured table of `cfg` from `saved`, a measured table written on any host (a cache
    file: {strategy: {seconds, spread, start_s, eval_s, load}}): runs are then charged its times, and only
    the strategies it lacks are calibrated here. Returns the cache file and how many entries it took; an
    entry this host already times otherwise is refused, so that no table mixes two hosts' times unnoticed."""
    entries = read_cache(saved)
    if not entries or not all(isinstance(v, dict) and set(TIMING) <= set(v) for v in entries.values()):
        raise ConfigError(f"{saved}: not a measured table (each strategy's {', '.join(TIMING)})")
    for name in entries:
        try:
            Strategy.parse(name)
        except StrategyError as e:
            raise ConfigError(f"{saved}: {name!r}: not a strategy ({e})") from None
    path = measured_cache_path(cfg)
    cached = read_cache(path)
    clash = next((name for name, v in entries.items() if name in cached and cached[name] != v), None)
    if clash is not None:
        raise ConfigError(f"{path} already times {clash} otherwise than {saved}: use another CONA_CACHE")
    write_cache(path, cached | entries)
    return path, len(entries)


def clock_spec(cfg: Config, files: RunDir, strategies: list[Strategy]) -> ClockSpec:
    """The resolved table and charges of a virtual-clock run that may run `strategies`."""
    t = cfg.train
    vocab = files.vocab_size() if files.corpus.is_file() else None
    workload = Workload.from_config(cfg, vocab=vocab)
    table = t.clock_table if t.clock_table is not None else "measured"
    spec = ClockSpec(
        source="mapping" if isinstance(table, dict) else table,
        seed=t.seed,
        noise=t.clock_noise,
        relaunch_s=cfg.search.switch_cost_s,
        checkpoint_s=checkpoint_seconds(workload.shape.total_params),
    )
    if isinstance(table, dict):
        spec.table, spec.by_gbs = _mapping(table)
    elif table == "measured":
        path = measured_cache_path(cfg)
        spec.cache = str(path)
        for name, entry in read_cache(path).items():
            if set(TIMING) <= set(entry):
                spec.take(Strategy.parse(name), {k: float(v) for k, v in entry.items()})
        return spec
    else:
        spec.table = _modelled(table, workload, strategies)
    missing = [s for s in strategies if spec.seconds(s) is None]
    if missing:
        raise ConfigError(f"train.clock_table: no step time for {missing[0]}, which this run may use")
    return spec


def describe(spec: ClockSpec) -> list[str]:
    """One line per global batch: its fastest timed strategy, seconds per step and samples per second (the
    whole table is in the run folder's clock.json)."""
    best: dict[int, tuple[float, str]] = {g: (sec, f"gbs {g}") for g, sec in spec.by_gbs.items()}
    for name, sec in spec.table.items():
        gbs = Strategy.parse(name).gbs
        best[gbs] = min(best.get(gbs, (math.inf, "")), (sec, name))
    return [f"{name}: {sec:.4f} s/step, {g / sec:.1f} samples/s" for g, (sec, name) in sorted(best.items())]
