"""The `cona report --plot` figure: validation perplexity, then GNS and global batch, against wall time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from cona_cli.report.build import Report
from cona_cli.report.runlog import RunLog, as_strategy
from cona_core.strategy import Strategy


def short(s: Strategy) -> str:
    """`dp4 tp1 pp1 mbs2 gbs16`."""
    return str(s).replace("-", " ")


def _mark_switches(log: RunLog, ppl_ax: Axes, batch_ax: Axes, color: tuple) -> None:
    """A dashed vertical line at each switch, annotated with the strategy switched to."""
    for sw in log.of_kind("switch"):
        for ax in (ppl_ax, batch_ax):
            ax.axvline(sw.time, color=color, ls="--", lw=0.8, alpha=0.7)
        to = as_strategy(sw.get("to"))
        if to is not None:
            ppl_ax.annotate(
                short(to),
                xy=(sw.time, 0.98),
                xycoords=("data", "axes fraction"),
                rotation=90,
                ha="right",
                va="top",
                fontsize=7,
                color=color,
            )


def plot_report(logs: Sequence[RunLog], report: Report, out: Path) -> None:
    """Write the PNG to `out` (two panels sharing the time axis, one colour per run)."""
    fig = Figure(figsize=(11, 8), dpi=110, layout="constrained")
    ppl_ax, batch_ax = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    gns_ax = batch_ax.twinx() if any(s.gns is not None for log in logs for s in log.steps) else None
    cmap = matplotlib.colormaps["tab10"]
    any_ppl = False
    for i, log in enumerate(logs):
        color = cmap(i % 10)
        evals = [e for e in log.evals if math.isfinite(e.val_ppl) and e.val_ppl > 0]
        any_ppl |= bool(evals)
        ppl_ax.plot([e.time for e in evals], [e.val_ppl for e in evals], marker="o", ms=3, color=color, label=log.name)
        batch_ax.step(
            [s.time for s in log.steps],
            [s.strategy.gbs for s in log.steps],
            where="pre",
            color=color,
            label=f"{log.name} gbs",
        )
        gns = [s for s in log.steps if s.gns is not None]
        if gns_ax is not None and gns:
            gns_ax.plot([s.time for s in gns], [s.gns for s in gns], ls=":", color=color, label=f"{log.name} GNS")
        _mark_switches(log, ppl_ax, batch_ax, color)
    for i, target in enumerate(report.targets):
        ppl_ax.axhline(target, color="black", ls=":", lw=1, label="target ppl" if i == 0 else None)
        ppl_ax.annotate(
            f"{target:.4g}", xy=(0.005, target), xycoords=("axes fraction", "data"), va="bottom", fontsize=8
        )
    if any_ppl:
        ppl_ax.set_yscale("log")
        ppl_ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ppl_ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ppl_ax.set_ylabel("validation perplexity (log)")
    ppl_ax.set_title("Validation perplexity against wall time (dashed: strategy switches)")
    ppl_ax.legend(loc="upper right", fontsize=8)
    ppl_ax.grid(True, which="both", alpha=0.3)
    batch_ax.set_xlabel("wall time since run start (s)")
    batch_ax.set_ylabel("global batch size (sequences)")
    batch_ax.grid(True, alpha=0.3)
    handles, labels = batch_ax.get_legend_handles_labels()
    if gns_ax is not None:
        gns_ax.set_ylabel("gradient noise scale")
        more = gns_ax.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        batch_ax.legend(handles, labels, loc="upper left", fontsize=8)
    fig.savefig(out)
