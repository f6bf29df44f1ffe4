"""`cona search CONFIG --dry-run`: rank strategies with the cost model, without launching anything.

The search modules (scipy, scikit-optimize) load inside the command, so other commands start fast.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from cona_cli.commands.errors import fail
from cona_cli.overrides import parse_sets
from cona_cli.planner.hardware import HardwareProfile, load_hardware
from cona_cli.planner.memory import compute_precision
from cona_cli.planner.space import gbs_ladder
from cona_cli.planner.workload import Workload
from cona_cli.run_config import load_config
from cona_core.config import Config, ConfigError

if TYPE_CHECKING:
    from cona_cli.planner.search import Candidate, SearchResult


def _gns_text(g: float) -> str:
    return "never" if math.isinf(g) else "always" if g == 0 else f"{g:,.0f}"


def _candidate_row(c: Candidate) -> list[str]:
    s = c.strategy
    return [
        str(s.dp),
        str(s.tp),
        str(s.pp),
        str(s.mbs),
        str(s.gbs),
        str(s.n_microbatches),
        f"{c.time_s:.3g}",
        f"{c.time_std:.2g}",
        f"{c.samples_per_s:.3g}",
        f"{c.memory_gib:.1f}",
        f"{c.phi:.4g}",
    ]


_COLUMNS = ("dp", "tp", "pp", "mbs", "gbs", "m", "s/iter", "±", "seq/s", "GiB", "Φ")
_LEGEND = "m: micro-batches; s/iter: predicted mean ± std; GiB: peak per device; Φ = (gbs/T)/(gbs+GNS)"


def _table(title: str, columns: tuple[str, ...], rows: list[list[str]], caption: str | None = None) -> Table:
    table = Table(title=title, caption=caption)
    for col in columns:
        table.add_column(col, justify="left" if col in ("strategy", "reason") else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _render(
    cfg: Config,
    hw: HardwareProfile,
    results: list[SearchResult],
    all_gbs: bool,
    gns: float,
    top: int,
    show_rejected: bool,
) -> None:
    console = Console()
    head = f"{cfg.source}, {cfg.cluster.world} x {hw.name}, GNS {gns:g}"
    if all_gbs:
        from cona_cli.planner.search import crossovers

        cross = {large: g for _, large, g in crossovers(results)}
        rows = [
            _candidate_row(r.best) + [_gns_text(cross[r.gbs]) if r.gbs in cross else "-"] for r in results if r.best
        ]
        console.print(
            _table(
                f"Best per global batch: {head}",
                _COLUMNS + ("wins at GNS >",),
                rows,
                f"{_LEGEND}; wins at GNS >: above this GNS the rung beats the previous one",
            )
        )
        for r in results:
            if not r.best:
                console.print(f"gbs {r.gbs}: no feasible strategy")
    else:
        (r,) = results
        how = "all evaluated" if r.exhaustive else f"Bayesian search evaluated {len(r.ranked)}"
        rows = [[str(i + 1)] + _candidate_row(c) for i, c in enumerate(r.ranked[:top])]
        console.print(
            _table(
                f"gbs {r.gbs}: {head}",
                ("#",) + _COLUMNS,
                rows,
                f"{r.n_feasible} feasible ({how}), {len(r.rejected)} rejected. {_LEGEND}",
            )
        )
    if show_rejected:
        rows = [[str(s), reason] for r in results for s, reason in r.rejected]
        console.print(_table("Rejected", ("strategy", "reason"), rows))


def _as_json(
    cfg: Config,
    hw: HardwareProfile,
    results: list[SearchResult],
    all_gbs: bool,
    gns: float,
    top: int,
    show_rejected: bool,
) -> str:
    out: dict[str, Any] = {
        "config": cfg.source,
        "hardware": hw.name,
        "world": cfg.cluster.world,
        "gns": gns,
        "results": [r.to_dict(top, show_rejected) for r in results],
    }
    if all_gbs:
        from cona_cli.planner.search import crossovers

        out["crossovers"] = [
            {"from_gbs": a, "to_gbs": b, "gns": None if math.isinf(g) else g} for a, b, g in crossovers(results)
        ]
    return json.dumps(out, indent=2)


def search_command(
    config: Path = typer.Argument(..., help="YAML run config (its model, cluster and search sections)."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Plan from the cost model only; launches nothing (required)."
    ),
    gbs: int | None = typer.Option(
        None, "--gbs", help="Global batch to search (default: search.gbs_static or the first rung)."
    ),
    all_gbs: bool = typer.Option(
        False, "--all-gbs", help="Best strategy at every rung of the gbs ladder and the crossover GNS."
    ),
    gns: float = typer.Option(0.0, "--gns", help="Gradient noise scale (sequences) for Φ."),
    hardware: str | None = typer.Option(
        None, "--hardware", help="Hardware profile name or YAML path (default: search.hardware)."
    ),
    top: int = typer.Option(10, "--top", help="Candidates to show per global batch."),
    as_json: bool = typer.Option(False, "--json", help="Write the result as JSON to stdout."),
    show_rejected: bool = typer.Option(False, "--show-rejected", help="Also list rejected strategies with reasons."),
    sets: list[str] | None = typer.Option(
        None, "--set", metavar="SECTION.KEY=VALUE", help="Override one config value (YAML), e.g. search.mbs=[1,2]."
    ),
) -> None:
    """Rank parallelism strategies (dp, tp, pp, mbs, gbs) by predicted seconds per step and Φ."""
    if not dry_run:
        raise fail(
            "cona search", "only --dry-run is available: it plans from the cost model without launching anything"
        ) from None
    if gbs is not None and all_gbs:
        raise fail("cona search", "--gbs and --all-gbs exclude each other") from None
    if gbs is not None and gbs < 1:
        raise fail("cona search", f"--gbs must be >= 1, got {gbs}") from None
    if top < 1:
        raise fail("cona search", f"--top must be >= 1, got {top}") from None
    if not math.isfinite(gns) or gns < 0:
        raise fail("cona search", f"--gns must be a finite number >= 0, got {gns}") from None
    try:
        cfg = load_config(config, parse_sets(sets))
        hw = load_hardware(hardware or cfg.search.hardware)
    except ConfigError as e:
        raise fail("cona search", str(e)) from None
    from cona_cli.planner.calibration import Calibrator
    from cona_cli.planner.search import plan

    w = Workload.from_config(cfg)
    precision = compute_precision(cfg.search.precision, hw)
    if precision not in hw.peak_tflops:
        raise fail("cona search", f"hardware {hw.name}: no peak_tflops for search.precision {precision}") from None
    ladder = gbs_ladder(cfg) if all_gbs else [gbs or cfg.search.gbs_static or gbs_ladder(cfg)[0]]
    results = plan(cfg, hw, Calibrator(w, hw, seed=cfg.search.seed), ladder, gns)
    if as_json:
        print(_as_json(cfg, hw, results, all_gbs, gns, top, show_rejected))
    else:
        _render(cfg, hw, results, all_gbs, gns, top, show_rejected)
