"""Read a run directory (see docs/run-dir.md) into typed records, tolerating torn and partial files.

Works on finished, running and crashed runs alike: a last line that is not valid JSON is skipped
silently (it may still be being written); any other unreadable line is skipped with a warning.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona_core.rundir import RunDir, read_jsonl
from cona_core.strategy import Strategy, StrategyError


class NotARunError(ValueError):
    """The folder holds neither metrics.jsonl nor events.jsonl."""


@dataclass(frozen=True)
class StepRow:
    """One optimizer step (a `kind: "step"` row of metrics.jsonl)."""

    step: int
    time: float
    strategy: Strategy
    iter_s: float | None
    consumed_samples: int | None
    loss: float | None
    launch: int | None
    gns: float | None


@dataclass(frozen=True)
class EvalRow:
    """One validation pass (a `kind: "eval"` row of metrics.jsonl)."""

    step: int
    time: float
    val_ppl: float
    val_loss: float | None
    consumed_samples: int | None


@dataclass(frozen=True)
class Event:
    """One controller event; `data` is the whole JSON object (kind and time included)."""

    kind: str
    time: float
    data: Mapping[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


@dataclass(frozen=True)
class RunLog:
    """Everything readable from one run directory."""

    path: Path
    steps: tuple[StepRow, ...]
    evals: tuple[EvalRow, ...]
    events: tuple[Event, ...]
    seq_len: int | None
    target_ppl: float | None
    warnings: tuple[str, ...]
    family: str | None = None  # model.family (bert: a masked LM, its perplexity over masked tokens)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def policy(self) -> str | None:
        start = self.first("start")
        return start.get("policy") if start else None

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def first(self, kind: str) -> Event | None:
        return next((e for e in self.events if e.kind == kind), None)

    def last(self, kind: str) -> Event | None:
        return next((e for e in reversed(self.events) if e.kind == kind), None)

    @property
    def clock(self) -> str:
        """The run's clock: `wall`, or `virtual: TABLE` (`train.clock`; its times are the table's)."""
        start = self.first("start")
        if start is None or start.get("clock", "wall") == "wall":
            return "wall"
        return f"virtual: {start.get('clock_table')}"

    @property
    def wall_s(self) -> float:
        """Seconds from run start to the exit event, or to the latest record of a run without one (on the
        virtual clock: to its latest row, the controller's events being on the host's clock)."""
        if self.clock != "wall":
            return max((r.time for r in (*self.steps, *self.evals)), default=0.0)
        end = self.last("exit")
        if end is not None:
            return end.time
        times = [r.time for r in (*self.steps, *self.evals, *self.events)]
        return max(times, default=0.0)


def as_strategy(value: Any) -> Strategy | None:
    """A strategy from an event field (mapping or `dp2-tp1-pp2-mbs2-gbs16` string); None if unreadable."""
    try:
        if isinstance(value, Mapping):
            return Strategy.from_mapping(dict(value))
        if isinstance(value, str):
            return Strategy.parse(value)
    except StrategyError:
        pass
    return None


def _num(row: Mapping[str, Any], key: str, required: bool = False) -> float | None:
    v = row.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if required:
        raise KeyError(key)
    return None


def _int(row: Mapping[str, Any], key: str, required: bool = False) -> int | None:
    v = _num(row, key, required)
    return None if v is None or not math.isfinite(v) else int(v)


def _step_row(row: Mapping[str, Any]) -> StepRow:
    strategy = Strategy.from_mapping(dict(row), "step row")
    return StepRow(
        step=_int(row, "step", True),
        time=_num(row, "time", True),
        strategy=strategy,
        iter_s=_num(row, "iter_s"),
        consumed_samples=_int(row, "consumed_samples"),
        loss=_num(row, "loss"),
        launch=_int(row, "launch"),
        gns=_num(row, "gns"),
    )


def _eval_row(row: Mapping[str, Any]) -> EvalRow:
    return EvalRow(
        step=_int(row, "step", True),
        time=_num(row, "time", True),
        val_ppl=_num(row, "val_ppl", True),
        val_loss=_num(row, "val_loss"),
        consumed_samples=_int(row, "consumed_samples"),
    )


def _config_summary(path: Path, warnings: list[str]) -> tuple[int | None, float | None, str | None]:
    """(model.seq_len, train.target_ppl, model.family) from config.resolved.json, None where absent."""
    if not path.exists():
        return None, None, None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        warnings.append(f"{path}: unreadable ({e}); seq_len and target_ppl unknown")
        return None, None, None
    if not isinstance(cfg, dict):
        return None, None, None
    model, train = cfg.get("model"), cfg.get("train")
    seq_len = _int(model, "seq_len") if isinstance(model, dict) else None
    target = _num(train, "target_ppl") if isinstance(train, dict) else None
    family = model.get("family") if isinstance(model, dict) and isinstance(model.get("family"), str) else None
    return seq_len, target, family


def read_run(path: Path) -> RunLog:
    """Read RUN_DIR; raises NotARunError when it is not a run directory."""
    path = Path(path)
    run = RunDir(path)
    metrics, events_path = run.metrics, run.events
    if not path.is_dir() or not (metrics.exists() or events_path.exists()):
        raise NotARunError(f"{path}: not a run directory (no metrics.jsonl or events.jsonl)")
    warnings: list[str] = []
    steps: list[StepRow] = []
    evals: list[EvalRow] = []
    for row in read_jsonl(metrics, warnings):
        kind = row.get("kind")
        if kind not in ("step", "eval"):
            continue
        try:
            if kind == "step":
                steps.append(_step_row(row))
            else:
                evals.append(_eval_row(row))
        except (KeyError, StrategyError) as e:
            warnings.append(f"{metrics}: skipped a {kind} row at step {row.get('step')}: missing or bad {e}")
    events = []
    for row in read_jsonl(events_path, warnings):
        time = _num(row, "time")
        if isinstance(row.get("kind"), str) and time is not None:
            events.append(Event(row["kind"], time, row))
        else:
            warnings.append(f"{events_path}: skipped an event without kind or time")
    seq_len, target, family = _config_summary(run.resolved_config, warnings)
    return RunLog(
        path=path,
        steps=tuple(steps),
        evals=tuple(evals),
        events=tuple(events),
        seq_len=seq_len,
        target_ppl=target,
        warnings=tuple(warnings),
        family=family,
    )
