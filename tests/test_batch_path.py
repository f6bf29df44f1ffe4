"""A run's global batches and its reversals, on hand-written step rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from cona_cli.report.batch_path import BatchMove, batch_moves, describe, reversals_within_bound
from cona_cli.report.runlog import Event, RunLog, StepRow
from cona_core.strategy import Strategy


def log_of(path: list[tuple[float, int, int]], end_s: float) -> RunLog:
    """A wall-clock run whose steps at (time, dp, gbs) are `path`, ending at `end_s`."""
    steps = tuple(
        StepRow(
            step=i + 1,
            time=t,
            strategy=Strategy(dp, 1, 1, gbs // dp, gbs),
            iter_s=0.1,
            consumed_samples=None,
            loss=None,
            launch=1,
            gns=None,
        )
        for i, (t, dp, gbs) in enumerate(path)
    )
    exit_event = Event("exit", end_s, {"kind": "exit", "time": end_s})
    return RunLog(Path("run"), steps, (), (exit_event,), None, None, ())


def test_batch_moves_leave_out_layout_switches_and_date_each_move_at_its_first_step() -> None:
    log = log_of([(1, 4, 8), (2, 4, 8), (3, 2, 8), (5, 4, 16), (6, 4, 16), (40, 4, 8), (90, 4, 32)], 100)
    assert batch_moves(log) == [BatchMove(5, 8, 16), BatchMove(40, 16, 8), BatchMove(90, 8, 32)]
    assert describe(log) == "8 → 16 (5 s) → 8 (40 s) → 32 (90 s); 1 reversal in 100 s: within the bound"


@pytest.mark.parametrize(
    "times,run_s,within",
    [
        ([], 50, True),
        ([45], 100, True),  # one in 100 s, after the first 30
        ([29], 100, False),  # in the first 30 s
        ([45], 99, False),  # one in under 100 s
        ([45, 150], 200, True),
        ([45, 150], 199, False),
    ],
)
def test_at_most_one_reversal_per_100_s_and_none_in_the_first_30(
    times: list[float], run_s: float, within: bool
) -> None:
    moves = [BatchMove(t - 1, 8, 16) for t in times] + [BatchMove(t, 16, 8) for t in times]
    assert reversals_within_bound(moves, run_s) is within
