"""The `cona simulate --plot` figure: perplexity against simulated time, then the global batch."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from cona_cli.simulate.world import Curve


def batch_steps(curve: Curve) -> tuple[list[float], list[int]]:
    """(times, gbs) of a step plot of the curve's global batch, from its first strategy and its switches."""
    first = curve.first or (curve.switches[0][1] if curve.switches else None)
    times, gbs = [0.0], [first.gbs if first else 0]
    for t, _, new in curve.switches:
        times.append(t)
        gbs.append(new.gbs)
    times.append(curve.times[-1])
    gbs.append(gbs[-1])
    return times, gbs


def plot_simulation(curves: Mapping[str, Curve], targets: list[float], out: Path) -> None:
    """Write the PNG to `out`: one colour per named curve, the target perplexities dotted, the axis from
    the lowest perplexity reached to 4× the highest target."""
    fig = Figure(figsize=(11, 7), dpi=110, layout="constrained")
    ppl_ax, batch_ax = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    cmap = matplotlib.colormaps["tab10"]
    for i, (name, curve) in enumerate(curves.items()):
        color = cmap(i % 10)
        pairs = [(t, math.exp(v)) for t, v in zip(curve.times, curve.losses) if math.isfinite(v) and v < 50]
        ppl_ax.plot([t for t, _ in pairs], [p for _, p in pairs], color=color, label=name, lw=1.2)
        times, gbs = batch_steps(curve)
        batch_ax.step(times, gbs, where="post", color=color, lw=1.2)
    for p in targets:
        ppl_ax.axhline(p, color="grey", ls=":", lw=0.8)
    lowest = min((math.exp(min(c.losses)) for c in curves.values()), default=min(targets))
    ppl_ax.set_yscale("log")
    ppl_ax.set_ylim(min(lowest, min(targets)) / 1.2, 4 * max(targets))
    ppl_ax.set_ylabel("perplexity")
    ppl_ax.legend(fontsize=8)
    ppl_ax.grid(alpha=0.3)
    batch_ax.set_yscale("log", base=2)
    batch_ax.set_ylabel("global batch")
    batch_ax.set_xlabel("simulated seconds")
    batch_ax.grid(alpha=0.3)
    fig.savefig(out)
