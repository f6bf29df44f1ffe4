"""When an evaluated validation curve first reaches a level: how `scripts/bench_ttp.py` times a target, and
how `cona simulate` times its simulated evaluations so that the two compare."""

from __future__ import annotations

from collections.abc import Sequence


def crossing(points: Sequence[tuple[float, float]], level: float) -> float | None:
    """The time a curve of (time, log-ppl) evaluations first reaches `level`: linear in log-ppl between
    the evaluations that bracket it (taking the first one at or below it would quantise every time to the
    evaluation interval); the first evaluation's time if it is already there, None if none reaches it."""
    hit = next((i for i, (_, v) in enumerate(points) if v <= level), None)
    if hit is None or hit == 0:
        return None if hit is None else points[0][0]
    (t0, v0), (t1, v1) = points[hit - 1], points[hit]
    return t0 + (v0 - level) / (v0 - v1) * (t1 - t0)
