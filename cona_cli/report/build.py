"""What `cona report` computes from run logs: time to target perplexity and the chain timeline.

Pure functions of `RunLog` records; formatting lives in report_cli, the figure in report_plot.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cona_cli.report.runlog import EvalRow, Event, RunLog, StepRow, as_strategy
from cona_core.strategy import Strategy


@dataclass(frozen=True)
class TargetResult:
    """When a run first evaluated at or below `target_ppl`; the best it did otherwise."""

    target_ppl: float
    reached: bool
    time_s: float | None
    step: int | None
    samples: int | None
    tokens: int | None
    best_ppl: float | None
    best_time_s: float | None
    speedup: float | None  # baseline time-to-target / this run's, None unless both reached


@dataclass(frozen=True)
class Segment:
    """A stretch of training under one strategy (relaunches of the same strategy continue it)."""

    strategy: Strategy
    start_s: float
    end_s: float
    first_step: int | None
    last_step: int | None
    steps: int
    median_iter_s: float | None
    predicted_iter_s: float | None  # the controller's `predicted_t` when it switched to this stage
    gns_entry: float | None
    gns_exit: float | None
    end_reason: str
    switch_s: float | None  # overhead of the switch that ended the stage


@dataclass(frozen=True)
class RunReport:
    name: str
    path: str
    policy: str | None
    clock: str  # wall, or virtual: TABLE
    exit_reason: str | None  # None: no exit event (still running, or the controller died)
    wall_s: float
    steps: int
    samples: int | None
    tokens: int | None  # None when seq_len is unknown
    seq_len: int | None
    switches: int
    switch_overhead_s: float
    switch_overhead_pct: float | None
    final_ppl: float | None
    best_ppl: float | None
    targets: tuple[TargetResult, ...]
    timeline: tuple[Segment, ...]
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class Report:
    targets: tuple[float, ...]
    target_source: str  # "flag", "config", "best reached by every run" or "none"
    baseline: str | None
    runs: tuple[RunReport, ...]
    ppl_label: str = "ppl"  # "MLM ppl" when every run is a masked LM (bert): exp(mean loss over masked tokens)


def _finite_evals(log: RunLog) -> list[EvalRow]:
    return [e for e in log.evals if math.isfinite(e.val_ppl)]


def best_eval(log: RunLog) -> EvalRow | None:
    """The lowest-perplexity evaluation (the earliest among equals)."""
    return min(_finite_evals(log), key=lambda e: e.val_ppl, default=None)


def default_targets(logs: Sequence[RunLog]) -> tuple[tuple[float, ...], str]:
    """Targets from the configs' `train.target_ppl`, else the best perplexity every run reached."""
    configured = sorted({log.target_ppl for log in logs if log.target_ppl is not None})
    if configured:
        return tuple(configured), "config"
    bests = [b.val_ppl for log in logs if (b := best_eval(log)) is not None]
    if bests:
        return (max(bests),), "best reached by every run"
    return (), "none"


def time_to_target(log: RunLog, target: float) -> TargetResult:
    """The first evaluation at or below `target` (speed-up left unset)."""
    best = best_eval(log)
    hit = next((e for e in _finite_evals(log) if e.val_ppl <= target), None)
    samples = hit.consumed_samples if hit else None
    return TargetResult(
        target_ppl=target,
        reached=hit is not None,
        time_s=hit.time if hit else None,
        step=hit.step if hit else None,
        samples=samples,
        tokens=samples * log.seq_len if samples is not None and log.seq_len else None,
        best_ppl=best.val_ppl if best else None,
        best_time_s=best.time if best else None,
        speedup=None,
    )


@dataclass
class _Group:
    strategy: Strategy
    start: float
    rows: list[StepRow]


def _groups(log: RunLog) -> list[_Group]:
    """Split the run at launches of a new strategy and at strategy changes in step rows."""
    stream: list[tuple[float, int, Event | StepRow]] = [(e.time, 0, e) for e in log.of_kind("launch")] + [
        (s.time, 1, s) for s in log.steps
    ]
    stream.sort(key=lambda x: (x[0], x[1]))
    groups: list[_Group] = []
    for time, _, item in stream:
        if isinstance(item, Event):
            strategy, start = as_strategy(item.get("strategy")), time
        else:
            strategy, start = item.strategy, time - (item.iter_s or 0.0)
        if strategy is None:
            continue
        if not groups or groups[-1].strategy != strategy:
            groups.append(_Group(strategy, start, []))
        if isinstance(item, StepRow):
            groups[-1].rows.append(item)
    return groups


def _matches(value: object, strategy: Strategy) -> bool:
    """True unless `value` names a different strategy (absent or unreadable values match)."""
    parsed = as_strategy(value)
    return parsed is None or parsed == strategy


def _ending_switch(switches: list[Event], after: float, to: Strategy) -> Event | None:
    """Take (and remove) the first switch event at or after `after` that leads to `to`."""
    for i, e in enumerate(switches):
        if e.time >= after and _matches(e.get("to"), to):
            return switches.pop(i)
    return None


