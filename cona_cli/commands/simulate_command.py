"""`cona simulate`: policy cona, the offline planner's static pick, every rung's best static strategy and
the optimum sequence, on a simulated clock (`cona_cli.simulate`), with their times to each target."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import typer

from cona_cli.commands.errors import fail
from cona_cli.overrides import parse_sets
from cona_cli.run_config import load_config
from cona_core.config import ConfigError


def simulate_command(
    config: Path = typer.Argument(..., help="YAML config (its model, cluster, ladder and hardware profile)."),
    targets: str | None = typer.Option(
        None, "--targets", help="Comma-separated perplexities (default: 4x, 2x and 1x train.target_ppl)."
    ),
    seeds: int = typer.Option(5, "--seeds", min=1, help="Noise seeds; medians and ranges over them."),
    noise: float = typer.Option(0.05, "--noise", min=0.0, help="Lognormal std of a step's time."),
    gns_noise: float = typer.Option(0.5, "--gns-noise", min=0.0, help="Relative std of one step's GNS estimate."),
    true_kappa: float = typer.Option(
        1.0, "--true-kappa", help="The true critical batch over the GNS the workers report."
    ),
    lr_sensitivity: float = typer.Option(
        0.0,
        "--lr-sensitivity",
        help="A step at batch b is worth (b / lowest rung)^this times the law's progress (> 0: larger batches "
        "need fewer samples).",
    ),
    from_run: list[Path] | None = typer.Option(
        None,
        "--from-run",
        help="Static runs of this config (repeatable): the world follows their loss curves, GNS and step times "
        "instead of Kaplan's law.",
    ),
    truth: str | None = typer.Option(
        None, "--truth", help="Hardware profile the world runs on (default: search.hardware, the planner's)."
    ),
    relaunch_s: float = typer.Option(20.0, "--relaunch-s", min=0.0, help="Process start of a relaunch."),
    storage_gbs: float = typer.Option(2.0, "--storage-gbs", min=1e-6, help="Checkpoint save and load, GB/s."),
    max_time: float = typer.Option(14 * 24 * 3600.0, "--max-time", min=1.0, help="Simulated seconds at most."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Also write a PNG: perplexity and global batch against time (seed 0)."
    ),
    sets: list[str] | None = typer.Option(
        None, "--set", metavar="SECTION.KEY=VALUE", help="Override one config value (YAML)."
    ),
) -> None:
    """Simulate whether chaining pays here: the real policy on a simulated clock, Kaplan et al.'s law."""
    from cona_cli.planner.hardware import load_hardware

    try:
        cfg = load_config(config, parse_sets(sets))
        hw = load_hardware(cfg.search.hardware)
        world_hw = load_hardware(truth) if truth else hw
        ppls = _targets(targets, cfg.train.target_ppl)
    except ConfigError as e:
        raise fail("cona simulate", str(e)) from None
    if true_kappa <= 0:
        raise fail("cona simulate", "--true-kappa: must be > 0")
    if from_run and (true_kappa != 1.0 or lr_sensitivity != 0.0 or gns_noise != 0.5):
        raise fail(
            "cona simulate",
            "--from-run: the runs set the world; --true-kappa, --lr-sensitivity and --gns-noise are for Kaplan's law",
        )
    from cona_cli.control.cona_policy import ConaPolicy, fastest_strategy
    from cona_cli.simulate.world import Simulation, WorldSpec

    try:
        dynamics = _dynamics(cfg, from_run, true_kappa, gns_noise, lr_sensitivity)
    except ValueError as e:
        raise fail("cona simulate", str(e)) from None
    measured, warmups, start_s, eval_s = {}, {}, 0.0, 0.0
    if from_run:
        measured, warmups, (start_s, eval_s) = dynamics.measured_times(), dynamics.warmups(), dynamics.overheads()
        typer.echo(
            f"measured overheads: {start_s:.3g} s before the first step, {eval_s:.3g} s per evaluation", err=True
        )
    spec = WorldSpec(dynamics, world_hw, noise, measured, warmups, start_s, eval_s, relaunch_s, storage_gbs, max_time)
    sim = Simulation(cfg, spec)
    if not sim.space:
        raise fail("cona simulate", f"no feasible strategy on {world_hw.name} for this config")
    stop = math.log(min(ppls))
    if stop <= dynamics.floor():
        floor = math.exp(dynamics.floor())
        what = "how far the runs' curves extend" if from_run else "the law's floor for this model"
        raise fail("cona simulate", f"--targets: ppl {min(ppls):g} is below {what} (ppl {floor:.4g})")
    auto = fastest_strategy(cfg, hw)
    runs: dict[str, list[Any]] = {"cona": [], f"static-auto ({auto})": []}
    runs |= {f"static-{g} ({sim.static_at(g)})": [] for g in sim.ladder}
    for seed in range(seeds):
        runs["cona"].append(sim.run(ConaPolicy(cfg, hw), stop, seed))
        runs[f"static-auto ({auto})"].append(sim.static(auto, stop, seed))
        for g in sim.ladder:
            runs[f"static-{g} ({sim.static_at(g)})"].append(sim.static(sim.static_at(g), stop, seed))
    optimum = sim.optimum(stop)
    costed = sim.optimum_with_costs(stop, cfg.search.in_place)
    runs["optimum sequence (free switches)"] = [optimum]
    runs["optimum sequence (switch costs charged)"] = [costed]
    table = {name: [[c.time_to(math.log(p)) for p in ppls] for c in curves] for name, curves in runs.items()}
    if plot is not None:
        _plot(runs, table, ppls, plot)
    if as_json:
        out = {
            "config": str(config),
            "hardware": hw.name,
            "truth": world_hw.name,
            "targets": ppls,
            "seeds": seeds,
            "times_s": table,
            # as the runs' evaluations would time them (bench_ttp.py's measure; the optima have none)
            "evaluated_times_s": {
                name: [[c.time_evaluated(math.log(p)) for p in ppls] for c in curves]
                for name, curves in runs.items()
                if not name.startswith("optimum")
            },
            "cona_switches": [[(t, str(a), str(b)) for t, a, b in c.switches] for c in runs["cona"]],
            "optimum_switches": [(t, str(a), str(b)) for t, a, b in optimum.switches],
            "costed_optimum_switches": [(t, str(a), str(b)) for t, a, b in costed.switches],
        }
        typer.echo(json.dumps(out, indent=2))
        return
    typer.echo(_preflight(sim, auto))
    typer.echo(_gains(table, ppls))
    typer.echo(_table(table, ppls, seeds))
    first = runs["cona"][0]
    moves = ", ".join(f"{a.gbs} → {b.gbs} at {_dur(t)}" for t, a, b in first.switches) or "none"
    typer.echo(f"cona's switches (seed 0): {moves}")
    for label, curve in (("optimum's (free switches)", optimum), ("costed optimum's", costed)):
        typer.echo(
            f"{label}: " + (", ".join(f"{a.gbs} → {b.gbs} at {_dur(t)}" for t, a, b in curve.switches) or "none")
        )


