"""A run's clock: the host's (`train.clock: wall`) or a virtual one that charges each step a table's time.

Under the virtual clock training is real (ranks, gradients, checkpoints, resizes, relaunches) but run time
advances by what the table says a step of the running strategy takes, times a log-normal factor drawn
from the run's seed and the step number (a third of its variance slow drift: two sinusoids of seeded
phase), so two runs of one config and seed see the same times, whatever else the host runs.
Everything else that takes time is charged on it too:
- a launch's start (process start, imports, process group, model and layout): as measured, or
  `relaunch_s` (the config's `search.switch_cost_s`) where a table does not measure; plus the
  checkpoint's load when it resumes one;
- an evaluation: as measured, or its tokens at a third of a training step's time per token (forward only);
- a checkpoint save, and its load: `CHECKPOINT_BYTES_PER_PARAM` bytes per parameter at `STORAGE_GBS`;
- an in-place resize: one step of the new strategy.

The table (`train.clock_table`): `measured` (each strategy's step time on this host: the median and spread
of a short calibration pass, robust to a slow spell of the host during it, steps as the run's own with their
data, noise-scale norms and collectives, run the first time the strategy runs, with its launch's start and
one evaluation, and cached per config and host, `measured_cache`), a hardware profile (the planner's cost
model on that cluster), or a mapping {strategy or gbs: seconds}. A calibration pass run while other work
loaded the host (its load average beyond the job's own ranks above `BUSY_LOAD` per CPU) is flagged in the
cache, and the controller, the worker and `scripts/bench_ttp.py` name such entries: their steps may be
charged slow in every later run. The controller writes the resolved table to the run folder
(`RunDir.clock`); the workers read it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from cona_core.strategy import Strategy

CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and Adam's two moments
STORAGE_GBS = 2.0  # checkpoint write and read bandwidth, GB/s
FORWARD_SHARE = 1 / 3  # an evaluation token costs this share of a training token (no backward)
DRIFT_SHARE = 0.36  # of the step factor's log variance: slow drift, the rest independent per step
DRIFT_PERIODS = (173.0, 811.0)  # steps: the two sinusoids of the drift
CALIBRATION_STEPS = (3, 12)  # a calibration pass: untimed steps, then timed ones
TIMING = ("seconds", "spread", "start_s", "eval_s")  # what a calibration measures of a strategy (`record`)
MAD_TO_STD = 1.4826  # a normal sample's std over its median absolute deviation
BUSY_LOAD = 1.0  # a calibration with more load than this per CPU beyond the job's own ranks is flagged busy


def step_seconds(logs: list[float]) -> tuple[float, float]:
    """A strategy's table time and noise from the logs of its calibration steps, read as a log-normal step:
    its median exp(μ) and log std σ, from the logs' median and median absolute deviation, so that a slow
    spell of the host during the short pass (a step or two at twice the time) moves neither. The clock's
    draws (exp(μ) times exp(σ·z), `step_factor`) then average to the log-normal's mean,
    exp(μ + σ²/2): a run's time is their sum."""
    mu = statistics.median(logs)
    return math.exp(mu), MAD_TO_STD * statistics.median(abs(v - mu) for v in logs)