def _decision_for(log: RunLog, switch: Event, since: float, to: Strategy) -> Event | None:
    """The last decision to switch to `to` taken between `since` and the switch."""
    found = [
        d
        for d in log.of_kind("decision")
        if d.get("switch") and since <= d.time <= switch.time and _matches(d.get("candidate"), to)
    ]
    return found[-1] if found else None


def _end_reason(switch: Event | None, decision: Event | None) -> str:
    if switch is None:
        return "strategy change"
    reason = str(switch.get("reason", "switch"))
    ratio = decision.get("ratio") if decision else None
    if reason == "decision" and isinstance(ratio, (int, float)):
        return f"decision (ratio {ratio:.3g})"
    return reason


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def timeline(log: RunLog) -> list[Segment]:
    """The chain of stages the run went through, in order."""
    groups = _groups(log)
    switches = log.of_kind("switch")
    exit_event = log.last("exit")
    stages: list[Segment] = []
    predicted: float | None = None
    for i, g in enumerate(groups):
        switch = decision = None
        if i + 1 < len(groups):
            switch = _ending_switch(switches, g.start, groups[i + 1].strategy)
            if switch is not None:
                decision = _decision_for(log, switch, g.start, groups[i + 1].strategy)
            reason = _end_reason(switch, decision)
        else:
            reason = str(exit_event.get("reason", "exit")) if exit_event else "no exit event"
        rows = g.rows
        iters = [r.iter_s for r in rows if r.iter_s is not None]
        gns = [r.gns for r in rows if r.gns is not None]
        stages.append(
            Segment(
                strategy=g.strategy,
                start_s=g.start,
                end_s=rows[-1].time if rows else g.start,
                first_step=rows[0].step if rows else None,
                last_step=rows[-1].step if rows else None,
                steps=rows[-1].step - rows[0].step + 1 if rows else 0,
                median_iter_s=statistics.median(iters) if iters else None,
                predicted_iter_s=predicted,
                gns_entry=gns[0] if gns else None,
                gns_exit=gns[-1] if gns else None,
                end_reason=reason,
                switch_s=_number(switch.get("seconds")) if switch else None,
            )
        )
        predicted = _number(decision.get("predicted_t")) if decision else None
    return stages


def run_report(log: RunLog, targets: Sequence[float]) -> RunReport:
    """Everything the report says about one run (speed-ups left unset)."""
    switches = log.of_kind("switch")
    overhead = sum((s for e in switches if (s := _number(e.get("seconds"))) is not None), 0.0)
    wall = log.wall_s
    last = log.steps[-1] if log.steps else None
    samples = last.consumed_samples if last else None
    exit_event = log.last("exit")
    best = best_eval(log)
    return RunReport(
        name=log.name,
        path=str(log.path),
        policy=log.policy,
        clock=log.clock,
        exit_reason=str(exit_event.get("reason")) if exit_event else None,
        wall_s=wall,
        steps=last.step if last else 0,
        samples=samples,
        tokens=samples * log.seq_len if samples is not None and log.seq_len else None,
        seq_len=log.seq_len,
        switches=len(switches),
        switch_overhead_s=overhead,
        switch_overhead_pct=100.0 * overhead / wall if wall > 0 else None,
        final_ppl=log.evals[-1].val_ppl if log.evals else None,
        best_ppl=best.val_ppl if best else None,
        targets=tuple(time_to_target(log, t) for t in targets),
        timeline=tuple(timeline(log)),
        warnings=log.warnings,
    )


def _with_speedups(run: RunReport, baseline: RunReport) -> RunReport:
    results = []
    for mine, base in zip(run.targets, baseline.targets):
        speedup = base.time_s / mine.time_s if mine.reached and base.reached and mine.time_s else None
        results.append(replace(mine, speedup=speedup))
    return replace(run, targets=tuple(results))


def static_baseline(logs: Sequence[RunLog]) -> int | None:
    """The index of the only run whose policy is `static`, if there is exactly one."""
    static = [i for i, log in enumerate(logs) if log.policy == "static"]
    return static[0] if len(static) == 1 else None


def build_report(logs: Sequence[RunLog], targets: Sequence[float] = (), baseline: int | None = None) -> Report:
    """The report over `logs`; `baseline` indexes the run to compare against (default: the static one)."""
    if targets:
        chosen, source = tuple(targets), "flag"
    else:
        chosen, source = default_targets(logs)
    runs = [run_report(log, chosen) for log in logs]
    if baseline is None:
        baseline = static_baseline(logs)
    if baseline is not None:
        runs = [_with_speedups(r, runs[baseline]) for r in runs]
    return Report(
        targets=chosen,
        target_source=source,
        baseline=runs[baseline].name if baseline is not None else None,
        runs=tuple(runs),
        ppl_label="MLM ppl" if logs and all(log.family == "bert" for log in logs) else "ppl",
    )