def _dynamics(cfg: Any, from_run: list[Path] | None, true_kappa: float, gns_noise: float, lr_sensitivity: float) -> Any:
    """The world's training: curves of the given static runs, else Kaplan's law for the config's model."""
    from cona_cli.planner.space import gbs_ladder

    ladder = gbs_ladder(cfg)
    if from_run:
        from cona_cli.simulate.from_runs import RunDynamics, read_static_run

        dynamics = RunDynamics([read_static_run(p, cfg) for p in from_run], ladder)
        typer.echo(dynamics.describe(), err=True)
        outside = dynamics.unmeasured(ladder)
        if outside:
            typer.echo(outside, err=True)
        return dynamics
    from cona_cli.planner.workload import Workload
    from cona_cli.simulate.law import KaplanDynamics, KaplanLaw

    shape = Workload.from_config(cfg).shape
    law = KaplanLaw(shape.n_layers * shape.layer_params, cfg.model.seq_len)
    return KaplanDynamics(law, ladder[0], true_kappa, gns_noise, lr_sensitivity)


def _plot(runs: dict[str, list[Any]], table: dict[str, list[list[float | None]]], ppls: list[float], out: Path) -> None:
    """Seed 0 of cona, static-auto, the static fastest to the last target, and both optima."""
    from cona_cli.simulate.plot import plot_simulation  # matplotlib only when asked for

    statics = [k for k in runs if k.startswith("static-") and not k.startswith("static-auto")]
    reached = [k for k in statics if table[k][0][-1] is not None]
    best = [min(reached, key=lambda k: table[k][0][-1])] if reached else []
    chosen = ["cona", *[k for k in runs if k.startswith("static-auto")], *best]
    chosen += [k for k in runs if k.startswith("optimum")]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        plot_simulation({k: runs[k][0] for k in chosen}, ppls, out)
    except OSError as e:
        raise fail("cona simulate", f"--plot: cannot write {out}: {e}") from None
    typer.echo(f"cona simulate: wrote {out}", err=True)


def _targets(text: str | None, target_ppl: float | None) -> list[float]:
    if text is None:
        if target_ppl is None:
            raise ConfigError("--targets: give perplexities (the config has no train.target_ppl)")
        return [4 * target_ppl, 2 * target_ppl, target_ppl]
    try:
        ppls = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--targets: {text!r} is not a comma-separated list of numbers") from None
    if not ppls or any(p <= 1 for p in ppls):
        raise ConfigError(f"--targets: {text!r}: perplexities must be > 1")
    return sorted(ppls, reverse=True)


