"""The hindsight chain of fixed runs, and how much of its lead is the noise it picks.

The chain crosses each slice of log-ppl at the speed of the run that crossed it fastest: the paper's
optimum sequence, with free switches, where progress depends only on the loss reached. Taking the
fastest of noisy curves slice by slice is biased upward: the chain of two seeds of one strategy is
faster than either seed. Two readings of the same runs measure the bias:
- the **noise floor**: the chain of each strategy's runs over the seeds against the fastest of them
  (1.0 with no noise; what it exceeds that by, the chain gains from noise alone);
- the chain **from another seed**: the path picked on one seed's runs, timed on another seed's runs of
  the same strategies. The second seed's noise did not pick the path, so the selection is gone: it is
  no ceiling, but what a chain chosen in hindsight earns on fresh runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from cona_cli.report.crossing import crossing

Curve = Sequence[tuple[float, float]]  # a run's evaluations as (time, log-ppl)
ChainPath = list[tuple[str, float]]  # (run, the ppl from which it runs), in order
LEVELS = 400  # slices of log-ppl between the highest first evaluation and the target


def _slices(curves: Mapping[str, Curve], target: float, levels: int) -> list[tuple[float, float]]:
    top = max(c[0][1] for c in curves.values())
    grid = [top + (math.log(target) - top) * k / levels for k in range(levels + 1)]
    return list(itertools.pairwise(grid))


def _span(c: Curve, hi: float, lo: float) -> float | None:
    a, b = crossing(c, hi), crossing(c, lo)
    return None if a is None or b is None else b - a


def fastest_chain(curves: Mapping[str, Curve], target: float, levels: int = LEVELS) -> tuple[float | None, ChainPath]:
    """The time to `target` of the chain that crosses each slice with the run fastest there (from the
    earliest first evaluation), and its path; (None, []) where no run crosses some slice."""
    elapsed = min(c[0][0] for c in curves.values())
    path: ChainPath = []
    for hi, lo in _slices(curves, target, levels):
        spans = [(s, name) for name, c in curves.items() if (s := _span(c, hi, lo)) is not None]
        if not spans:
            return None, []
        span, name = min(spans)
        elapsed += span
        if not path or path[-1][0] != name:
            path.append((name, math.exp(hi)))
    return elapsed, path


def chain_along(curves: Mapping[str, Curve], target: float, path: ChainPath, levels: int = LEVELS) -> float | None:
    """The time these runs take to `target` along a path picked elsewhere: each slice crossed by the run
    the path names at the slice's upper end (its first run above where it starts). None where that run
    is not among `curves` or does not cross the slice."""
    elapsed = min(c[0][0] for c in curves.values())
    for hi, lo in _slices(curves, target, levels):
        name = next((n for n, ppl in reversed(path) if math.log(ppl) >= hi - 1e-9), path[0][0])
        span = _span(curves[name], hi, lo) if name in curves else None
        if span is None:
            return None
        elapsed += span
    return elapsed