@dataclass
class ClockSpec:
    """What a virtual clock charges (JSON in the run folder): `table` by strategy name, `by_gbs` by global
    batch (a mapping given by gbs), `spreads` the measured log std of a step per strategy."""

    source: str  # measured, a profile's name, or mapping
    seed: int
    noise: float | None  # log std of a step's factor (None: the measured spread, 0 where none was measured)
    relaunch_s: float
    checkpoint_s: float
    table: dict[str, float] = field(default_factory=dict)
    by_gbs: dict[int, float] = field(default_factory=dict)
    spreads: dict[str, float] = field(default_factory=dict)
    starts: dict[str, float] = field(default_factory=dict)  # measured: a launch's start under the strategy
    evals: dict[str, float] = field(default_factory=dict)  # measured: one evaluation under the strategy
    busy: dict[str, float] = field(default_factory=dict)  # measured: entries calibrated on a busy host, their load
    cache: str | None = None  # measured: the cache file of this config and host

    def seconds(self, strategy: Strategy) -> float | None:
        """A step's table time under `strategy` (None: not in the table)."""
        return self.table.get(str(strategy), self.by_gbs.get(strategy.gbs))

    def sigma(self, strategy: Strategy) -> float:
        return self.noise if self.noise is not None else self.spreads.get(str(strategy), 0.0)

    def start_s(self, strategy: Strategy) -> float:
        """What a launch's start under `strategy` is charged (before any checkpoint load)."""
        return self.starts.get(str(strategy), self.relaunch_s)

    def record(self, strategy: Strategy, timing: dict[str, float]) -> None:
        """A calibrated strategy's `seconds` (median step), `spread` (log std of a step), `start_s` and
        `eval_s`: into the table, and into the host's cache."""
        self.take(strategy, timing)
        if self.cache is not None:
            path = Path(self.cache)
            write_cache(path, read_cache(path) | {str(strategy): timing})

    def take(self, strategy: Strategy, timing: dict[str, float]) -> None:
        """Set `strategy`'s measured times (a cache entry, as `record` writes it); an entry whose `load`
        (`others_load` during its calibration) exceeds `BUSY_LOAD` is kept in `busy`; timings without one
        (the ranks' shared copy of rank 0's) leave `busy` as it is."""
        name = str(strategy)
        self.table[name], self.spreads[name] = timing["seconds"], timing["spread"]
        self.starts[name], self.evals[name] = timing["start_s"], timing["eval_s"]
        if "load" in timing:
            if timing["load"] > BUSY_LOAD:
                self.busy[name] = timing["load"]
            else:
                self.busy.pop(name, None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClockSpec:
        raw = json.loads(text)
        raw["by_gbs"] = {int(k): float(v) for k, v in raw.get("by_gbs", {}).items()}
        return cls(**raw)


def others_load(own_processes: int) -> float:
    """The host's 1-minute load average beyond `own_processes` (this job's ranks on it), per CPU; 0 where
    the platform has no load average. A calibration pass times steps on a shared CPU: other work inflates
    them, and the cache would keep the inflated time for every later run."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
    return max(0.0, load - own_processes) / (os.cpu_count() or 1)


def busy_warning(busy: dict[str, float], cache: str | None) -> str | None:
    """One line on the table entries calibrated on a busy host (None if there are none)."""
    if not busy:
        return None
    names = ", ".join(f"{name} (load {load:.2g} per CPU)" for name, load in sorted(busy.items()))
    where = f"delete them from {cache}" if cache else "delete them from the cache"
    return (
        f"clock: {len(busy)} table entr{'y was' if len(busy) == 1 else 'ies were'} calibrated while other work "
        f"loaded the host, so their steps may be charged slow: {names}; {where} and rerun on an idle host"
    )


def read_cache(path: Path) -> dict[str, dict[str, float]]:
    """A measured table's cache: {strategy: {seconds, spread}} ({} when absent or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, entries: dict[str, dict[str, float]]) -> None:
    """Replace a measured table's cache at once (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, path)


def measured_cache(model_cluster_train: dict[str, Any], cache_root: Path) -> Path:
    """The cache file of a measured table: one per host and per what decides a step's time (the config's
    model, data, cluster and engine settings, the threads per rank, torch's version)."""
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    key = {
        **model_cluster_train,
        "host": platform.node(),
        "machine": platform.machine(),
        "torch": torch_version,
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root / "clock" / f"{platform.node() or 'host'}-{digest}.json"


def step_factor(seed: int, step: int, sigma: float) -> float:
    """The noise of step `step`: exp(sigma · (independent normal and slow drift)), the same in every run of
    one seed, its log std `sigma`."""
    if sigma <= 0:
        return 1.0
    rng = random.Random(f"{seed}/{step}")
    phases = random.Random(f"{seed}/drift")
    drift = sum(math.sin(2 * math.pi * step / p + phases.uniform(0, 2 * math.pi)) for p in DRIFT_PERIODS)
    drift /= math.sqrt(len(DRIFT_PERIODS) / 2)  # unit variance over a period
    z = math.sqrt(1 - DRIFT_SHARE) * rng.gauss(0.0, 1.0) + math.sqrt(DRIFT_SHARE) * drift
    return math.exp(sigma * z)


class WallClock:
    """The host's clock: run time since `run_start` (epoch seconds); nothing is charged."""

    virtual = False

    def __init__(self, run_start: float) -> None:
        self.run_start = run_start

    def now(self) -> float:
        return time.time() - self.run_start

    def step(self, strategy: Strategy, step: int, measured_s: float) -> float:
        """A step ran: its seconds on this clock (here, as measured)."""
        return measured_s

    def evaluated(self, strategy: Strategy, tokens: int, seq_len: int) -> None:
        """An evaluation of `tokens` ran."""

    def saved(self, measured_s: float) -> float:
        """A checkpoint was saved; its seconds on this clock."""
        return measured_s

    def started(self, strategy: Strategy) -> None:
        """A launch's processes are up and its layout built."""

    def resized(self, strategy: Strategy) -> None:
        """The job resized in place to `strategy` after the step just charged."""


class VirtualClock(WallClock):
    """Run time from a `ClockSpec`, starting at `start` (seconds: where this launch's first step begins)."""

    virtual = True

    def __init__(self, spec: ClockSpec, start: float) -> None:
        super().__init__(time.time())
        self.spec, self.t = spec, start

    def now(self) -> float:
        return self.t

    def table_s(self, strategy: Strategy) -> float:
        seconds = self.spec.seconds(strategy)
        if seconds is None:
            raise KeyError(f"train.clock_table: no step time for {strategy}")
        return seconds

    def step(self, strategy: Strategy, step: int, measured_s: float) -> float:
        seconds = self.table_s(strategy) * step_factor(self.spec.seed, step, self.spec.sigma(strategy))
        self.t += seconds
        return seconds

    def evaluated(self, strategy: Strategy, tokens: int, seq_len: int) -> None:
        measured = self.spec.evals.get(str(strategy))
        self.t += (
            measured
            if measured is not None
            else FORWARD_SHARE * self.table_s(strategy) * tokens / (strategy.gbs * seq_len)
        )

    def started(self, strategy: Strategy) -> None:
        """A launch's processes are up and its layout built (any checkpoint load is charged apart)."""
        self.t += self.spec.start_s(strategy)

    def saved(self, measured_s: float) -> float:
        self.t += self.spec.checkpoint_s
        return self.spec.checkpoint_s

    def resized(self, strategy: Strategy) -> None:
        self.t += self.table_s(strategy)


def checkpoint_seconds(params: int) -> float:
    """A save's (or a load's) modelled seconds for a model of `params` parameters."""
    return CHECKPOINT_BYTES_PER_PARAM * params / (STORAGE_GBS * 1e9)