def _dur(seconds: float) -> str:
    return f"{seconds / 3600:.3g} h" if seconds >= 3600 else f"{seconds:.3g} s"


def _spread(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    mid = _dur(statistics.median(got))
    return mid if len(values) == 1 else f"{mid} [{_dur(min(got))}–{_dur(max(got))}] ({len(got)}/{len(values)})"


def _ratio(base: list[float | None], run: list[float | None]) -> str:
    """Median over seeds of base / run (a speed-up > 1: `run` is faster)."""
    pairs = [b / r for b, r in zip(base, run) if b is not None and r is not None]
    if not pairs:
        return "-"
    text = f"{statistics.median(pairs):.3g}×"
    return text if len(pairs) == 1 else f"{text} [{min(pairs):.3g}–{max(pairs):.3g}]"


def _table(table: dict[str, list[list[float | None]]], ppls: list[float], seeds: int) -> str:
    lines = [f"\ntime to target, median [min–max] over {seeds} seed(s)"]
    lines.append("| run | " + " | ".join(f"ppl ≤ {p:g}" for p in ppls) + " |")
    lines.append("|---" * (len(ppls) + 1) + "|")
    for name, per_seed in table.items():
        cells = [_spread([s[i] for s in per_seed]) for i in range(len(ppls))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cona = table["cona"]
    auto = next(v for k, v in table.items() if k.startswith("static-auto"))
    statics = [v for k, v in table.items() if k.startswith("static-")]
    opt = table["optimum sequence (free switches)"][0]
    costed = table["optimum sequence (switch costs charged)"][0]
    for label, base in (("static-auto", auto), ("best static", None)):
        cells = []
        for i in range(len(ppls)):
            if base is None:  # per seed, the static that was fastest to this target
                best = [min((s[k][i] for s in statics if s[k][i] is not None), default=None) for k in range(seeds)]
            else:
                best = [b[i] for b in base]
            cells.append(_ratio(best, [c[i] for c in cona]))
        lines.append(f"| cona vs {label} | " + " | ".join(cells) + " |")
    for label, best_seq in (("optimum vs cona (the gap left)", opt), ("costed optimum vs cona", costed)):
        cells = [_ratio([c[i] for c in cona], [best_seq[i]] * seeds) for i in range(len(ppls))]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _preflight(sim: Any, auto: Any) -> str:
    """Samples/s per rung, the GNS at which each rung starts to beat the one below (Φ's crossover),
    and the ceiling: the optimum sequence's gain over the offline planner's pick."""
    rates = {g: g / sim.true_time[sim.best_at(g)] for g in sim.ladder}
    base = rates[sim.ladder[0]]
    lines = [f"world: {sim.spec.truth.name}, {len(sim.space)} feasible strategies; samples/s per rung:"]
    lines.append("  " + ", ".join(f"{g}: {r:.4g} ({r / base:.2f}×)" for g, r in rates.items()))
    crossings = []
    for lo, hi in zip(sim.ladder, sim.ladder[1:]):
        x_lo, x_hi = rates[lo], rates[hi]
        # x_hi / (hi + G) > x_lo / (lo + G)  <=>  G > (x_lo hi - x_hi lo) / (x_hi - x_lo)
        cross = (x_lo * hi - x_hi * lo) / (x_hi - x_lo) if x_hi > x_lo else math.inf
        crossings.append(
            f"{hi} beats {lo} at GNS > {max(cross, 0):.4g}" if math.isfinite(cross) else f"{hi} never beats {lo}"
        )
    lines.append("  " + "; ".join(crossings))
    lines.append(f"  offline planner's pick (static-auto): {auto}")
    from cona_cli.planner.ceiling import ceiling

    if auto.gbs in rates:
        lines.append("  verdict: " + ceiling(rates, auto.gbs).verdict())
    return "\n".join(lines)


def _gains(table: dict[str, list[list[float | None]]], ppls: list[float]) -> str:
    """The simulated gains over static-auto at the last target: cona's (median over seeds) and the costed
    optimum's (the most any policy could gain here)."""
    auto = next(v for k, v in table.items() if k.startswith("static-auto"))
    auto_t = [seed[-1] for seed in auto]
    cona = _ratio(auto_t, [seed[-1] for seed in table["cona"]])
    best = _ratio(auto_t, [table["optimum sequence (switch costs charged)"][0][-1]] * len(auto_t))
    return f"  predicted gain over static-auto at ppl {ppls[-1]:g}: cona {cona}, the costed optimum {best}"
