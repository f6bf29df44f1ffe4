"""The global batches a run went through, and its reversals.

A *reversal* is a switch to a smaller global batch: it goes against the trend (the noise scale grows as
the loss falls), so a policy that makes many, or makes one before its first readings settle, is
flapping. The benchmark's bound: at most one reversal per `PER_S` seconds of run, none in the first
`QUIET_S` seconds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from cona_cli.report.runlog import RunLog

PER_S = 100.0
QUIET_S = 30.0
BOUND = f"at most one reversal per {PER_S:g} s, none in the first {QUIET_S:g} s"


@dataclass(frozen=True)
class BatchMove:
    """A switch that changed the global batch, at `time_s` of the run's clock."""

    time_s: float
    from_gbs: int
    to_gbs: int

    @property
    def reversal(self) -> bool:
        return self.to_gbs < self.from_gbs


def batch_moves(log: RunLog) -> list[BatchMove]:
    """The run's changes of global batch, in order, each at the time of its first step at the new batch
    (read from the step rows, which carry the run's clock on either clock; layout-only switches left out)."""
    moves = []
    for before, after in itertools.pairwise(log.steps):
        if after.strategy.gbs != before.strategy.gbs:
            moves.append(BatchMove(after.time, before.strategy.gbs, after.strategy.gbs))
    return moves


def reversals_within_bound(moves: list[BatchMove], run_s: float) -> bool:
    """At most one reversal per PER_S seconds of a run of `run_s` seconds, none before QUIET_S."""
    back = [m for m in moves if m.reversal]
    return len(back) * PER_S <= run_s and all(m.time_s >= QUIET_S for m in back)


def describe(log: RunLog) -> str:
    """'8 → 16 (7.5 s) → 8 (40 s); 1 reversal in 240 s: within the bound'."""
    moves = batch_moves(log)
    start = str(log.steps[0].strategy.gbs) if log.steps else "?"
    path = " → ".join([start] + [f"{m.to_gbs} ({m.time_s:.3g} s)" for m in moves])
    back = sum(m.reversal for m in moves)
    run_s = log.wall_s
    verdict = "within" if reversals_within_bound(moves, run_s) else "OUTSIDE"
    return f"{path}; {back} reversal{'s' * (back != 1)} in {run_s:.0f} s: {verdict} the bound"
